"""The sdpa backend: torch's fused ``scaled_dot_product_attention``, used only where its
semantics are exactly qkv's.

torch's ``is_causal`` is top-left aligned and cannot be combined with a mask, so every other
causal rule is passed to it as a bool mask built by ``qkv.masks``. It cannot return weights.
Legend: B batch, H heads, Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv import masks
from qkv.backends.base import Call

# enable_gqa arrived in torch 2.5
_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def why_not(call: Call) -> str | None:
    if call.return_weights:
        return 'torch\'s fused kernel does not return attention weights; use backend="reference"'
    if call.groups > 1 and not _HAS_GQA:
        return "this torch has no grouped-query support in scaled_dot_product_attention"
    if call.return_lse:
        return 'torch\'s fused kernel does not return the log-sum-exp; use backend="flash"'
    if call.softcap is not None or call.sinks is not None:
        return (
            "torch's fused kernel has no soft-capping or sinks (they change the softmax itself); "
            'use backend="flash" or "reference"'
        )
    if call.alibi_slopes is not None and (
        call.alibi_slopes.requires_grad or call.q.dtype not in (torch.float32, torch.float64)
    ):
        return (
            "torch's fused kernel takes ALiBi only as a mask in the inputs' dtype, which rounds "
            'it below float32 and does not differentiate it; use backend="flash"'
        )
    if call.q.shape[-2] == 0 or call.k.shape[-2] == 0:
        return "torch's fused kernel does not take empty sequences"
    masked = call.mask is not None or call.causal_offset is not None or call.structured
    if masked and not (bool(call.q.isfinite().all()) and bool(call.k.isfinite().all())):
        # torch adds -inf to blocked scores, and NaN + -inf is NaN: a NaN or Inf in q or k would
        # reach rows that may not attend it (qkv blocks a score by replacing it).
        return (
            "q or k holds NaN or Inf, which torch's kernel would spread past the mask; "
            'use backend="reference"'
        )
    return None


def attention(call: Call) -> tuple[torch.Tensor, None, None]:
    q, k, v = call.q, call.k, call.v
    lq, lk = q.shape[-2], k.shape[-2]
    plain = call.mask is None and not call.structured and call.alibi_slopes is None
    is_causal = call.causal_offset == 0 and plain
    mask = call.mask
    if (call.causal_offset is not None and not is_causal) or call.structured:
        rules = masks.tile_keep(
            None,
            call.causal_offset,
            0,
            lq,
            0,
            lk,
            q.device,
            window_offset=call.window_offset,
            segments=call.segments,
        )  # causal rule, window and segments as one bool (…, Lq, Lk) mask
        mask = masks.combine(mask, rules)
    if call.alibi_slopes is not None:
        bias = masks.alibi_bias(call.alibi_slopes, 0, lq, 0, lk, lk - lq, q.dtype)
        mask = masks.combine(mask, bias)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)  # torch requires a float mask in the inputs' dtype
    extra = {"enable_gqa": True} if call.groups > 1 else {}
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=call.dropout_p,
        is_causal=is_causal,
        scale=call.scale,
        **extra,
    )  # (*B, Hq, Lq, Dv)
    return out, None, None
