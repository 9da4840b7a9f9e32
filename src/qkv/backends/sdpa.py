"""The sdpa backend: torch's fused ``scaled_dot_product_attention``, used only where its
semantics are exactly qkv's.

torch's ``is_causal`` is top-left aligned and cannot be combined with a mask, so every other
causal rule is passed to it as a bool mask built by ``qkv.masks``. It cannot return weights.

torch blocks a score by adding -inf to it, qkv by replacing it: a NaN or Inf in q or k would
reach rows that may not attend it through torch's kernel. On the CPU such a call is refused (the
check is a cheap scan there); on other devices, where asking the question would stall the
device once per call, the kernel runs on cleaned inputs and the rows that touch a non-finite
value are set to NaN afterwards (``_spread_non_finite``), with no host synchronisation.
Legend: B batch, H heads, Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv import _tracing, masks
from qkv.backends.base import Call

# Handle NaN/Inf under a mask without a host synchronisation (always so off the CPU, and
# traced, where a graph cannot hold a decision on the inputs' values).
SYNC_FREE = False


def _sync_free(q: torch.Tensor) -> bool:
    return SYNC_FREE or _tracing.traced(q)


# enable_gqa arrived in torch 2.5
_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def why_not(call: Call) -> str | None:
    if call.return_weights:
        return 'torch\'s fused kernel does not return attention weights; use backend="reference"'
    if call.groups > 1 and not _HAS_GQA:
        return "this torch has no grouped-query support in scaled_dot_product_attention"
    if call.return_lse:
        return 'torch\'s fused kernel does not return the log-sum-exp; use backend="flash"'
    if call.mods:
        return (
            "torch's fused kernel takes no score_mod or mask_mod (your own rule runs per tile); "
            'use backend="flash" or "reference"'
        )
    if call.rules.softcap is not None or call.rules.sinks is not None:
        return (
            "torch's fused kernel has no soft-capping or sinks (they change the softmax itself); "
            'use backend="flash" or "reference"'
        )
    if call.rules.alibi_slopes is not None and (
        call.rules.alibi_slopes.requires_grad or call.q.dtype not in (torch.float32, torch.float64)
    ):
        return (
            "torch's fused kernel takes ALiBi only as a mask in the inputs' dtype, which rounds "
            'it below float32 and does not differentiate it; use backend="flash"'
        )
    if call.q.shape[-2] == 0 or call.k.shape[-2] == 0:
        return "torch's fused kernel does not take empty sequences"
    masked = call.mask is not None or call.causal_offset is not None or call.structured
    on_cpu = call.q.device.type == "cpu" and not _sync_free(call.q)
    if masked and on_cpu and not (bool(call.q.isfinite().all()) and bool(call.k.isfinite().all())):
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
    plain = call.mask is None and not call.structured and call.rules.alibi_slopes is None
    is_causal = call.causal_offset == 0 and plain
    mask = call.mask
    if (call.causal_offset is not None and not is_causal) or call.structured:
        rules = call.may_attend(with_mask=False)  # causal rule, window, segments: (…, Lq, Lk)
        mask = masks.combine(mask, rules)
    if call.rules.alibi_slopes is not None:
        bias = masks.alibi_bias(call.rules.alibi_slopes, 0, lq, 0, lk, lk - lq, q.dtype)
        mask = masks.combine(mask, bias)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)  # torch requires a float mask in the inputs' dtype
    extra = {"enable_gqa": True} if call.groups > 1 else {}
    guarded = (mask is not None or is_causal) and (q.device.type != "cpu" or _sync_free(q))
    out = F.scaled_dot_product_attention(
        _finite(q) if guarded else q,
        _finite(k) if guarded else k,
        v,
        attn_mask=mask,
        dropout_p=call.dropout_p,
        is_causal=is_causal,
        scale=call.scale,
        **extra,
    )  # (*B, Hq, Lq, Dv)
    if guarded:
        out = _spread_non_finite(out, call, mask)
    return out, None, None


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.isfinite(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _spread_non_finite(out: torch.Tensor, call: Call, mask: torch.Tensor | None) -> torch.Tensor:
    """NaN in the rows of ``out`` that qkv's semantics give NaN: rows that may attend a key
    holding NaN/Inf, and rows whose own query holds one and that may attend some key."""
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    bad_key = ~call.k.isfinite().all(-1)  # (*B, Hkv, Lk)
    if call.groups > 1:
        bad_key = bad_key.repeat_interleave(call.groups, dim=-2)  # (*B, Hq, Lk)
    bad_query = ~call.q.isfinite().all(-1)  # (*B, Hq, Lq)
    if mask is None:  # top-left causal: query i may attend keys 0..i
        seen = bad_key.cummax(-1).values  # (*B, Hq, Lk): a bad key among 0..j
        rows = torch.arange(lq, device=out.device).clamp(max=max(lk - 1, 0))
        nan_rows = seen[..., rows] | bad_query  # (*B, Hq, Lq)
    else:
        keep = mask if mask.dtype == torch.bool else mask != float("-inf")  # (.., Lq, Lk)
        touches_bad_key = (keep & bad_key.unsqueeze(-2)).any(-1)
        nan_rows = touches_bad_key | (bad_query & keep.any(-1))  # (*B, Hq, Lq)
    return out.masked_fill(nan_rows.unsqueeze(-1), float("nan"))
