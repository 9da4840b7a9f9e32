"""The flash backend: qkv's tiled online-softmax attention, memory linear in length.

Three parts, one concern each:

- ``loop.py``: the algorithm written to be read (the recurrence is explained there), forward
  and backward, in PyTorch; the specification the kernel is tested against, and what runs masks,
  float64 and other devices.
- ``kernel.py`` + ``flash_cpu.cpp``: the same forward recurrence and backward pass compiled for
  the CPU, for calls without a mask, and a decoding step that writes a KV cache and attends in
  one call.
- this module: the backend's entry points (``why_not``, ``attention``, ``attention_with_cache``)
  and ``forward``/``backward``, which run a block of keys on the kernel where it takes the call
  and on the loop otherwise (ring attention calls them block by block).
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.backends.base import CacheWrite, Call
from qkv.backends.flash import kernel, loop
from qkv.backends.flash.loop import KEY_TILE, QUERY_TILE

__all__ = [
    "KEY_TILE",
    "QUERY_TILE",
    "attention",
    "attention_with_cache",
    "backward",
    "forward",
    "runs_compiled",
    "why_not",
]


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loop.forward`` (same arguments and results: out in the compute dtype, lse), on the
    compiled kernel where it takes the call (no mask, CPU, float32/float16/bfloat16)."""
    compiled = kernel.forward(q, k, v, scale, causal_offset) if mask is None else None
    if compiled is not None:  # (the kernel's outputs are never part of a graph)
        return compiled
    return loop.forward(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask)


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
            return compiled
    return loop.backward(
        q, k, v, out, grad_out, lse, scale=scale, causal_offset=causal_offset, mask=mask
    )


def runs_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s forward pass on the compiled kernel."""
    return call.mask is None and kernel.takes(call.q, call.k, call.v)


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


def attention(call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a checked call: (out in q's dtype, None)."""
    if call.needs_gradients:  # (a float mask that needs them is refused by why_not)
        out: torch.Tensor = _FlashAttention.apply(  # type: ignore[no-untyped-call]
            call.q, call.k, call.v, call.mask, call.causal_offset, call.scale
        )
    else:
        out, _ = forward(
            call.q,
            call.k,
            call.v,
            scale=call.scale,
            causal_offset=call.causal_offset,
            mask=call.mask,
        )
    return (out if out.dtype == call.q.dtype else out.to(call.q.dtype)), None


def attention_with_cache(call: Call, write: CacheWrite) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write a step's keys and values into a KV cache and attend (``call``'s k and v are the
    cache's first ``write.start + L`` positions): one kernel call for a plain decoding step,
    otherwise the write and then ``attention``."""
    plain = (
        call.mask is None and not call.needs_gradients and call.q.shape[:-3] == (call.k.shape[:-3])
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
        return out, None
    write.apply()
    return attention(call)


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse only; the backward pass recomputes the tiles."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal_offset: int | None,
        scale: float,
    ) -> torch.Tensor:
        out, lse = forward(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.causal_offset, ctx.scale = mask, causal_offset, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            scale=ctx.scale,
            causal_offset=ctx.causal_offset,
            mask=ctx.mask,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
