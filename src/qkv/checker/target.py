"""The implementation under check: built from what it accepts, called the same way every time.

A *target* is an ``nn.Module`` (self-attention over x (B, L, E)) or a function ``f(q, k, v, ...)``
over raw tensors (B, H, L, D) or (B, L, D). Constructor and forward parameters are matched by
their usual names; what cannot be matched is reported with the option that supplies it.
Legend: B batch, H heads, L length, E model width, D head size.
"""

from __future__ import annotations

import ast
import copy
import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from qkv.checker.inputs import Inputs

WIDTH_NAMES = (
    "embed_dim", "d_model", "hidden_dim", "hidden_size", "dim", "d_in", "n_embd", "emb_dim",
    "embedding_dim", "model_dim", "input_dim", "in_dim", "d",
)  # fmt: skip
OUT_NAMES = ("d_out", "out_dim", "output_dim")
KEY_NAMES = ("d_k", "k_dim", "key_dim", "dim_k", "d_key", "qk_dim")
VALUE_NAMES = ("d_v", "v_dim", "value_dim", "dim_v", "d_value")
HEAD_NAMES = ("num_heads", "n_heads", "heads", "n_head", "nhead", "num_attention_heads", "h")
DROPOUT_NAMES = (
    "dropout", "dropout_rate", "p", "attn_dropout", "attn_pdrop", "dropout_p",
    "attention_dropout", "attention_probs_dropout_prob",
)  # fmt: skip
LENGTH_NAMES = (
    "no_of_tokens", "block_size", "context_length", "max_len", "max_seq_len", "seq_len",
    "n_tokens", "max_length", "num_tokens", "max_position_embeddings", "n_ctx",
)  # fmt: skip
CAUSAL_NAMES = ("causal", "is_causal")
MASK_NAMES = ("key_padding_mask", "padding_mask", "attention_mask", "attn_mask", "mask")
WEIGHT_NAMES = (
    "return_weights", "need_weights", "return_attention", "output_attentions", "return_attn",
)  # fmt: skip
CONFIG_NAMES = ("config", "cfg", "args", "params", "hparams")
BOOL_NAMES = ("bias", "qkv_bias", "use_bias")

D_MODEL, HEADS, D_OUT, MAX_LENGTH = 32, 4, 24, 64
# The value width of the probe that tells a scale by √Dv from one by √Dk: a width no other size has.
D_VALUE = 16


class CheckError(Exception):
    """The implementation cannot be run; the message says what to pass so that it can."""


def error_text(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (messages can hold
    whole tensors)."""
    lines = str(error).strip().splitlines()
    first = lines[0].rstrip(". ") if lines else ""
    if len(first) > limit:
        first = first[:limit] + " …"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@dataclass
class Output:
    """One call's output, (B, L, F) rows (a function's (B, H, L, D) is merged), and its weights."""

    out: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor | None


@dataclass
class Target:
    """How to build and call one implementation."""

    name: str
    kind: str  # "module" or "function"
    impl: Any  # the nn.Module or the function
    width: int  # features of x (module) or of q and k per head (function)
    heads: int | None
    out_width: int | None  # the output's features when known in advance
    layout: str = "BLE"  # inputs: "BLE" (module x or 3-d function q/k/v) or "BHLD"
    init: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[dict[str, Any]], nn.Module] | None = None
    causal_param: str | None = None  # forward parameter
    causal_init: str | None = None  # constructor parameter
    mask_param: str | None = None
    weights_param: str | None = None
    dropout_init: str | None = None
    dropout_default: float | None = None  # the constructor's own default for it
    value_init: str | None = None  # a constructor argument for the value width (Dv ≠ Dk)
    config_param: str | None = None  # nanoGPT style: the one constructor argument is a config
    forward: dict[str, Any] = field(default_factory=dict)
    query_key_value: bool = False  # forward(query, key, value): x is passed three times
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def module(self) -> nn.Module | None:
        return self.impl if isinstance(self.impl, nn.Module) else None

    def variant(self, **init: Any) -> Target | None:
        """The same target built with some constructor arguments changed; None if it was given
        built (an instance) or does not take them."""
        if self.factory is None:
            return None
        merged = {**self.init, **init}
        if self.config_param is not None:  # a changed name changes its synonyms in the config
            fields = dict(vars(self.init[self.config_param]))
            for key, value in init.items():
                group = next((g for g in (DROPOUT_NAMES, CAUSAL_NAMES) if key in g), (key,))
                fields.update({name: value for name in group if name in fields})
            merged = {self.config_param: types.SimpleNamespace(**fields)}
        torch.manual_seed(0)
        return replace(self, impl=self.factory(merged).to(self.device), init=merged)

    def dtype_copy(self, dtype: torch.dtype) -> Target:
        module = self.module
        if module is None:
            return self
        return replace(self, impl=copy.deepcopy(module).to(dtype))

    def inputs(
        self, batch: int, length: int, *, seed: int = 0, value_width: int | None = None
    ) -> Inputs:
        """x (B, L, E) for a module; q, k, v for a function, v ``value_width`` wide if given."""
        generator = torch.Generator().manual_seed(seed)
        if self.kind == "module":
            shape: tuple[int, ...] = (batch, length, self.width)
            return Inputs((torch.randn(shape, generator=generator),), seq_dim=1)
        shape = (batch, length, self.width)
        if self.layout == "BHLD":
            shape = (batch, self.heads or 1, length, self.width)
        value_shape = (*shape[:-1], value_width or self.width)
        q, k = (torch.randn(shape, generator=generator) for _ in range(2))
        v = torch.randn(value_shape, generator=generator)
        return Inputs((q, k, v), seq_dim=len(shape) - 2)

    def call(
        self,
        inputs: Inputs,
        *,
        causal: bool = False,
        mask: torch.Tensor | None = None,
        weights: bool = False,
    ) -> Output:
        """Run once. ``causal`` must be False unless the target has a way to ask for it."""
        kwargs = dict(self.forward)
        if self.causal_param is not None:
            kwargs[self.causal_param] = causal
        if mask is not None:
            assert self.mask_param is not None
            kwargs[self.mask_param] = mask.to(self.device)
        if weights and self.weights_param is not None:
            kwargs[self.weights_param] = True
        tensors = tuple(t.to(self.device) for t in inputs.tensors)  # differentiable: grads
        result = self.impl(*(tensors * 3 if self.query_key_value else tensors), **kwargs)
        return normalise(result, inputs, self.layout)


def normalise(result: Any, inputs: Inputs, layout: str) -> Output:
    """``out``, ``(out, weights)`` or a longer tuple -> Output, on the CPU (where every check
    compares); weights are the last item whose last two dims are (L, L)."""
    items = list(result) if isinstance(result, tuple | list) else [result]
    out = items[0] if items else None
    if not isinstance(out, torch.Tensor):
        raise CheckError(
            f"it returned {type(result).__name__}; qkv check needs a tensor, or a tuple whose "
            "first item is the output tensor (wrap it in a small function that returns that)"
        )
    length = inputs.length
    weights = None
    for item in items[1:]:
        if isinstance(item, torch.Tensor) and item.dim() >= 3 and item.shape[-2:] == (length,) * 2:
            weights = item.cpu()
    out = out.cpu()
    rows = out
    if layout == "BHLD" and out.dim() == 4:  # (B, H, L, D) -> (B, L, H*D)
        rows = out.transpose(1, 2).flatten(2)
    return Output(out, rows, weights)


def parse_options(text: str | None, option: str) -> dict[str, Any]:
    """``"d_model=64,n_heads=4,causal=True"`` -> a dict of Python values (strings kept as text)."""
    options: dict[str, Any] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip().isidentifier():
            raise CheckError(f"{option} takes name=value pairs separated by commas, got {part!r}")
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[name.strip()] = value.strip()
    return options


def _first(names: tuple[str, ...], present: Mapping[str, Any]) -> str | None:
    return next((name for name in names if name in present), None)


def parameters_of(fn: Any, skip: int) -> dict[str, inspect.Parameter]:
    """``fn``'s named parameters after the first ``skip`` (no *args/**kwargs); {} if unknown."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: p for p in params[skip:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _with_params(target: Target, params: Mapping[str, Any], forward: dict[str, Any]) -> Target:
    given = set(forward)  # what --forward fixes is not the checker's to vary
    return replace(
        target,
        causal_param=None if given & set(CAUSAL_NAMES) else _first(CAUSAL_NAMES, params),
        mask_param=_first(tuple(n for n in MASK_NAMES if n not in given), params),
        weights_param=_first(tuple(n for n in WEIGHT_NAMES if n not in given), params),
        forward=forward,
    )


def from_module(
    module: nn.Module,
    name: str,
    forward: dict[str, Any],
    width: int | None = None,
    device: torch.device | None = None,
) -> Target:
    """An instance: its input width (unless given) and heads from its attributes or first
    Linear layer; it runs where its parameters are (unless ``device`` says otherwise)."""
    module = torch_mha_view(module)
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    module.to(device)
    width = width or _attribute(module, WIDTH_NAMES)
    if width is None:
        first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise CheckError(
                f"{name}: cannot tell the input width (no d_model-like attribute, no nn.Linear); "
                "give it an attribute d_model, or check a small adapter module"
            )
        width = first.in_features
    heads = _attribute(module, HEAD_NAMES)
    every = parameters_of(module.forward, skip=0)
    required = [p for p in every.values() if p.default is p.empty and p.name not in forward]
    query_key_value = len(required) >= 3  # forward(query, key, value, ...)
    params = dict(list(every.items())[3 if query_key_value else 1 :])
    target = Target(
        name, "module", module, width, heads, None, query_key_value=query_key_value, device=device
    )
    return _with_params(target, params, forward)


def _init_kwargs(params: Mapping[str, inspect.Parameter], given: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments by their usual names; ``given`` (``--init``) wins."""
    kwargs: dict[str, Any] = {}
    for names, value in (
        (WIDTH_NAMES, D_MODEL),
        (OUT_NAMES, D_OUT),
        (KEY_NAMES, D_OUT),
        (VALUE_NAMES, D_OUT),
        (HEAD_NAMES, HEADS),
        (DROPOUT_NAMES, 0.0),
        (LENGTH_NAMES, MAX_LENGTH),
        (CAUSAL_NAMES, False),
    ):
        found = _first(names, params)
        if found is not None:
            kwargs[found] = value
    for param in params.values():  # a bias flag without a default gets True
        if param.name in BOOL_NAMES and param.default is param.empty:
            kwargs[param.name] = True
    config = _first(CONFIG_NAMES, params)
    if config is not None and len(params) == 1:  # nanoGPT style: one config object
        fields = {n: v for names, v in _config_values() for n in names}
        return {config: types.SimpleNamespace(**{**fields, **given})}
    kwargs.update(given)
    return kwargs


def _config_values() -> list[tuple[tuple[str, ...], Any]]:
    return [
        (WIDTH_NAMES, D_MODEL),
        (HEAD_NAMES, HEADS),
        (DROPOUT_NAMES, 0.0),
        (LENGTH_NAMES, MAX_LENGTH),
        (BOOL_NAMES, False),
        (CAUSAL_NAMES, False),
    ]


def from_class(
    cls: type[nn.Module],
    name: str,
    init: dict[str, Any],
    forward: dict[str, Any],
    device: torch.device | None = None,
) -> Target:
    """Build the module from its constructor's parameter names."""
    params = parameters_of(cls.__init__, skip=1)
    kwargs = _init_kwargs(params, init)
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs]
    if missing:
        example = ",".join(f"{n}=..." for n in missing)
        raise CheckError(
            f"{name}: cannot build it: its constructor needs {', '.join(missing)}, which qkv "
            f"check does not recognise; pass them: --init {example} (Python: init={{...}})"
        )

    def factory(arguments: dict[str, Any]) -> nn.Module:
        try:
            return cls(**arguments)
        except Exception as error:  # the user's constructor: any failure is reported
            shown = ",".join(f"{k}={v!r}" for k, v in arguments.items())
            raise CheckError(
                f"{name}({shown}) raised {error_text(error)}; pass the right "
                "constructor arguments with --init name=value,..."
            ) from error

    config = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    is_config = isinstance(config, types.SimpleNamespace)
    values = vars(config) if is_config else kwargs
    width = next((values[n] for n in WIDTH_NAMES if n in values), None)
    dropout = _first(DROPOUT_NAMES, values if is_config else params)
    torch.manual_seed(0)
    built = factory(kwargs).to(device or torch.device("cpu"))
    target = from_module(built, name, forward, width=width, device=device)
    return replace(
        target,
        heads=next((values[n] for n in HEAD_NAMES if n in values), target.heads),
        out_width=next((values[n] for n in OUT_NAMES if n in values), None),
        init=kwargs,
        factory=factory,
        config_param=_first(CONFIG_NAMES, params) if is_config else None,
        causal_init=None if is_config else _first(CAUSAL_NAMES, params),
        dropout_init=dropout,
        dropout_default=_default_rate(params.get(dropout or "")),
        value_init=None if is_config else _first(VALUE_NAMES, params),
    )


def _default_rate(param: inspect.Parameter | None) -> float | None:
    """A constructor's default dropout rate, when it has a numeric one."""
    if param is None or isinstance(param.default, bool):
        return None
    return float(param.default) if isinstance(param.default, int | float) else None


def from_function(
    fn: Callable[..., Any],
    name: str,
    forward: dict[str, Any],
    device: torch.device | None = None,
) -> Target:
    """``f(q, k, v, ...)``: tried on (B, H, L, D) first, then on (B, L, D)."""
    params = parameters_of(fn, skip=3)
    bare = Target(name, "function", fn, D_MODEL // HEADS, HEADS, None)
    target = _with_params(replace(bare, device=device or torch.device("cpu")), params, forward)
    errors = []
    for layout in ("BHLD", "BLE"):
        candidate = replace(target, layout=layout)
        if layout == "BLE":
            candidate = replace(candidate, heads=1, width=D_MODEL // HEADS)
        try:
            with torch.no_grad():
                output = candidate.call(candidate.inputs(2, 7))
        except CheckError:
            raise
        except Exception as error:  # the user's function: any failure is reported
            errors.append(f"{layout}: {error_text(error)}")
            continue
        if output.rows.shape[:2] == (2, 7):
            return candidate
        errors.append(f"{layout}: returned shape {tuple(output.out.shape)}")
    raise CheckError(
        f"{name}(q, k, v) ran on neither q, k, v (B, H, L, D) = (2, 4, 7, 8) nor (B, L, D) = "
        f"(2, 7, 8): {'; '.join(errors)}. Pass fixed arguments with --forward name=value, or "
        "check a small adapter f(q, k, v) that calls it"
    )


def torch_mha_view(module: nn.Module) -> nn.Module:
    """``torch.nn.MultiheadAttention`` (or qkv's drop-in) seen as self-attention over x."""
    is_multihead = hasattr(module, "in_proj_weight") and hasattr(module, "num_heads")
    return SelfAttentionView(module) if is_multihead else module


class SelfAttentionView(nn.Module):
    """x (B, L, E) -> mha(x, x, x), with torch's meanings: key_padding_mask True = ignore."""

    def __init__(self, mha: Any) -> None:
        super().__init__()
        self.mha = mha
        self.embed_dim: int = int(mha.embed_dim)
        self.num_heads: int = int(mha.num_heads)
        self.train(bool(mha.training))  # the view starts in the mode the layer is in

    def forward(
        self,
        x: torch.Tensor,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = bool(getattr(self.mha, "batch_first", False))
        seq = x if first else x.transpose(0, 1)
        length = x.shape[1]
        attn_mask = None
        if causal:  # torch: True = may NOT attend
            attn_mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        out, weights = self.mha(
            seq, seq, seq, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, is_causal=causal, average_attn_weights=False,
        )  # fmt: skip
        return (out if first else out.transpose(0, 1)), weights
