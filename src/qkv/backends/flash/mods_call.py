"""flash's entry point for calls with a ``score_mod`` or ``mask_mod``: forward and backward
passes on the compiled kernel with the mods' programs where it takes the call
(``program_call.py``; with gradients: no sinks, no captured tensor that needs one), else
the loop with a ``TileMods`` (``mods.py``), through flash's one autograd function
(``autograd.py``) with the tensors the score_mod captures (``qkv.mods.captured_tensors``) among
its inputs, so that their gradients come back. Sinks and ALiBi slopes as in every flash call
(``passes``). Legend: B batch, Hq query heads.
"""

from __future__ import annotations

import functools
import math

import torch

from qkv import _tracing
from qkv import mods as own
from qkv.backends import reference
from qkv.backends.base import Call, Rules
from qkv.backends.flash import autograd, passes, program_call
from qkv.backends.flash.mods import TileMods


def attention(call: Call) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Run a checked call with a score_mod and/or mask_mod (and its other rules, as flash's
    tiles take them): (out in q's dtype, None, lse if asked)."""
    if _tracing.traced(call.q):  # a tracer sees the dense rule, whole (``qkv.mods``)
        out, _, lse = reference.attention(call)
        return out, None, lse
    rules = call.rules
    captured = own.captured_tensors(rules.score_mod) if rules.score_mod is not None else []
    learnable = [x for x in (rules.sinks, rules.alibi_slopes) if x is not None]
    needs = torch.is_grad_enabled() and any(
        x.requires_grad for x in (call.q, call.k, call.v, *learnable, *captured)
    )
    if needs:
        options = autograd.Pass(
            call.scale,
            call.causal_offset,
            call.mask,
            rules,
            functools.partial(_tile_mods, call),
            _Program(call, rules) if rules.sinks is None else None,
        )
        out, lse = autograd.attention(call.q, call.k, call.v, options, tuple(captured))
    else:
        with torch.no_grad():
            out, lse = _forward(call, rules, captured, False)
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
    call: Call, rules: Rules, captured: list[torch.Tensor], differentiable: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (*B, Hq, Lq, Dv) in the compute dtype and lse (*B, Hq, Lq), with the sinks: on the
    compiled kernel with the mods' program where it runs the call (``program_call``)."""
    compiled = program_call.forward(call, rules, differentiable)
    if compiled is not None:
        out, lse = compiled
        return passes.with_sinks(out, lse, rules.sinks) if rules.sinks is not None else (out, lse)
    return passes.forward(
        call.q,
        call.k,
        call.v,
        scale=call.scale,
        causal_offset=call.causal_offset,
        mask=call.mask,
        rules=rules,
        mods=_tile_mods(call, captured, False, differentiable),
    )


class _Program:
    """A call's passes on the kernel with the mods' programs (``program_call``), for flash's
    autograd function: each gives None where the kernel does not run the call."""

    def __init__(self, call: Call, rules: Rules) -> None:
        self.call, self.rules = call, rules

    def forward(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) in float32, as ``passes.forward`` gives them for a call without sinks."""
        return program_call.forward(self.call, self.rules, True)

    def backward(
        self,
        out: torch.Tensor,
        grad_out: torch.Tensor,
        lse: torch.Tensor,
        grad_lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(dq, dk, dv) of the forward pass ``forward`` ran."""
        return program_call.backward(self.call, self.rules, out, grad_out, lse, grad_lse)
