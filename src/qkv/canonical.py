"""The one canonicalisation of attention arguments: checks, then a ``Call`` every backend takes.

``qkv.attention``, ``qkv.attention_with_cache``, ring attention and the benchmarks build their
calls here, so every entry point checks the same things and means the same thing by them: the
mask convention (True = may attend), the causal rule as a diagonal offset, the default scale
1/√Dk, grouped-query heads, broadcasting of batch dims.

Legend: B batch, H heads (Hq query heads, Hkv key/value heads), L/Lq query length,
S/Lk key length, D features (Dk query/key, Dv value).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from qkv import _checks, masks, mods
from qkv.backends.base import NO_RULES, Call, Rules, default_scale
from qkv.backends.dispatch import NAMES

Causal = bool | Literal["bottom-right", "top-left"]
Window = int | tuple[int | None, int | None] | None
Segments = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


def canonical_call(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any,
    causal: Any,
    scale: Any,
    dropout_p: Any,
    return_weights: Any,
    backend: Any,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    window: Any = None,
    segments: Any = None,
    return_lse: Any = False,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> tuple[Call, bool]:
    """Check every argument and build the backend's ``Call``; True if a head dim was added."""
    _check_tensors(q, k, v)
    _checks.choice("causal", causal, masks.CAUSAL_VALUES)
    _checks.choice("backend", backend, NAMES)
    _checks.boolean("return_weights", return_weights)
    dropout_p = _checks.probability("dropout_p", dropout_p)
    if scale is None and q.shape[-1] == 0:
        raise ValueError(
            f"the default scale 1/sqrt(Dk) needs Dk >= 1 features, got q "
            f"{_checks.shape_str(q.shape)}; pass scale= explicitly"
        )
    scale = default_scale(q.shape[-1]) if scale is None else _checks.finite_float("scale", scale)

    # A missing head dim: (*batch, L, D) is attention with one head.
    squeeze_head = q.dim() == 2 and k.dim() == 2 and v.dim() == 2
    if squeeze_head:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    q, k, v, batch = _broadcast_heads(q, k, v)

    if mask is not None:
        scores_shape = (*batch, q.shape[-3], q.shape[-2], k.shape[-2])
        target = scores_shape[1:] if squeeze_head else scores_shape
        _checks.mask("mask", mask, target, "(*batch, Hq, Lq, Lk)")
    call = make_call(q, k, v, mask, causal, scale, dropout_p, return_weights)
    plain = softcap is None and sinks is None and alibi_slopes is None and window is None
    plain = plain and score_mod is None and mask_mod is None
    if plain and segments is None and return_lse is False:  # the common call: nothing more
        return call, squeeze_head
    rules, causal_offset = _rules(
        call, batch, causal, (softcap, sinks, alibi_slopes, window, segments, score_mod, mask_mod)
    )
    return_lse = _checks.boolean("return_lse", return_lse)
    call = dataclasses.replace(
        call, rules=rules, causal_offset=causal_offset, return_lse=return_lse
    )
    return call, squeeze_head


def _rules(
    call: Call, batch: tuple[int, ...], causal: Any, given: tuple[Any, ...]
) -> tuple[Rules, int | None]:
    """The call's checked score rules (``given``: softcap, sinks, ALiBi slopes, window,
    segments, score_mod, mask_mod) as one ``Rules``, and its causal offset with the window's
    right edge folded in."""
    softcap, sinks, alibi_slopes, window, segments, score_mod, mask_mod = given
    hq, lq, lk = call.q.shape[-3], call.q.shape[-2], call.k.shape[-2]
    causal_offset, window_offset = call.causal_offset, None
    if window is not None:
        upper, lower = masks.window_offsets(_checks.window("window", window, causal), lq, lk)
        if causal_offset is not None:  # a key must pass the causal rule and the window
            upper = causal_offset if upper is None else min(upper, causal_offset)
        causal_offset = None if upper is not None and upper >= lk - 1 else upper
        window_offset = None if lower is not None and lower <= 1 - lq else lower
    rules = Rules(
        softcap=None if softcap is None else _checks.positive_float("softcap", softcap),
        alibi_slopes=None
        if alibi_slopes is None
        else _checks.head_values(
            "alibi_slopes", alibi_slopes, call.q, (*batch, hq), "(Hq,) or (*batch, Hq)"
        ),
        window_offset=window_offset,
        segments=None
        if segments is None
        else _checks.segments("segments", segments, call.q, batch, lq, lk),
        sinks=None
        if sinks is None
        else _checks.head_values("sinks", sinks, call.q, (hq,), "(Hq,)"),
        # your own rule (qkv.mods)
        score_mod=mods.check_mod("score_mod", score_mod, 5),
        mask_mod=mods.check_mod("mask_mod", mask_mod, 4),
    )
    return rules, causal_offset


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    """q, k, v: floating tensors of >= 2 dims, one dtype and device, agreeing in Dk and Lk."""
    plain = (  # the common case, tested at once (a decoding step comes here once per layer)
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dtype in _checks.FLOAT_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
        and min(q.dim(), k.dim(), v.dim()) >= 2
    )
    if not plain:  # say what is wrong
        for name, x in (("q", q), ("k", k), ("v", v)):
            _checks.tensor(name, x, min_ndim=2)
            _checks.floating(name, x)
        _checks.same_dtype(("q", "k", "v"), (q, k, v))
        _checks.same_device(("q", "k", "v"), (q, k, v))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature size Dk (last dim), got q "
            f"{_checks.shape_str(q.shape)} and k {_checks.shape_str(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length Lk (dim -2), got k {_checks.shape_str(k.shape)}"
            f" and v {_checks.shape_str(v.shape)}"
        )


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: Causal,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> Call:
    """The canonical call of checked arguments: the causal rule as a diagonal offset (dropped
    where it blocks nothing), a mask of at least 2 dims on q's device."""
    lq, lk = q.shape[-2], k.shape[-2]
    if mask is not None:
        _checks.same_device(("q", "mask"), (q, mask))
        if mask.dim() < 2:  # backends slice the (Lq, Lk) dims: a 0-d or (Lk,) mask gets both
            mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    offset = masks.binding_offset(causal, lq, lk)
    return Call(q, k, v, mask, offset, scale, dropout_p, return_weights, NO_RULES)


def _broadcast_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Check batch and head dims; k and v get one shape (*batch, Hkv, Lk, ·) by broadcasting.
    Also returns the broadcast batch shape of the call (all but the last three dims)."""
    same_lead = k.shape[:-2] == v.shape[:-2] and q.shape[:-3] == k.shape[:-3]
    if q.dim() >= 3 and k.dim() >= 3 and same_lead:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv and hq % hkv == 0:  # the common case: nothing to broadcast
            return q, k, v, tuple(q.shape[:-3])
    kv_lead = _checks.broadcast_shape(k.shape[:-2], v.shape[:-2])
    if kv_lead is None:
        raise ValueError(
            f"k and v leading (batch, head) dims must broadcast, got k {_checks.shape_str(k.shape)}"
            f" and v {_checks.shape_str(v.shape)}"
        )
    if k.shape[:-2] != kv_lead:
        k = k.expand(*kv_lead, *k.shape[-2:])
    if v.shape[:-2] != kv_lead:
        v = v.expand(*kv_lead, *v.shape[-2:])
    if q.dim() < 3 or k.dim() < 3:
        # One side has no head dim: it broadcasts like any batch dim.
        q = q.unsqueeze(0) if q.dim() < 3 else q
        k = k.unsqueeze(0) if k.dim() < 3 else k
        v = v.unsqueeze(0) if v.dim() < 3 else v
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq == 1 and hkv > 1:
        q = q.expand(*q.shape[:-3], hkv, *q.shape[-2:])
        hq = hkv
    if (hq % hkv if hkv else hq) != 0:
        raise ValueError(
            f"q heads (dim -3) must equal or be a multiple of k/v heads, got q "
            f"{_checks.shape_str(q.shape)} with {hq} heads and k {_checks.shape_str(k.shape)} "
            f"with {hkv} heads"
        )
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3])
    if batch is None:
        raise ValueError(
            f"q and k batch dims (all but the last three) must broadcast, got q "
            f"{_checks.shape_str(q.shape)} and k {_checks.shape_str(k.shape)}"
        )
    return q, k, v, batch
