"""flash's entry point for calls with a ``score_mod`` or ``mask_mod``: forward and backward
passes on the compiled kernel with the mods' programs where it takes the call
(``program_call.py``), else the loop with a ``TileMods`` (``mods.py``), inside an autograd
function whose inputs include the tensors the score_mod captures
(``qkv.mods.captured_tensors``), so that their gradients come back. Sinks join each row after
the function (``qkv.logsumexp.shares``, which autograd differentiates); ALiBi slopes as in
``flash``. Legend: B batch, Hq query heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qkv import _tracing, logsumexp
from qkv import mods as own
from qkv.backends import reference
from qkv.backends.base import Call, Rules
from qkv.backends.flash import loop, program_call
from qkv.backends.flash.mods import TileMods


def attention(call: Call) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Run a checked call with a score_mod and/or mask_mod (and its other rules, as flash's
    tiles take them): (out in q's dtype, None, lse if asked)."""
    if _tracing.traced(call.q):  # a tracer sees the dense rule, whole (``qkv.mods``)
        out, _, lse = reference.attention(call)
        return out, None, lse
    rules = call.rules
    captured = (
        own.captured_tensors(call.rules.score_mod) if call.rules.score_mod is not None else []
    )
    learnable = [x for x in (call.rules.sinks, call.rules.alibi_slopes) if x is not None]
    needs = torch.is_grad_enabled() and any(
        x.requires_grad for x in (call.q, call.k, call.v, *learnable, *captured)
    )
    if needs:
        out, lse = _ModsAttention.apply(  # type: ignore[no-untyped-call]
            call.q, call.k, call.v, call.rules.alibi_slopes, (call, rules), *captured
        )
    else:
        with torch.no_grad():
            out, lse, _ = _forward(call, rules, captured, False)
    if call.rules.sinks is not None:  # a key per head of logit sinks[h] and value 0 joins each row
        sink = call.rules.sinks.to(lse.dtype)[:, None].expand_as(lse)  # (*B, Hq, Lq)
        lse, share, _ = logsumexp.shares(lse, sink)
        out = out * share[..., None].to(out.dtype)
    out = out if out.dtype == call.q.dtype else out.to(call.q.dtype)
    return out, None, (lse if call.return_lse else None)


def _tile_mods(
    call: Call, captured: list[torch.Tensor], grad: bool, differentiable: bool = False
) -> TileMods:
    *batch, hq, lq, lk = call.scores_shape
    shape = (math.prod(batch), hq, lq, lk)
    device = call.q.device
    return TileMods(
        call.rules.score_mod, call.rules.mask_mod, shape, device, captured, grad, differentiable
    )


def _forward(
    call: Call, rules: Rules | None, captured: list[torch.Tensor], differentiable: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """out (*B, Hq, Lq, Dv) in the compute dtype and lse (*B, Hq, Lq), without sinks, and
    whether they came from the compiled kernel with the mods' program (``program_call``)."""
    compiled = program_call.forward(call, rules or call.rules, differentiable)
    if compiled is not None:
        return (*compiled, True)
    out, lse = loop.forward(
        call.q,
        call.k,
        call.v,
        scale=call.scale,
        causal_offset=call.causal_offset,
        mask=call.mask,
        rules=rules,
        mods=_tile_mods(call, captured, False, differentiable),
    )
    return out, lse, False


class _ModsAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse; the backward pass runs on the kernel with the mods' programs
    where the forward pass did (``program_call.backward``), else recomputes each tile's scores
    and runs the score_mod under autograd. Inputs after the options: the tensors the score_mod
    captures."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        alibi_slopes: torch.Tensor | None,
        options: tuple[Call, Rules | None],
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call, rules = options
        out, lse, compiled = _forward(call, rules, list(captured), True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.captured, ctx.compiled = options, captured, compiled
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        call, rules = ctx.options
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        if ctx.compiled:
            grads = program_call.backward(call, rules or call.rules, out, grad_out, lse, grad_lse)
            if grads is not None:
                dq, dk, dv = grads
                frozen = [None] * len(ctx.captured)  # (no captured tensor needs a gradient here)
                return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, *frozen)
        tile_mods = _tile_mods(call, list(ctx.captured), grad=True)
        dq, dk, dv, dslopes = loop.backward_all(
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            scale=call.scale,
            causal_offset=call.causal_offset,
            mask=call.mask,
            rules=rules,
            grad_lse=grad_lse,
            mods=tile_mods,
        )
        if dslopes is not None and call.rules.alibi_slopes is not None:
            dslopes = dslopes.sum_to_size(call.rules.alibi_slopes.shape).to(
                call.rules.alibi_slopes.dtype
            )
        captured_grads = [
            None if g is None else g.to(t.dtype)
            for g, t in zip(tile_mods.captured_grads, ctx.captured, strict=True)
        ]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dslopes, None, *captured_grads)
