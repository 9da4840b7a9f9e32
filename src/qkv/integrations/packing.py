"""Sequences packed by position ids in Hugging Face models on qkv: document ids, not a mask.

transformers packs several documents into one row without padding (``DataCollatorWithFlattening``
with ``return_position_ids=True``): each document restarts its positions, and with no attention
mask and no cache, ``create_causal_mask`` turns the position ids into document ids and builds a
dense (B, 1, L, L) mask that lets a query attend only the earlier keys of its own document.

qkv needs no such mask: its causal rule with ``segments=`` (the document ids) means the same.
``causal_rule`` recognises transformers' request for exactly that mask (the mask function is
inspected, never evaluated) and returns the document ids transformers found; the integration's
mask function remembers them for the model's config (``remember``) and returns no mask; its
attention function reads them back for the layer's config (``documents``).

A layer whose config the mask function never saw (a model composed in another way) falls back to
the position ids it receives, as transformers' flash-attention path does. Legend: B batch, L
length.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# id(config) -> (a weak reference to the config, its document ids (B, L) or None). The ids
# are those of the model's last forward: each causal mask request replaces them.
_DOCUMENTS: dict[int, tuple[weakref.ref[Any], torch.Tensor | None]] = {}


def causal_rule(kwargs: dict[str, Any]) -> tuple[bool, torch.Tensor | None]:
    """(whether a request to transformers' mask function is for its causal rule, the (B, L)
    document ids when it is that rule within sequences packed by position ids, else None).

    Recognised: the causal or sliding-window causal mask function, alone or composed as
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` compose it for packing (the
    rule remapped to the position ids, and the same document), without padding or cache
    offsets. Anything else (overlays, chunked or bidirectional attention, another composition)
    is not the causal rule, and its mask is built.
    """
    function = kwargs.get("mask_function")
    if _is_causal(function):
        return True, None
    parts = _composed(function, "and_masks")
    if parts is None or len(parts) != 2:
        return False, None
    remapped, same_document = parts
    base = _closure(remapped, "remap_positions_for_packed_sequence").get("mask_function")
    documents = _closure(same_document, "packed_sequence_mask_function").get("packed_sequence_mask")
    offsets = [kwargs.get(name, 0) for name in ("q_offset", "kv_offset")]  # (tensors: a cache)
    plain = kwargs.get("attention_mask") is None and all(
        isinstance(offset, int) and offset == 0 for offset in offsets
    )
    length = kwargs.get("q_length")
    if not (_is_causal(base) and plain and length == kwargs.get("kv_length")):
        return False, None
    if not isinstance(documents, torch.Tensor) or documents.ndim != 2:
        return False, None
    return (True, documents) if documents.shape[-1] == length else (False, None)


def remember(config: Any, documents: torch.Tensor | None) -> None:
    """Keep ``documents`` (or None: one document per row) as ``config``'s model's packing."""
    for key, (reference, _) in list(_DOCUMENTS.items()):
        if reference() is None:
            del _DOCUMENTS[key]
    if config is not None:
        _DOCUMENTS[id(config)] = (weakref.ref(config), documents)


def documents(module: torch.nn.Module, position_ids: Any, batch: int, length: int) -> Any:
    """The (B or 1, L) document ids of a causal layer given no mask (queries and keys of one
    length L), or None: those remembered for the layer's config, else those its position ids
    show."""
    config = getattr(module, "config", None)
    entry = _DOCUMENTS.get(id(config)) if config is not None else None
    if entry is not None and entry[0]() is config:
        ids = entry[1]
        fits = ids is not None and ids.shape[-1] == length and ids.shape[0] in (1, batch)
        return ids if fits else None
    return from_position_ids(position_ids, batch, length)


def from_position_ids(position_ids: Any, batch: int, length: int) -> torch.Tensor | None:
    """(B or 1, L) document ids of sequences packed by their position ids, or None for one
    document per row. transformers' rule (``find_packed_sequence_indices``): a new document
    starts wherever a position is not its predecessor's plus one."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point():
        return None
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    if position_ids.ndim != 2 or position_ids.shape[-1] != length or length < 2:
        return None
    if position_ids.shape[0] not in (1, batch):
        return None
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    ids = (steps != 1).cumsum(-1)
    return ids if bool(ids[:, -1].any()) else None


def _is_causal(function: Any) -> bool:
    """transformers' causal mask function, or its sliding-window causal one (any window)."""
    from transformers import masking_utils

    if function is masking_utils.causal_mask_function:
        return True
    parts = _composed(function, "and_masks")  # sliding_window_causal_mask_function's
    return (
        parts is not None
        and len(parts) == 2
        and bool(_closure(parts[0], "sliding_window_overlay"))
        and parts[1] is masking_utils.causal_mask_function
    )


def _composed(function: Any, factory: str) -> tuple[Any, ...] | None:
    """The mask functions that transformers' ``and_masks`` / ``or_masks`` combined into
    ``function``, or None if ``function`` is not such a combination."""
    parts = _closure(function, factory).get("mask_functions")
    return parts if isinstance(parts, tuple) else None


def _closure(function: Any, factory: str) -> dict[str, Any]:
    """The variables a mask function made by ``transformers.masking_utils.<factory>`` closes
    over, by name; empty if ``function`` was not made there."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    made_there = getattr(function, "__module__", None) == "transformers.masking_utils" and str(
        getattr(function, "__qualname__", "")
    ).startswith(f"{factory}.<locals>.")
    if code is None or not cells or not made_there:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
