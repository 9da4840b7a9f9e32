"""flash as PyTorch custom operators, for torch.compile, torch.export, FakeTensor and meta tensors.

A traced call sees one opaque operator where eager code runs Python (the kernel's build and
load, the choice between kernel and loop, the segment ids' runs): ``torch.ops.qkv.attention``
and its backward pass ``torch.ops.qkv.attention_backward`` (joined by ``register_autograd``), and
``torch.ops.qkv.decode_step``, which writes a KV cache's buffers in place (declared with
``mutates_args``). Their implementations are ``passes.forward``, ``passes.gradients`` and
``kernel.decode_step``, for every device (the kernel where it takes the call, the loop
elsewhere); their fake implementations give the outputs' shapes and dtypes from the inputs'.

The schema takes the score rules as they are on the ``Call`` (``base.Rules``): the causal and
window offsets and the soft-cap as optional numbers, tensors only for what is a tensor (the mask,
segment ids, ALiBi slopes, sinks). Eager calls skip the operators' dispatch (``flash.attention``
calls the same functions directly), so decoding pays nothing for them.
Legend: B batch, Hq/Hkv heads, Lq/Lk lengths, Dk/Dv features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from qkv import _checks
from qkv.backends.base import CacheWrite, Call, Rules, compute_dtype
from qkv.backends.flash import kernel, passes

if TYPE_CHECKING:
    from torch import Tensor
else:
    Tensor = torch.Tensor  # (torch.library reads the annotations at run time)

Pair = tuple[torch.Tensor, torch.Tensor]


def attention(call: Call) -> Pair:
    """(out in the compute dtype, lse) of a checked call, as one custom operator."""
    segments = call.rules.segments
    result: Pair = torch.ops.qkv.attention(
        call.q,
        call.k,
        call.v,
        call.mask,
        call.scale,
        call.causal_offset,
        call.rules.window_offset,
        None if segments is None else segments[0],
        None if segments is None else segments[1],
        call.rules.softcap,
        call.rules.alibi_slopes,
        call.rules.sinks,
    )
    return result


def decode_step(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float,
    causal_offset: int | None,
) -> torch.Tensor:
    """``kernel.decode_step`` as one custom operator that writes ``keys`` and ``values``."""
    out: torch.Tensor = torch.ops.qkv.decode_step(
        q, k_new, v_new, keys, values, start, scale, causal_offset
    )
    return out


def _rules(
    window_offset: int | None,
    q_segments: Tensor | None,
    k_segments: Tensor | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
) -> Rules:
    """The operators' rule arguments as the ``Rules`` the backend takes."""
    segments = None if q_segments is None or k_segments is None else (q_segments, k_segments)
    return Rules(softcap, alibi_slopes, window_offset, segments, sinks)


@torch.library.custom_op("qkv::attention", mutates_args=())
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    causal_offset: int | None,
    window_offset: int | None,
    q_segments: Tensor | None,
    k_segments: Tensor | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:
    rules = _rules(window_offset, q_segments, k_segments, softcap, alibi_slopes, sinks)
    out, lse = passes.forward(
        q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, rules=rules
    )
    return out.contiguous(), lse.contiguous()


@_attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None  # checked with the call
    rows = (*batch, q.shape[-3], q.shape[-2])
    dtype = compute_dtype(q.dtype)
    return q.new_empty((*rows, v.shape[-1]), dtype=dtype), q.new_empty(rows, dtype=dtype)


@torch.library.custom_op("qkv::attention_backward", mutates_args=())
def _attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    mask: Tensor | None,
    scale: float,
    causal_offset: int | None,
    window_offset: int | None,
    q_segments: Tensor | None,
    k_segments: Tensor | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv in the compute dtype, d alibi_slopes, d sinks); a gradient with no input
    is an empty (0,) tensor."""
    rules = _rules(window_offset, q_segments, k_segments, softcap, alibi_slopes, sinks)
    dq, dk, dv, dslopes, dsinks = passes.gradients(
        q,
        k,
        v,
        out,
        lse,
        grad_out,
        grad_lse,
        scale=scale,
        causal_offset=causal_offset,
        mask=mask,
        rules=rules,
        every_gradient=True,
    )
    return (
        dq.contiguous(),
        dk.contiguous(),
        dv.contiguous(),
        q.new_empty(0) if dslopes is None else dslopes.contiguous(),
        q.new_empty(0) if dsinks is None else dsinks.contiguous(),
    )


@_attention_backward.register_fake
def _attention_backward_fake(
    q: Tensor, k: Tensor, v: Tensor, *args: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    alibi_slopes, sinks = args[-2], args[-1]
    dtype = compute_dtype(q.dtype)
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
        q.new_empty(0) if alibi_slopes is None else torch.empty_like(alibi_slopes),
        q.new_empty(0) if sinks is None else torch.empty_like(sinks),
    )


_TENSOR_INPUTS = ("q", "k", "v", "mask", "q_segments", "k_segments", "alibi_slopes", "sinks")
_OTHER_INPUTS = ("scale", "causal_offset", "window_offset", "softcap")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    named = dict(zip(_ORDER, inputs, strict=True))
    ctx.save_for_backward(*(named[name] for name in _TENSOR_INPUTS), *output)
    ctx.others = tuple(named[name] for name in _OTHER_INPUTS)


def _backward(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, mask, q_segments, k_segments, alibi_slopes, sinks, out, lse = ctx.saved_tensors
    scale, causal_offset, window_offset, softcap = ctx.others
    dq, dk, dv, dslopes, dsinks = torch.ops.qkv.attention_backward(
        q,
        k,
        v,
        out,
        lse,
        torch.zeros_like(out) if grad_out is None else grad_out,
        grad_lse,
        mask,
        scale,
        causal_offset,
        window_offset,
        q_segments,
        k_segments,
        softcap,
        alibi_slopes,
        sinks,
    )
    needs = ctx.needs_input_grad
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        None,  # mask (a float mask that needs a gradient is refused by flash.why_not)
        None,
        None,
        None,
        None,
        None,
        None,
        dslopes.to(alibi_slopes.dtype) if alibi_slopes is not None and needs[10] else None,
        dsinks.to(sinks.dtype) if sinks is not None and needs[11] else None,
    )


_ORDER = (
    "q",
    "k",
    "v",
    "mask",
    "scale",
    "causal_offset",
    "window_offset",
    "q_segments",
    "k_segments",
    "softcap",
    "alibi_slopes",
    "sinks",
)
_attention.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("qkv::decode_step", mutates_args=("keys", "values"))
def _decode_step(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    scale: float,
    causal_offset: int | None,
) -> Tensor:
    if not kernel.decode_step_takes(q, k_new, v_new):  # (a device the kernel does not run)
        CacheWrite(k_new, v_new, keys, values, start).apply()
        seen = start + k_new.shape[-2]
        out, _ = passes.forward(
            q,
            keys.narrow(-2, 0, seen),
            values.narrow(-2, 0, seen),
            scale=scale,
            causal_offset=causal_offset,
        )
        return out.to(q.dtype)
    return kernel.decode_step(q, k_new, v_new, keys, values, start, scale, causal_offset)


@_decode_step.register_fake
def _decode_step_fake(q: Tensor, k_new: Tensor, v_new: Tensor, *args: Any) -> Tensor:
    return q.new_empty((*q.shape[:-1], v_new.shape[-1]))
