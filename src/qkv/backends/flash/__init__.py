"""The flash backend: qkv's tiled online-softmax attention, memory linear in length.

Three parts, one concern each:

- ``loop.py``: the algorithm written to be read (the recurrence is explained there), forward
  and backward, in PyTorch; the specification the kernel is tested against, and what runs masks,
  float64 and other devices.
- ``kernel.py`` + ``flash_cpu.cpp``: the same forward recurrence and backward pass compiled for
  the CPU, for calls without a mask, and a decoding step that writes a KV cache and attends in
  one call (``build.py`` builds it, ``build_command.py`` is ``qkv build``).
- ``ops.py``: the same entry points as PyTorch custom operators, which torch.compile,
  torch.export, FakeTensor and meta tensors see as one opaque operator per call.
- this module: the backend's entry points (``why_not``, ``attention``, ``attention_with_cache``)
  and ``forward``/``gradients``, which run a call on the kernel where it takes it and on the
  loop otherwise (ring attention calls ``forward``/``backward`` block by block).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from qkv import _checks, _tracing, logsumexp
from qkv.backends.base import NO_RULES, CacheWrite, Call, Rules
from qkv.backends.flash import kernel, loop, ops
from qkv.backends.flash.loop import KEY_TILE, QUERY_TILE
from qkv.backends.flash.rules import kernel_ranges, kernel_slopes

__all__ = [
    "KEY_TILE",
    "QUERY_TILE",
    "attention",
    "attention_with_cache",
    "backward",
    "differentiates_compiled",
    "forward",
    "gradients",
    "runs_compiled",
    "why_not",
    "with_sinks",
]


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
    rules: Rules = NO_RULES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loop.forward`` (same arguments and results: out in the compute dtype, lse), on the
    compiled kernel where it takes the call (no mask, segments in contiguous runs; CPU,
    float32/float16/bfloat16). ``rules.sinks`` (Hq,) join each row afterwards: a sink is a key
    with logit sinks[h] and value 0, so it rescales out by exp(lse − lse') and adds to the
    log-sum-exp."""
    compiled = None
    arguments = _kernel_rules(q, k, v, rules) if mask is None else None
    if arguments is not None:
        compiled = kernel.forward(q, k, v, scale, causal_offset, *arguments)
    if compiled is not None:
        out, lse = compiled
    else:
        out, lse = loop.forward(
            q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, rules=rules
        )
    if rules.sinks is not None:
        out, lse = with_sinks(out, lse, rules.sinks)
    return out, lse


_KernelRules = tuple[int | None, tuple[torch.Tensor, int], float | None, torch.Tensor | None]


def _kernel_rules(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rules: Rules
) -> _KernelRules | None:
    """A call's score rules as the compiled kernel takes them, forward and backward: (the window
    offset, the key range of each query row's segment, the soft-cap, ALiBi's slopes flattened
    over (*B, Hq)); None where the kernel cannot take them (segment ids whose keys are not
    contiguous runs)."""
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None  # checked with the call
    hq = q.shape[-3]
    ranges = kernel_ranges(rules.segments, batch, hq, q.shape[-2])
    if ranges is None:
        return None
    return rules.window_offset, ranges, rules.softcap, kernel_slopes(rules.alibi_slopes, batch, hq)


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
) -> Gradients:
    """The backward pass of ``forward`` given its out and lse: (dq, dk, dv in the compute dtype,
    the ALiBi slopes' gradient shaped as ``rules.alibi_slopes`` or None, the sinks' gradient or
    None), on the compiled kernel where it takes the call, on the loop otherwise. The slopes'
    and sinks' gradients are computed where they require one, or with ``every_gradient`` where
    they are given (a custom operator's tensors never require one). out and lse already hold
    the sinks' share, and a sink's value is 0, so the keys' gradients are those of plain
    attention given out and lse."""
    slopes, sinks = rules.alibi_slopes, rules.sinks
    if every_gradient and slopes is not None and not slopes.requires_grad:
        # (the loop adds up the slopes' gradient for slopes that require one)
        rules = dataclasses.replace(rules, alibi_slopes=slopes.detach().requires_grad_())
    compiled = None
    arguments = _kernel_rules(q, k, v, rules) if mask is None else None
    if arguments is not None:
        compiled = kernel.backward(
            q, k, v, out, grad_out, lse, scale, causal_offset, *arguments, grad_lse=grad_lse
        )
    if compiled is not None:
        dq, dk, dv, dslopes = compiled
        if dslopes is not None:
            dslopes = dslopes.view(*q.shape[:-2])  # (*B, Hq): kernel.backward takes one batch
    else:
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
        )
    if dslopes is not None and slopes is not None:
        dslopes = dslopes.sum_to_size(slopes.shape).to(slopes.dtype)
    dsinks = None
    if sinks is not None and (sinks.requires_grad or every_gradient):
        dsinks = sink_gradient(out, lse, grad_out, grad_lse, sinks)
    return dq, dk, dv, dslopes, dsinks


def runs_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s forward pass on the compiled kernel (segments only
    in contiguous runs: ``rules.kernel_ranges``, which reads their ids)."""
    if call.mask is not None or not kernel.takes(call.q, call.k, call.v):
        return False
    segments = call.rules.segments
    if segments is None:
        return True
    *batch, hq, lq, _ = call.scores_shape
    return kernel_ranges(segments, tuple(batch), hq, lq) is not None


def differentiates_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s backward pass on the compiled kernel: q, k and v of
    one batch shape and a call whose forward pass it runs (no mask, segments in contiguous
    runs, ...)."""
    return call.q.shape[:-3] == call.k.shape[:-3] == call.v.shape[:-3] and runs_compiled(call)


def why_not(call: Call) -> str | None:
    """Why this backend cannot run ``call`` (None if it can)."""
    if call.dropout_p > 0:
        return (
            "flash attention does not implement dropout; use dropout_p=0 (modules: eval mode) "
            'or backend="reference" / "sdpa"'
        )
    if call.return_weights:
        return (
            "flash attention never forms the full weight matrix, so it cannot return weights; "
            'use backend="reference"'
        )
    if call.mask is not None and call.mask.requires_grad:
        return 'flash attention does not differentiate a float mask; use backend="reference"'
    return None


def attention(call: Call) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Run a checked call: (out in q's dtype, None, lse if the call asks for it). Traced
    (torch.compile, torch.export, fake or meta tensors), it is one custom operator
    (``ops.attention``); eagerly the same functions run without the operator's dispatch."""
    if _tracing.traced(call.q):
        out, lse = ops.attention(call)
    elif call.needs_gradients:  # (a float mask that needs them is refused by why_not)
        out, lse = _FlashAttention.apply(  # type: ignore[no-untyped-call]
            call.q,
            call.k,
            call.v,
            call.rules.sinks,
            call.rules.alibi_slopes,
            _Options(call.mask, call.causal_offset, call.scale, call.rules),
        )
    else:
        out, lse = forward(
            call.q,
            call.k,
            call.v,
            scale=call.scale,
            causal_offset=call.causal_offset,
            mask=call.mask,
            rules=call.rules,
        )
    out = out if out.dtype == call.q.dtype else out.to(call.q.dtype)
    return out, None, (lse if call.return_lse else None)


def attention_with_cache(
    call: Call, write: CacheWrite
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Write a step's keys and values into a KV cache and attend (``call``'s k and v are the
    cache's first ``write.start + L`` positions): one kernel call for a plain decoding step,
    otherwise the write and then ``attention``."""
    plain = (
        call.mask is None
        and not call.needs_gradients
        and call.q.shape[:-3] == (call.k.shape[:-3])
        and call.rules.empty
        and not call.return_lse
    )
    if plain and kernel.decode_step_takes(call.q, write.k_new, write.v_new):
        step = ops.decode_step if _tracing.traced(call.q) else kernel.decode_step
        out = step(
            call.q,
            write.k_new,
            write.v_new,
            write.keys,
            write.values,
            write.start,
            call.scale,
            call.causal_offset,
        )
        return out, None, None
    write.apply()
    return attention(call)


@dataclass(frozen=True)
class _Options:
    """The non-tensor inputs of a differentiable flash call."""

    mask: torch.Tensor | None
    causal_offset: int | None
    scale: float
    rules: Rules


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse only; the backward pass recomputes the tiles. (The eager form
    of ``ops.attention``'s autograd: the same ``forward`` and ``gradients``.)"""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
        options: _Options,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = forward(
            q,
            k,
            v,
            scale=options.scale,
            causal_offset=options.causal_offset,
            mask=options.mask,
            rules=options.rules,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        options: _Options = ctx.options
        dq, dk, dv, dslopes, dsinks = gradients(
            q,
            k,
            v,
            out,
            lse,
            torch.zeros_like(out) if grad_out is None else grad_out,
            grad_lse,
            scale=options.scale,
            causal_offset=options.causal_offset,
            mask=options.mask,
            rules=options.rules,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, dslopes, None


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
