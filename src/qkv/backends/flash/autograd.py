"""flash's one autograd function, for every eager call that needs gradients: dense calls
(``flash.attention``), packed batches (``varlen.py``: per-row key ranges and ALiBi shifts in
``Rules.key_ranges``) and calls with a score_mod or mask_mod (``mods_call.py``: a ``TileMods``
per pass, the tensors the score_mod captures as inputs after the pass's options). It saves q, k,
v, out and lse only; the backward pass recomputes the tiles. Both passes are ``passes.forward``
and ``passes.gradients`` (which ``ops.py``'s custom operators also run when a call is traced),
so the sinks' and the ALiBi slopes' gradients are handled there, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qkv.backends.base import NO_RULES, Rules
from qkv.backends.flash.passes import forward, gradients

if TYPE_CHECKING:
    from qkv.backends.flash.mods import TileMods


class Compiled(Protocol):
    """A call's two passes on a compiled path of its own (``mods_call``: the mods' programs in
    the kernel); each gives None where that path does not run the call."""

    def forward(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def backward(
        self,
        out: torch.Tensor,
        grad_out: torch.Tensor,
        lse: torch.Tensor,
        grad_lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


@dataclass(frozen=True)
class Pass:
    """The non-tensor inputs of a differentiable flash call. ``mods(captured, grad,
    differentiable)`` makes the ``TileMods`` of a call with a score_mod or mask_mod for one pass
    (``grad``: the backward pass), None without one. ``compiled``: the call's two passes on a
    path of its own, tried first (``mods_call``: no sinks, no captured tensor needing a
    gradient)."""

    scale: float
    causal_offset: int | None = None
    mask: torch.Tensor | None = None
    rules: Rules = NO_RULES
    mods: Callable[[list[torch.Tensor], bool, bool], TileMods] | None = None
    compiled: Compiled | None = None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: Pass,
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in the compute dtype, differentiable in q, k, v, the rules' sinks and ALiBi
    slopes, and ``captured`` (the tensors ``options.mods``'s score_mod reads)."""
    rules = options.rules
    result: tuple[torch.Tensor, torch.Tensor] = Attention.apply(  # type: ignore[no-untyped-call]
        q, k, v, rules.sinks, rules.alibi_slopes, options, *captured
    )
    return result


class Attention(torch.autograd.Function):
    """``passes.forward`` and ``passes.gradients`` as one autograd node. Inputs: q, k, v, the
    sinks, the ALiBi slopes (the rules' own, so that their gradients reach them), the ``Pass``,
    then the captured tensors of a score_mod."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
        options: Pass,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result = None if options.compiled is None else options.compiled.forward()
        ctx.compiled = result is not None
        if result is not None:
            out, lse = result
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options, ctx.captured = options, captured
            ctx.set_materialize_grads(False)
            return out, lse
        mods = None if options.mods is None else options.mods(list(captured), False, True)
        out, lse = forward(
            q,
            k,
            v,
            scale=options.scale,
            causal_offset=options.causal_offset,
            mask=options.mask,
            rules=options.rules,
            mods=mods,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.captured = options, captured
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        options: Pass = ctx.options
        captured: tuple[torch.Tensor, ...] = ctx.captured
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        if ctx.compiled:
            assert options.compiled is not None
            result = options.compiled.backward(out, grad_out, lse, grad_lse)
            if result is not None:  # (no sinks, slopes or captured tensors take gradients there)
                dq, dk, dv = result
                grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
                return (*grads, None, None, None, *([None] * len(captured)))
        mods = None if options.mods is None else options.mods(list(captured), True, True)
        dq, dk, dv, dslopes, dsinks = gradients(
            q,
            k,
            v,
            out,
            lse,
            grad_out,
            grad_lse,
            scale=options.scale,
            causal_offset=options.causal_offset,
            mask=options.mask,
            rules=options.rules,
            mods=mods,
        )
        captured_grads = [
            None if g is None else g.to(t.dtype)
            for g, t in zip(mods.captured_grads if mods else (), captured, strict=True)
        ]
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return (*grads, dsinks, dslopes, None, *captured_grads)
