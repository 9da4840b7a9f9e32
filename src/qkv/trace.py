"""Recording what attention calls compute, for explanations and pictures.

    with qkv.trace(model) as t:           # model: any torch module (qkv layers, Hugging Face
        model(**inputs)                   # models on attn_implementation="qkv", ...)
    t[0].weights                          # (B, H, Lq, Lk) softmax weights of the first call
    t.layer(3).scores                     # (B, H, Lq, Lk) scaled scores of layer 3

Every call of ``qkv.attention`` made inside the ``with`` block becomes one ``AttentionRecord``:
which module made it (qualified name and layer index), its inputs q, k, v, the scale and the mask
applied, the weights and the output, with every head kept. ``keep`` and ``layers`` limit what is
stored, so that long inputs stay within memory.

How it works: a trace is the active observer (``qkv.observers``) inside its ``with`` block;
``qkv.attention`` hands it each call's canonical inputs, output and weights (``record``) after
the call ran, on whichever backend it would have run on anyway. Where the backend returned no
weights (fused kernels never form them), the trace computes them from the same inputs with the
reference backend, the formula itself. While a trace is active, a global module pre/post forward
hook keeps the stack of modules being run, which tells which module (and so which layer) made
each call.

Legend: B batch, H heads (Hq query heads, Hkv key/value heads), Lq query length, Lk key length,
D features.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Iterator
from contextvars import Token
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qkv import masks, observers
from qkv.backends import dispatch
from qkv.backends.base import Call, compute_dtype

#: What a trace can keep of each call (``keep=``): the attention module's input ``x``, the
#: queries, keys and values, the weights and the output. The mask is always kept (it is small:
#: stored unexpanded); the scores are computed from q and k when asked for.
FIELDS = ("x", "q", "k", "v", "weights", "out")
_KEEP_PRESETS = {"all": FIELDS, "weights": ("weights",)}


@dataclass(eq=False)
class AttentionRecord:
    """One attention call: who made it, what went in, what came out (every head kept).

    Tensors are detached; a field that the trace was told not to keep is None.
    ``k`` and ``v`` have ``Hkv`` heads; with grouped-query attention (``groups`` > 1) key/value
    head j serves query heads j*groups ... j*groups+groups-1.
    """

    index: int  # position of the call in the trace (0, 1, ...)
    name: str  # qualified name of the module that made the call ("" outside any module)
    layer: int | None  # layer index: the first number in ``name``, else the module's order
    module: str  # class name of that module ("" outside any module)
    scale: float  # the factor the scores q·k were multiplied by (default 1/√Dk)
    causal_offset: int | None  # query i may attend key j iff j <= i + causal_offset (None: all)
    call_mask: torch.Tensor | None  # the mask as given: bool (True = may attend) or float (added)
    shape: tuple[int, ...]  # (*batch, Hq, Lq, Lk): the shape of scores and weights
    groups: int  # query heads per key/value head
    softcap: float | None = None  # scores were soft-capped: softcap · tanh(s / softcap)
    sinks: torch.Tensor | None = None  # (Hq,) each head's sink logit (a key with value 0)
    alibi_slopes: torch.Tensor | None = None  # (*batch, Hq): −slope · |i + Lk − Lq − j| added
    window_offset: int | None = None  # query i may attend key j only if j >= i + window_offset
    segments: tuple[torch.Tensor, torch.Tensor] | None = None  # segment ids of queries, keys
    x: torch.Tensor | None = None  # input of the module that made the call, e.g. (B, L, E)
    q: torch.Tensor | None = None  # (*batch, Hq, Lq, Dk)
    k: torch.Tensor | None = None  # (*batch, Hkv, Lk, Dk)
    v: torch.Tensor | None = None  # (*batch, Hkv, Lk, Dv)
    weights: torch.Tensor | None = None  # (*batch, Hq, Lq, Lk) softmax probabilities
    out: torch.Tensor | None = None  # (*batch, Hq, Lq, Dv), before any output projection
    _cache: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)

    @property
    def heads(self) -> int:
        """Hq, the number of query heads."""
        return self.shape[-3]

    @property
    def mask(self) -> torch.Tensor | None:
        """Bool "may attend" (True = may attend), broadcastable to (*batch, Hq, Lq, Lk): the
        call's mask, its causal rule, window and segments together. None when every query may
        attend every key."""
        if "mask" not in self._cache:
            lq, lk = self.shape[-2], self.shape[-1]
            device = self.call_mask.device if self.call_mask is not None else None
            self._cache["mask"] = masks.tile_keep(
                self.call_mask,
                self.causal_offset,
                0,
                lq,
                0,
                lk,
                torch.device(device or "cpu"),
                window_offset=self.window_offset,
                segments=self.segments,
            )
        return self._cache["mask"]

    @property
    def scores(self) -> torch.Tensor:
        """(*batch, Hq, Lq, Lk) scaled scores ``q·kᵀ × scale`` (soft-capped, plus ALiBi and a
        float mask's values where the call had them), before blocked positions are set to -inf;
        computed from q and k on first use."""
        if "scores" not in self._cache:
            if self.q is None or self.k is None:
                raise ValueError(
                    "scores need q and k, which this trace did not keep; trace with keep='all' "
                    "(or keep=('q', 'k', ...))"
                )
            dtype = compute_dtype(self.q.dtype)
            k = self.k.to(dtype).repeat_interleave(self.groups, dim=-3)  # (*batch, Hq, Lk, Dk)
            scores = (self.q.to(dtype) @ k.transpose(-2, -1)) * self.scale
            if self.softcap is not None:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            if self.alibi_slopes is not None:
                lq, lk = self.shape[-2], self.shape[-1]
                scores = scores + masks.alibi_bias(self.alibi_slopes, 0, lq, 0, lk, lk - lq, dtype)
            bias = masks.tile_bias(self.call_mask, 0, self.shape[-2], 0, self.shape[-1])
            self._cache["scores"] = scores if bias is None else scores + bias.to(dtype)
        cached = self._cache["scores"]
        assert cached is not None
        return cached

    def __repr__(self) -> str:
        kept = ", ".join(
            f"{name}={_shape(getattr(self, name))}"
            for name in FIELDS
            if getattr(self, name) is not None
        )
        where = self.name or "qkv.attention"
        return f"AttentionRecord(#{self.index} {where!r}, layer={self.layer}, {kept})"


class Trace:
    """Records every ``qkv.attention`` call made inside its ``with`` block (see ``trace``).

    A sequence of ``AttentionRecord``: ``len(t)``, ``t[i]``, ``for r in t``; ``t.layer(i)`` is
    the (last) call of layer i and ``t.layers`` the layer indices seen. ``tokens`` (optional)
    labels positions in pictures, e.g. ``t.tokens = tokenizer.convert_ids_to_tokens(ids)``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        layers: Iterable[int | str] | None = None,
        keep: str | Iterable[str] = "all",
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.model = model
        self.keep = _keep_fields(keep)
        self.layers_wanted = _layer_selection(layers)
        self.records: list[AttentionRecord] = []
        self.tokens: list[str] | None = None
        self._names: dict[int, str] = {}  # id(module) -> qualified name
        self._order: dict[int, int] = {}  # id(module) -> order of its first call
        self._stack: list[tuple[nn.Module, torch.Tensor | None]] = []  # (module, its input)
        self._handles: list[RemovableHandle] = []
        self._token: Token[observers.Observer | None] | None = None
        if model is not None:
            self._names = {id(m): name for name, m in model.named_modules()}

    # --- context manager ---------------------------------------------------------------------

    def __enter__(self) -> Trace:
        if self._token is not None:
            raise RuntimeError("this trace is already active; make a new qkv.trace() instead")
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter_module),
            nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True),
        ]
        self._token = observers.activate(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()
        if self._token is not None:
            observers.deactivate(self._token)
            self._token = None

    def _enter_module(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if observers.current() is not self:  # hooks are global: ignore other threads and contexts
            return
        if not self._stack and self.model is None and id(module) not in self._names:
            # The outermost module run names everything inside it.
            self._names.update({id(m): name for name, m in module.named_modules()})
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self._stack.append((module, first))

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if observers.current() is not self:
            return
        if self._stack and self._stack[-1][0] is module:
            self._stack.pop()

    # --- the Observer protocol ------------------------------------------------------------------

    def record(self, call: Call, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Store one call (``qkv.attention`` calls this for every call made inside the trace)."""
        module, name, layer, x = self._caller()
        if not self._selected(name, layer):
            return
        if weights is None and "weights" in self.keep:
            # The backend returned none (fused kernels never form them): compute them from the
            # same call with the reference backend, the formula itself.
            _, weights, _ = dispatch.run(
                dataclasses.replace(call, return_weights=True, return_lse=False, dropout_p=0.0),
                "reference",
            )
        self.records.append(
            AttentionRecord(
                index=len(self.records),
                name=name,
                layer=layer,
                module="" if module is None else type(module).__name__,
                scale=call.scale,
                causal_offset=call.causal_offset,
                call_mask=None if call.mask is None else call.mask.detach(),
                shape=call.scores_shape,
                groups=call.groups,
                softcap=call.rules.softcap,
                sinks=None if call.rules.sinks is None else call.rules.sinks.detach(),
                alibi_slopes=None
                if call.rules.alibi_slopes is None
                else call.rules.alibi_slopes.detach(),
                window_offset=call.rules.window_offset,
                segments=call.rules.segments,
                x=self._kept("x", x),
                q=self._kept("q", call.q),
                k=self._kept("k", call.k),
                v=self._kept("v", call.v),
                weights=self._kept("weights", weights),
                out=self._kept("out", out),
            )
        )

    def _kept(self, field_name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """``value`` detached if the trace keeps ``field_name``, else None."""
        return None if field_name not in self.keep or value is None else value.detach()

    def _caller(self) -> tuple[nn.Module | None, str, int | None, torch.Tensor | None]:
        """(module, qualified name, layer index, module input) of the innermost running module."""
        if not self._stack:
            return None, "", None, None
        module, x = self._stack[-1]
        name = self._names.get(id(module)) or type(module).__name__  # root: ""
        number = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
        if number is not None:
            layer = int(number.group(1))
        else:
            layer = self._order.setdefault(id(module), len(self._order))
        return module, name, layer, x

    def _selected(self, name: str, layer: int | None) -> bool:
        if self.layers_wanted is None:
            return True
        return any(
            (isinstance(want, int) and want == layer)
            or (isinstance(want, str) and fnmatch.fnmatchcase(name, want))
            for want in self.layers_wanted
        )

    # --- reading the records -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[AttentionRecord]:
        return iter(self.records)

    def __getitem__(self, index: int) -> AttentionRecord:
        return self.records[index]

    @property
    def layers(self) -> list[int]:
        """The layer indices recorded, in increasing order."""
        return sorted({r.layer for r in self.records if r.layer is not None})

    def layer(self, index: int) -> AttentionRecord:
        """The last call recorded for layer ``index`` (ValueError if there is none)."""
        for record in reversed(self.records):
            if record.layer == index:
                return record
        raise ValueError(f"layer must be one of the layers recorded {self.layers}, got {index}")

    def __repr__(self) -> str:
        lines = [f"Trace({len(self.records)} attention calls)"]
        lines += [f"  {record!r}" for record in self.records[:20]]
        if len(self.records) > 20:
            lines.append(f"  ... {len(self.records) - 20} more")
        return "\n".join(lines)


def trace(
    model: nn.Module | None = None,
    *,
    layers: Iterable[int | str] | None = None,
    keep: str | Iterable[str] = "all",
) -> Trace:
    """Record every ``qkv.attention`` call made inside a ``with`` block.

    ``model`` (optional) names the modules: records say e.g. ``"encoder.layer.3.attention.self"``
    and layer 3. Without it, the outermost module run inside the block names them.
    ``layers``: keep only these calls — ints are layer indices, strings are module names
    (``fnmatch`` patterns such as ``"*.layer.5.*"``); others are not recorded and run unchanged.
    ``keep``: ``"all"`` (x, q, k, v, weights, out), ``"weights"`` (weights only), or any of
    x, q, k, v, weights, out. The mask applied is always kept, and scores are computed from q and k.

    Tracing never changes which backend runs a call or what it computes. Where that backend
    returns no weights, the trace computes them from the call's q, k, mask and scale with the
    reference backend (the formula), so the weights recorded equal those of the output's
    computation within the dtype's rounding.
    """
    return Trace(model, layers=layers, keep=keep)


def _keep_fields(keep: Any) -> tuple[str, ...]:
    if isinstance(keep, str):
        if keep in _KEEP_PRESETS:
            return _KEEP_PRESETS[keep]
        keep = (keep,)
    try:
        fields = tuple(keep)
    except TypeError:
        raise TypeError(
            f"keep must be 'all', 'weights' or an iterable of {FIELDS}, got {type(keep).__name__}"
        ) from None
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise ValueError(f"keep must name fields among {FIELDS} (or be 'all'), got {unknown}")
    return fields


def _layer_selection(layers: Any) -> tuple[int | str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, (int, str)):
        layers = (layers,)
    selection = tuple(layers)
    for want in selection:
        if isinstance(want, bool) or not isinstance(want, (int, str)):
            raise TypeError(
                f"layers must hold layer indices (int) or module names (str), got "
                f"{type(want).__name__}"
            )
    return selection


def _shape(x: torch.Tensor | None) -> str:
    return "None" if x is None else "(" + ", ".join(str(s) for s in x.shape) + ")"
