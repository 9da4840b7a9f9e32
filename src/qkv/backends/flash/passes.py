"""flash's passes over a call, forward and backward: on the compiled kernel where it takes the
call, on the PyTorch loop otherwise, with the sinks joined afterwards. The backend's entry
points (``__init__.py``), its custom operators (``ops.py``) and ring attention all run these.
Legend: B batch, Hq/Hkv heads, Lq/Lk lengths, Dk/Dv features.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from qkv import _checks, logsumexp
from qkv.backends.base import NO_RULES, Rules
from qkv.backends.flash import kernel, loop
from qkv.backends.flash.rules import kernel_ranges, kernel_slopes

if TYPE_CHECKING:
    from qkv.backends.flash.mods import TileMods


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
    rules: Rules = NO_RULES,
    mods: TileMods | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loop.forward`` (same arguments and results: out in the compute dtype, lse), on the
    compiled kernel where it takes the call (no mask, no ``mods``, segments in contiguous runs;
    CPU, float32/float16/bfloat16; ``rules.key_ranges`` only there). ``rules.sinks`` (Hq,) join
    each row afterwards: a sink is a key with logit sinks[h] and value 0, so it rescales out by
    exp(lse − lse') and adds to the log-sum-exp."""
    compiled = None
    arguments = _kernel_rules(q, k, v, rules) if mask is None and mods is None else None
    if arguments is not None:
        compiled = kernel.forward(q, k, v, scale, causal_offset, *arguments)
    if compiled is not None:
        out, lse = compiled
    else:
        _loop_takes(rules)
        out, lse = loop.forward(
            q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, rules=rules, mods=mods
        )
    if rules.sinks is not None:
        out, lse = with_sinks(out, lse, rules.sinks)
    return out, lse


_KernelRules = tuple[int | None, tuple[torch.Tensor, int] | None, float | None, torch.Tensor | None]


def _kernel_rules(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rules: Rules
) -> _KernelRules | None:
    """A call's score rules as the compiled kernel takes them, forward and backward: (the window
    offset, the key range of each query row's segment, the soft-cap, ALiBi's slopes flattened
    over (*B, Hq)); None where the kernel cannot take them (segment ids whose keys are not
    contiguous runs). Without segments, key ranges or slopes there is no per-row table to build
    (a decoding step comes here once per layer): the ranges are then None."""
    if rules.segments is None and rules.key_ranges is None and rules.alibi_slopes is None:
        return rules.window_offset, None, rules.softcap, None
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None  # checked with the call
    hq = q.shape[-3]
    if rules.key_ranges is not None:
        ranges: tuple[torch.Tensor, int] | None = (rules.key_ranges, hq)
    else:
        ranges = kernel_ranges(rules.segments, batch, hq, q.shape[-2])
    if ranges is None:
        return None
    return rules.window_offset, ranges, rules.softcap, kernel_slopes(rules.alibi_slopes, batch, hq)


def _loop_takes(rules: Rules) -> None:
    """Refuse what only the kernel reads (the caller asks ``kernel.takes`` first)."""
    if rules.key_ranges is not None:
        raise ValueError(
            "flash: key_ranges are read by the compiled kernel only, which does not take this "
            "call (it takes float32/float16/bfloat16 on the CPU, one batch shape)"
        )


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (*B, Hq, Lq, Dv) and lse (*B, Hq, Lq) of attention with one more key per head, of
    logit sinks[h] (Hq,) and value 0: ``qkv.merge`` with a key set whose output is 0."""
    sink = sinks.detach().to(lse.dtype)[:, None].expand_as(lse)  # (*B, Hq, Lq)
    lse_all, share, _ = logsumexp.shares(lse, sink)
    return out * share[..., None].to(out.dtype), lse_all


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loop.backward`` (same arguments and results: dq, dk, dv in the compute dtype), on the
    compiled kernel where it takes the call (no mask, CPU, float32/float16/bfloat16, one batch
    shape)."""
    if mask is None:
        compiled = kernel.backward(q, k, v, out, grad_out, lse, scale, causal_offset)
        if compiled is not None:
            return compiled[:3]
    return loop.backward(
        q, k, v, out, grad_out, lse, scale=scale, causal_offset=causal_offset, mask=mask
    )


Gradients = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None
]


def gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    *,
    scale: float,
    causal_offset: int | None,
    mask: torch.Tensor | None,
    rules: Rules,
    every_gradient: bool = False,
    mods: TileMods | None = None,
) -> Gradients:
    """The backward pass of ``forward`` given its out and lse: (dq, dk, dv in the compute dtype,
    the ALiBi slopes' gradient shaped as ``rules.alibi_slopes`` or None, the sinks' gradient or
    None), on the compiled kernel where it takes the call, on the loop otherwise. The slopes'
    and sinks' gradients are computed where they require one, or with ``every_gradient`` where
    they are given (a custom operator's tensors never require one). out and lse already hold
    the sinks' share, and a sink's value is 0, so the keys' gradients are those of plain
    attention given out and lse. ``mods``: a score_mod / mask_mod's tiles, on the loop, which
    adds up its captured tensors' gradients in ``mods.captured_grads``."""
    slopes, sinks = rules.alibi_slopes, rules.sinks
    if every_gradient and slopes is not None and not slopes.requires_grad:
        # (the loop adds up the slopes' gradient for slopes that require one)
        rules = dataclasses.replace(rules, alibi_slopes=slopes.detach().requires_grad_())
    compiled = None
    arguments = _kernel_rules(q, k, v, rules) if mask is None and mods is None else None
    if arguments is not None:
        compiled = kernel.backward(
            q, k, v, out, grad_out, lse, scale, causal_offset, *arguments, grad_lse=grad_lse
        )
    if compiled is not None:
        dq, dk, dv, dslopes = compiled
        if dslopes is not None:
            dslopes = dslopes.view(*q.shape[:-2])  # (*B, Hq): kernel.backward takes one batch
    else:
        _loop_takes(rules)
        dq, dk, dv, dslopes = loop.backward_all(
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            scale=scale,
            causal_offset=causal_offset,
            mask=mask,
            rules=rules,
            grad_lse=grad_lse,
            mods=mods,
        )
    if dslopes is not None and slopes is not None:
        dslopes = dslopes.sum_to_size(slopes.shape).to(slopes.dtype)
    dsinks = None
    if sinks is not None and (sinks.requires_grad or every_gradient):
        dsinks = sink_gradient(out, lse, grad_out, grad_lse, sinks)
    return dq, dk, dv, dslopes, dsinks


def sink_gradient(
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """(Hq,): the sinks' gradient. A sink's weight in row i is p_i = exp(sink − lse_i); it takes
    that share from every key, so d out_i / d sink = −p_i out_i, and d lse_i / d sink = p_i:
    dL/d sink = Σ_i p_i (grad_lse_i − D_i) with D_i = grad_out_i · out_i, over batch and rows."""
    dtype = lse.dtype
    delta = (grad_out.to(dtype) * out.to(dtype)).sum(dim=-1)  # (*B, Hq, Lq)
    if grad_lse is not None:
        delta = delta - grad_lse.to(dtype)
    share = torch.exp(sinks.detach().to(dtype)[:, None] - lse)  # (*B, Hq, Lq)
    per_head = (-share * delta).sum(dim=-1)  # (*B, Hq)
    return per_head.sum_to_size(sinks.shape).to(sinks.dtype)
