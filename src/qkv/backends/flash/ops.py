"""flash as PyTorch custom operators, for torch.compile, torch.export, FakeTensor and meta tensors.

A traced call sees one opaque operator where eager code runs Python (the kernel's build and
load, the choice between kernel and loop, the segment ids' runs): ``torch.ops.qkv.attention``
and its backward pass ``torch.ops.qkv.attention_backward`` (joined by ``register_autograd``), and
``torch.ops.qkv.decode_step``, which writes a KV cache's buffers in place (declared with
``mutates_args``). Their implementations are ``passes.forward``, ``passes.gradients`` and
``kernel.decode_step``, for every device (the kernel where it takes the call, the loop
elsewhere); their fake implementations give the outputs' shapes and dtypes from the inputs'.

The schema takes the score rules as they are on the ``Call`` (``base.Rules``), listed once in
``RULE_ARGUMENTS``: the causal and window offsets and the soft-cap as optional numbers, tensors
only for what is a tensor (the mask, segment ids, ALiBi slopes, sinks, a packed batch's key
ranges). Eager calls skip the operators' dispatch (``flash.attention``
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


# The score rules both attention operators take after their tensors, in order, with their
# schema types: the one list that the schema, a call's arguments and the ``Rules`` rebuilt from
# them are made from (``Rules`` fields by name; segments as two tensors; key_ranges last).
RULE_ARGUMENTS = (
    ("mask", "Tensor?"),
    ("scale", "float"),
    ("causal_offset", "SymInt?"),
    ("window_offset", "SymInt?"),
    ("q_segments", "Tensor?"),
    ("k_segments", "Tensor?"),
    ("softcap", "float?"),
    ("alibi_slopes", "Tensor?"),
    ("sinks", "Tensor?"),
    ("key_ranges", "Tensor?"),
)
_NAMES = tuple(name for name, _ in RULE_ARGUMENTS)
_REQUIRED = max(i for i, (_, kind) in enumerate(RULE_ARGUMENTS) if not kind.endswith("?"))
_SCHEMA_RULES = ", ".join(  # the optional ones after the last required one default to None
    f"{kind} {name}" + ("=None" if i > _REQUIRED else "")
    for i, (name, kind) in enumerate(RULE_ARGUMENTS)
)
_TENSOR_RULES = tuple(i for i, (_, kind) in enumerate(RULE_ARGUMENTS) if kind.startswith("Tensor"))
_SLOPES, _SINKS = _NAMES.index("alibi_slopes"), _NAMES.index("sinks")


def attention(call: Call) -> Pair:
    """(out in the compute dtype, lse) of a checked call, as one custom operator."""
    result: Pair = torch.ops.qkv.attention(call.q, call.k, call.v, *rule_arguments(call))
    return result


def rule_arguments(call: Call) -> tuple[Any, ...]:
    """``call``'s mask, scale, causal offset and ``Rules`` as ``RULE_ARGUMENTS``."""
    q_segments, k_segments = call.rules.segments or (None, None)
    given = {"mask": call.mask, "scale": call.scale, "causal_offset": call.causal_offset}
    given.update(q_segments=q_segments, k_segments=k_segments)
    return tuple(given[name] if name in given else getattr(call.rules, name) for name in _NAMES)


def _filled(values: tuple[Any, ...] | list[Any]) -> list[Any]:
    """``RULE_ARGUMENTS``' values as given, the defaults left out filled in (None)."""
    return [*values, *[None] * (len(_NAMES) - len(values))]


def _options(values: tuple[Any, ...]) -> tuple[Tensor | None, float, int | None, Rules]:
    """``RULE_ARGUMENTS``' values as (mask, scale, causal offset, ``Rules``)."""
    named = dict(zip(_NAMES, _filled(values), strict=True))
    mask, scale, causal_offset = named.pop("mask"), named.pop("scale"), named.pop("causal_offset")
    q_segments, k_segments = named.pop("q_segments"), named.pop("k_segments")
    segments = None if q_segments is None or k_segments is None else (q_segments, k_segments)
    return mask, scale, causal_offset, Rules(segments=segments, **named)


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


@torch.library.custom_op(
    "qkv::attention",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_SCHEMA_RULES}) -> (Tensor, Tensor)",
)
def _attention(q: Tensor, k: Tensor, v: Tensor, *rules: Any) -> tuple[Tensor, Tensor]:
    mask, scale, causal_offset, call_rules = _options(rules)
    out, lse = passes.forward(
        q, k, v, scale=scale, causal_offset=causal_offset, mask=mask, rules=call_rules
    )
    return out.contiguous(), lse.contiguous()


@_attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, *rules: Any) -> tuple[Tensor, Tensor]:
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None  # checked with the call
    rows = (*batch, q.shape[-3], q.shape[-2])
    dtype = compute_dtype(q.dtype)
    return q.new_empty((*rows, v.shape[-1]), dtype=dtype), q.new_empty(rows, dtype=dtype)


@torch.library.custom_op(
    "qkv::attention_backward",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, "
    f"Tensor? grad_lse, {_SCHEMA_RULES}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    *rules: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv in the compute dtype, d alibi_slopes, d sinks); a gradient with no input
    is an empty (0,) tensor."""
    mask, scale, causal_offset, call_rules = _options(rules)
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
        rules=call_rules,
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
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *args: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rules = _filled(args[2:])  # after grad_out and grad_lse
    alibi_slopes, sinks = rules[_SLOPES], rules[_SINKS]
    dtype = compute_dtype(q.dtype)
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
        q.new_empty(0) if alibi_slopes is None else torch.empty_like(alibi_slopes),
        q.new_empty(0) if sinks is None else torch.empty_like(sinks),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *given = inputs
    rules = _filled(given)
    ctx.save_for_backward(q, k, v, *output, *(rules[i] for i in _TENSOR_RULES))
    ctx.others = [None if i in _TENSOR_RULES else value for i, value in enumerate(rules)]


def _backward(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    rules = list(ctx.others)
    for i, tensor in zip(_TENSOR_RULES, tensors, strict=True):
        rules[i] = tensor
    dq, dk, dv, dslopes, dsinks = torch.ops.qkv.attention_backward(
        q, k, v, out, lse, torch.zeros_like(out) if grad_out is None else grad_out, grad_lse, *rules
    )
    # the mask's gradient is None: a float mask that needs one is refused by flash.why_not
    rule_grads: list[Tensor | None] = [None] * len(rules)
    needs = ctx.needs_input_grad[3:]
    for i, grad in ((_SLOPES, dslopes), (_SINKS, dsinks)):
        if rules[i] is not None and needs[i]:
            rule_grads[i] = grad.to(rules[i].dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *rule_grads[: len(needs)])


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
