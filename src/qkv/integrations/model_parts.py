"""Which parts of a transformers model run on qkv, and which keep their own attention code.

A part of a model can run on qkv when its attention layers call transformers' attention
interface. Some compute attention in their own code instead: they would never call qkv, would
read qkv's masks as numbers, or look their attention class up by implementation name and fail
on an unknown one. transformers decides "does this class use the interface" by reading its
module's source (``_can_set_attn_implementation``); qkv adds the look-up by name
(``ATTENTION_CLASSES[config._attn_implementation]``), which that test misses.

``split(model, name)`` runs when a model asks for qkv: every sub-config (vision, audio, text,
..., at any depth) whose model class keeps its own code is set to "eager", one warning names
those parts, and the rest stays on qkv. A model whose own layers keep their own code runs them
on "eager" too; if no part at all is left for qkv, asking for it is a ValueError naming the
model and the alternative.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from typing import Any

# A look-up of an attention class by implementation name: its classes are the model's own code.
_BY_NAME = re.compile(r"_CLASSES\[\s*(?:self\.)?config\._attn_implementation\s*\]")
_OWN_CODE: dict[str, bool] = {}  # model class -> whether it reaches a look-up by name
_WARNED: set[tuple[str, tuple[str, ...]]] = set()


def uses_the_interface(model_class: Any) -> bool:
    """Whether a model class's attention layers call transformers' attention interface: its
    modeling file does (transformers' test), and no class it builds there looks its attention
    class up by implementation name."""
    if not _transformers_verdict(model_class):
        return False
    key = f"{getattr(model_class, '__module__', '')}.{getattr(model_class, '__name__', '')}"
    if key not in _OWN_CODE:
        _OWN_CODE[key] = _reaches_a_look_up_by_name(model_class)
    return not _OWN_CODE[key]


def _reaches_a_look_up_by_name(model_class: Any) -> bool:
    """Whether ``model_class``, or a class of its module that its source names (and so on),
    looks an attention class up by implementation name."""
    module = sys.modules.get(getattr(model_class, "__module__", ""))
    sources: dict[str, str] = {}
    for name, value in vars(module).items() if module is not None else ():
        if inspect.isclass(value) and value.__module__ == module.__name__:  # type: ignore[union-attr]
            try:
                sources[name] = inspect.getsource(value)
            except (OSError, TypeError):
                continue
    seen: set[str] = set()
    waiting = [model_class.__name__]
    while waiting:
        name = waiting.pop()
        if name in seen or name not in sources:
            continue
        seen.add(name)
        if _BY_NAME.search(sources[name]):
            return True
        waiting.extend(re.findall(r"\b[A-Z]\w+", sources[name]))
    return False


def split(model: Any, name: str) -> str | None:
    """Set the parts of ``model`` that keep their own attention code to "eager" (warning once
    per model class), and return "eager" where the model's own layers keep theirs, else None
    (the model itself runs on ``name``). A ValueError where no part can run on qkv."""
    own_layers = uses_the_interface(type(model))
    verdicts = (own_layers, _transformers_verdict(type(model)))
    on_qkv, on_eager = _parts(model.config, verdicts)
    if not own_layers and not on_qkv:
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(
            f'{type(model).__name__} (model type "{model_type}") computes attention in its '
            f"own code, outside transformers' attention interface, so "
            f'attn_implementation="{name}" cannot run it on qkv (it would never call qkv, or '
            f'misread its mask); load it with attn_implementation="eager" or "sdpa" instead'
        )
    if on_eager or not own_layers:
        _warn_once(model, name, on_qkv, on_eager if own_layers else ["its own layers", *on_eager])
    return None if own_layers else "eager"


def _parts(config: Any, parent: tuple[bool, bool], prefix: str = "") -> tuple[list[str], list[str]]:
    """(sub-configs left on qkv, sub-configs set to "eager"), as dotted keys, at any depth.
    ``parent``: whether the parent's modeling file uses the interface by qkv's test, and by
    transformers' own (which misses look-ups by name)."""
    on_qkv: list[str] = []
    on_eager: list[str] = []
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for key in getattr(config, "sub_configs", {}):
        part = getattr(config, key, None)
        if part is None:
            continue
        uses = _part_uses_the_interface(part, parent[1] if part is text else parent[0])
        if uses:
            on_qkv.append(prefix + key)
            deeper = _parts(part, (uses, uses), f"{prefix}{key}.")
            on_qkv, on_eager = on_qkv + deeper[0], on_eager + deeper[1]
        else:
            part._attn_implementation = "eager"  # (transformers' setter: its parts too)
            on_eager.append(prefix + key)
    return on_qkv, on_eager


def _part_uses_the_interface(config: Any, parent_uses: bool) -> bool:
    """Whether the model class transformers builds for a sub-config (its auto mappings) uses
    the interface; for a part only its parent's code knows, ``parent_uses``: what its parent's
    file does. A parent's language model is judged by transformers' own test of that file: the
    look-ups by name seen so far serve vision encoders beside it (SAM's), and were one to serve
    the language model, asking it for qkv would fail loudly (a KeyError), never silently."""
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_MAPPING, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING):
        try:
            model_class = mapping[type(config)]
        except (KeyError, ValueError):
            continue
        return uses_the_interface(model_class)
    return parent_uses


def _transformers_verdict(model_class: Any) -> bool:
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    return can_set is None or bool(can_set())


def _warn_once(model: Any, name: str, on_qkv: list[str], on_eager: list[str]) -> None:
    key = (type(model).__name__, tuple(on_eager))
    if key in _WARNED:
        return
    _WARNED.add(key)
    model_type = getattr(model.config, "model_type", "?")
    rest = f'; {", ".join(on_qkv)} run on "{name}"' if on_qkv else ""
    warnings.warn(
        f'{type(model).__name__} (model type "{model_type}"): {", ".join(on_eager)} compute '
        f'attention outside transformers\' attention interface and run on "eager"{rest}',
        UserWarning,
        stacklevel=4,
    )
