"""The flash backend: qkv's tiled online-softmax attention, memory linear in length.

Its parts, one concern each:

- ``loop.py``: the algorithm written to be read (the recurrence is explained there), forward
  and backward, in PyTorch; the specification the kernel is tested against, and what runs masks,
  float64 and other devices.
- ``kernel.py`` + ``flash_cpu.cpp``: the same forward recurrence and backward pass compiled for
  the CPU, for calls without a mask, and a decoding step that writes a KV cache and attends in
  one call (``build.py`` builds it, ``build_command.py`` is ``qkv build``).
- ``passes.py``: ``forward``, ``gradients`` and ``backward``, which run a call's passes on the
  kernel where it takes them and on the loop otherwise (ring attention calls ``forward`` and
  ``backward`` block by block).
- ``autograd.py``: those passes as flash's one autograd function, for dense, packed
  (``varlen.py``) and score_mod / mask_mod (``mods_call.py``) calls alike.
- ``ops.py``: those passes as PyTorch custom operators, which torch.compile, torch.export,
  FakeTensor and meta tensors see as one opaque operator per call.
- this module: the backend's entry points (``why_not``, ``attention``, ``attention_with_cache``).
"""

from __future__ import annotations

import torch

from qkv import _tracing
from qkv.backends.base import CacheWrite, Call
from qkv.backends.flash import autograd, kernel, ops
from qkv.backends.flash.loop import KEY_TILE, QUERY_TILE
from qkv.backends.flash.passes import backward, forward, gradients, sink_gradient, with_sinks
from qkv.backends.flash.rules import kernel_ranges

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
    "sink_gradient",
    "why_not",
    "with_sinks",
]


def runs_compiled(call: Call) -> bool:
    """Whether this backend runs ``call``'s forward pass on the compiled kernel (no mask, no
    score_mod or mask_mod, segments only in contiguous runs: ``rules.kernel_ranges``, which reads
    their ids)."""
    if call.mask is not None or call.mods or not kernel.takes(call.q, call.k, call.v):
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
    (``ops.attention``); eagerly the same functions run without the operator's dispatch. A
    score_mod or mask_mod runs as a program in the kernel, or per tile on the loop
    (``mods_call.py``)."""
    if call.mods:
        from qkv.backends.flash import mods_call

        return mods_call.attention(call)
    if _tracing.traced(call.q):
        out, lse = ops.attention(call)
    elif call.needs_gradients:  # (a float mask that needs them is refused by why_not)
        options = autograd.Pass(call.scale, call.causal_offset, call.mask, call.rules)
        out, lse = autograd.attention(call.q, call.k, call.v, options)
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
