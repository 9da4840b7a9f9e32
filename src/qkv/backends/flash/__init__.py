"""The flash backend: qkv's tiled online-softmax attention, memory linear in length.

Three parts, one concern each:

- ``loop.py``: the algorithm written to be read (the recurrence is explained there), forward
  and backward, in PyTorch; the specification the kernel is tested against, and what runs masks,
  float64 and other devices.
- ``kernel.py`` + ``flash_cpu.cpp``: the same forward recurrence and backward pass compiled for
  the CPU, for calls without a mask, and a decoding step that writes a KV cache and attends in
  one call (``build.py`` builds it, ``build_command.py`` is ``qkv build``).
- this module: the backend's entry points (``why_not``, ``attention``, ``attention_with_cache``)
  and ``forward``/``backward``, which run a block of keys on the kernel where it takes the call
  and on the loop otherwise (ring attention calls them block by block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkv import _checks, logsumexp
from qkv.backends.base import CacheWrite, Call
from qkv.backends.flash import kernel, loop
from qkv.backends.flash.loop import KEY_TILE, QUERY_TILE
from qkv.backends.flash.rules import Rules, kernel_ranges, kernel_slopes

__all__ = [
    "KEY_TILE",
    "QUERY_TILE",
    "attention",
    "attention_with_cache",
    "backward",
    "differentiates_compiled",
    "forward",
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
    rules: Rules | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loop.forward`` (same arguments and results: out in the compute dtype, lse), on the
    compiled kernel where it takes the call (no mask, segments in contiguous runs; CPU,
    float32/float16/bfloat16). ``sinks`` (Hq,) join each row afterwards:
    a sink is a key with logit sinks[h] and value 0, so it rescales out by exp(lse − lse') and
    adds to the log-sum-exp."""
    compiled = None
    arguments = _kernel_rules(q, k, v, causal_offset, rules) if mask is None else None
    if arguments is not None:
        compiled = kernel.forward(q, k, v, scale, causal_offset, *arguments)
    if compiled is not None:  # (the kernel's outputs are never part of a graph)
        out, lse = compiled
    else:
        out, lse = loop.forward(
            q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, rules=rules
        )
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return out, lse


def _kernel_rules(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal_offset: int | None,
    rules: Rules | None,
) -> tuple[tuple[torch.Tensor, int], float | None, torch.Tensor | None] | None:
    """A call's score rules as the compiled kernel takes them, forward and backward: (the key
    range of each query row, the soft-cap, ALiBi's slopes flattened over (*B, Hq)); None where
    the kernel cannot take them (segment ids whose keys are not contiguous runs)."""
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None  # checked with the call
    hq, lq, lk = q.shape[-3], q.shape[-2], k.shape[-2]
    ranges = kernel_ranges(rules, causal_offset, batch, hq, lq, lk)
    if ranges is None:
        return None
    softcap = None if rules is None else rules.softcap
    return ranges, softcap, kernel_slopes(rules, batch, hq)


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


def runs_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s forward pass on the compiled kernel (a window or
    segments only when it takes them: ``rules.kernel_ranges``)."""
    if call.mask is not None or not kernel.takes(call.q, call.k, call.v):
        return False
    if not call.structured:
        return True
    *batch, hq, lq, lk = call.scores_shape
    return kernel_ranges(rules_of(call), call.causal_offset, tuple(batch), hq, lq, lk) is not None


def differentiates_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s backward pass on the compiled kernel: no mask, no
    gradient through a returned log-sum-exp, q, k and v of one batch shape, segments (if any)
    in contiguous runs (``rules.kernel_ranges``), and a call the kernel takes."""
    return (
        not call.return_lse
        and call.q.shape[:-3] == call.k.shape[:-3] == call.v.shape[:-3]
        and runs_compiled(call)  # (no mask, among what it asks)
    )


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


def rules_of(call: Call) -> Rules | None:
    """The call's soft-capping, ALiBi, window and segments as flash's tiles take them."""
    if not (call.structured or call.modified_scores):
        return None
    return Rules(call.softcap, call.alibi_slopes, call.window_offset, call.segments)


def attention(call: Call) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Run a checked call: (out in q's dtype, None, lse if the call asks for it)."""
    if call.mods:  # your own rule: per tile, on the loop (mods.py, mods_call.py)
        from qkv.backends.flash import mods_call

        return mods_call.attention(call, rules_of(call))
    rules = rules_of(call)
    if call.needs_gradients:  # (a float mask that needs them is refused by why_not)
        out, lse = _FlashAttention.apply(  # type: ignore[no-untyped-call]
            call.q,
            call.k,
            call.v,
            call.sinks,
            call.alibi_slopes,
            _Options(call.mask, call.causal_offset, call.scale, rules),
        )
    else:
        out, lse = forward(
            call.q,
            call.k,
            call.v,
            scale=call.scale,
            causal_offset=call.causal_offset,
            mask=call.mask,
            rules=rules,
            sinks=call.sinks,
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
        and rules_of(call) is None
        and call.sinks is None
        and not call.return_lse
    )
    if plain and kernel.decode_step_takes(call.q, write.k_new, write.v_new):
        out = kernel.decode_step(
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
    rules: Rules | None


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse only; the backward pass recomputes the tiles."""

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
            sinks=sinks,
        )
        learnable = [x for x in (sinks, alibi_slopes) if x is not None]
        ctx.save_for_backward(q, k, v, out, lse, *learnable)
        ctx.options, ctx.has_sinks = options, sinks is not None
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *learnable = ctx.saved_tensors
        sinks = learnable.pop(0) if ctx.has_sinks else None
        alibi_slopes = learnable.pop(0) if learnable else None
        options: _Options = ctx.options
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        compiled = None
        if options.mask is None and grad_lse is None:
            compiled = compiled_backward(q, k, v, out, grad_out, lse, options)
        if compiled is not None:
            dq, dk, dv, dslopes = compiled
        else:
            dq, dk, dv, dslopes = loop.backward_all(
                q,
                k,
                v,
                out,
                grad_out,
                lse,
                scale=options.scale,
                causal_offset=options.causal_offset,
                mask=options.mask,
                rules=options.rules,
                grad_lse=grad_lse,
            )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_gradient(out, lse, grad_out, grad_lse, sinks)
        if dslopes is not None and alibi_slopes is not None:
            dslopes = dslopes.sum_to_size(alibi_slopes.shape).to(alibi_slopes.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, dslopes, None


def compiled_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    options: _Options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The kernel's backward pass of an unmasked call with its score rules (None where the
    kernel does not take it). out and lse already hold the sinks' share, and a sink's value is
    0, so the keys' gradients are those of plain attention given out and lse."""
    arguments = _kernel_rules(q, k, v, options.causal_offset, options.rules)
    if arguments is None:
        return None
    compiled = kernel.backward(
        q, k, v, out, grad_out, lse, options.scale, options.causal_offset, *arguments
    )
    if compiled is None:
        return None
    dq, dk, dv, dslopes = compiled
    if dslopes is not None:
        dslopes = dslopes.view(*q.shape[:-2])  # (*B, Hq): kernel.backward takes one batch shape
    return dq, dk, dv, dslopes


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
