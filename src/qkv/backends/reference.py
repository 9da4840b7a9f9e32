"""The reference backend: attention exactly as the textbook writes it.

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k + M) V

It materialises the (Lq, Lk) score matrix of every head, so it is the backend to read, to check
the others against, and to get the attention weights from. Legend: B batch, H heads, Lq query
length, Lk key length, Dk query/key features, Dv value features.
"""

from __future__ import annotations

import os

import torch

from qkv import _tracing, masks, mods
from qkv.backends.base import Call

# Bytes per score element that the computation holds at its peak (scores, their exponentials,
# the weights, and the bool keep-mask), used to refuse calls that could not fit in memory.
_BYTES_PER_SCORE = {torch.float32: 13, torch.float64: 25}


def attention(call: Call) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    dtype = call.compute_dtype  # float16/bfloat16 are computed in float32
    q, k, v = call.q.to(dtype), call.k.to(dtype), call.v.to(dtype)
    if call.groups > 1:  # grouped-query: key/value head j serves query heads j*g ... j*g+g-1
        k = k.repeat_interleave(call.groups, dim=-3)  # (*B, Hq, Lk, Dk)
        v = v.repeat_interleave(call.groups, dim=-3)  # (*B, Hq, Lk, Dv)
    lk = k.shape[-2]
    scores = _scores(call, q, k)  # (*B, Hq, Lq, Lk)

    # Blocked keys get -inf, so exp(-inf) = 0 weight: not a small number like -1e9 or 1e-20,
    # which leaks weight to masked keys (and -1e9 overflows in float16). A key is blocked by the
    # mask, the causal rule, the window (i' - left <= j <= i' + right) or another segment.
    keep = call.may_attend()  # (*B, Hq, Lq, Lk) broadcastable, or None
    if call.rules.score_mod is not None:  # a score_mod blocks the pairs it sets to -inf itself
        kept = mods.kept(scores)
        keep = kept if keep is None else keep & kept
    if call.rules.mask_mod is not None:  # your own rule: True where the query may attend
        own = mods.dense_keep(call.rules.mask_mod, scores.shape, scores.device)
        keep = own if keep is None else keep & own
    has_key = None
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
        # A query with no key it may attend would be softmax([-inf, ...]) = 0/0 = NaN. Give its
        # row finite scores and zero its weights afterwards: 0 output and 0 gradient, no NaN.
        has_key = keep.any(dim=-1, keepdim=True)  # (*B, Hq, Lq, 1)
        if call.rules.sinks is None:  # (with sinks, such a row gives all its weight to its sink)
            scores = scores.masked_fill(~has_key, 0.0)
    if call.rules.sinks is not None:
        # Sinks (gpt-oss): a virtual key per head with logit sinks[h] and a zero value joins
        # every row's softmax, so a row may give less than all of its weight to real keys.
        sink = call.rules.sinks.to(dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)  # (*B, Hq, Lq, Lk + 1)

    weights = torch.softmax(scores, dim=-1)[..., :lk]  # (*B, Hq, Lq, Lk); minus the row max
    lse = torch.logsumexp(scores, dim=-1) if call.return_lse else None  # (*B, Hq, Lq)
    if has_key is not None and call.rules.sinks is None:
        weights = weights.masked_fill(~has_key, 0.0)
        lse = None if lse is None else lse.masked_fill(~has_key[..., 0], float("-inf"))

    dropped = weights
    if call.dropout_p > 0:
        dropped = torch.nn.functional.dropout(weights, p=call.dropout_p, training=True)
    out = dropped @ v  # (*B, Hq, Lq, Dv): each output is a weighted sum of the values
    returned = weights.to(call.q.dtype) if call.return_weights else None
    return out.to(call.q.dtype), returned, lse


def _scores(call: Call, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(*B, Hq, Lq, Lk): how well each query matches each key, scaled, soft-capped and biased."""
    lq, lk = q.shape[-2], k.shape[-2]
    # The scale 1/√d_k keeps the scores' variance near 1 whatever the head size, so the softmax
    # does not saturate into a one-hot.
    scores = (q @ k.transpose(-2, -1)) * call.scale  # (*B, Hq, Lq, Lk)
    if call.rules.score_mod is not None:  # your own rule replaces the scaled score, first
        scores = mods.dense_scores(call.rules.score_mod, scores, scores.shape[:-3])
    if call.rules.softcap is not None:  # Gemma 2: squash every score into (-softcap, softcap)
        scores = call.rules.softcap * torch.tanh(scores / call.rules.softcap)
    if call.rules.alibi_slopes is not None:  # ALiBi: -slope · |i + Lk - Lq - j|, a linear distance
        scores = scores + masks.alibi_bias(
            call.rules.alibi_slopes, 0, lq, 0, lk, lk - lq, scores.dtype
        )
    bias = masks.tile_bias(call.mask, 0, lq, 0, lk)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # float mask: added to the scaled scores
    return scores


def why_not(call: Call) -> str | None:
    """The reference backend runs every call that fits in memory (traced, where the memory
    free when the graph runs cannot be known, every call)."""
    if _tracing.traced(call.q):
        return None
    needed = workspace_bytes(call)
    available = available_bytes(call.q.device)
    if available is not None and needed > available:
        return (
            f"its {'×'.join(str(s) for s in call.scores_shape)} score matrices need about "
            f"{needed / 2**30:.1f} GiB but only {available / 2**30:.1f} GiB is available; "
            f'use backend="flash" (memory linear in length) or a shorter sequence'
        )
    return None


def workspace_bytes(call: Call) -> int:
    elements = 1
    for size in call.scores_shape:
        elements *= size
    return elements * _BYTES_PER_SCORE[call.compute_dtype]


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes (None when it cannot be told)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
