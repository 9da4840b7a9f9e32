"""attention-gym's rules as score_mod / mask_mod, and a float64 dense oracle written apart from
qkv: every mod is evaluated one score at a time under torch.vmap (as torch's FlexAttention
does), the softmax runs over the allowed keys only, a row with none gives 0.
Legend: B batch, H heads, L query length, S key length."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Rule = tuple[Callable[..., Any] | None, Callable[..., Any] | None]


def seeded_inputs(shapes: Any, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Tensors of the given shapes (q, k, v): float64 draws from a generator seeded 0, then cast
    to dtype (so every dtype sees the same values, rounded)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def sliding_window(width: int) -> Callable[..., Any]:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q - kv < width)

    return mask_mod


def prefix_lm(prefix: int) -> Callable[..., Any]:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv < prefix) | (q >= kv)

    return mask_mod


def documents(ids: torch.Tensor) -> Callable[..., Any]:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return ids[q] == ids[kv]

    return mask_mod


def alibi(slopes: torch.Tensor) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + slopes[h] * (kv - q)

    return score_mod


def softcap(cap: float) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return score_mod


def relative_bias(table: torch.Tensor, length: int) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + table[q - kv + length - 1]

    return score_mod


def t5_bucket(q: Any, kv: Any, buckets: int = 8, max_distance: int = 64) -> Any:
    """T5's bidirectional relative-position bucket of q − kv (log-spaced beyond buckets/4)."""
    half = buckets // 2
    relative = kv - q
    bucket = (relative > 0).to(torch.int64) * half
    distance = relative.abs()
    exact = half // 2
    far = exact + (
        torch.log(distance.to(torch.float64).clamp(min=1) / exact)
        / math.log(max_distance / exact)
        * (half - exact)
    ).to(torch.int64)
    far = far.clamp(max=half - 1)
    return bucket + torch.where(distance < exact, distance.to(torch.int64), far)


def t5_bias(bias: torch.Tensor) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + bias[h, t5_bucket(q, kv)]

    return score_mod


def chain(first: Callable[..., Any], second: Callable[..., Any]) -> Callable[..., Any]:
    """Two score_mods, one after the other."""

    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return second(first(score, b, h, q, kv), b, h, q, kv)

    return score_mod


def both(first: Callable[..., Any], second: Callable[..., Any]) -> Callable[..., Any]:
    """Two mask_mods together: a pair must pass both."""

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return first(b, h, q, kv) & second(b, h, q, kv)

    return mask_mod


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, L, Dv) and lse (B, Hq, L) in float64, differentiable. The mods run one score
    at a time (``per_score``, as torch's FlexAttention runs them); a pair is blocked by the
    mask_mod or by a score of −inf; a row with nothing left gives 0 (lse −inf)."""
    bsz, hq, lq, dk = q.shape
    lk, group = k.shape[-2], hq // k.shape[1]
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(dk) if scale is None else scale
    axes = [torch.arange(n, dtype=torch.int32) for n in (bsz, hq, lq, lk)]
    scores = q64 @ k64.transpose(-2, -1) * scale
    if score_mod is not None:
        scores = per_score(score_mod, scores, *axes).to(torch.float64)
    allowed = scores != -math.inf
    if mask_mod is not None:
        allowed = allowed & per_score(mask_mod, *axes)
    scores = scores.masked_fill(~allowed, -math.inf)
    has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~has_key, 0.0)  # (an empty row: 0 output, −inf lse, no NaN)
    weights = torch.softmax(scores, dim=-1) * has_key
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~has_key[..., 0], -math.inf)
    return weights @ v64, lse


def per_score(mod: Callable[..., Any], *args: torch.Tensor) -> torch.Tensor:
    """``mod`` on every (b, h, q_idx, kv_idx) of the 1-D ``args`` (a leading (B, H, L, S)
    score for a score_mod): four nested ``torch.vmap``, each mapping one index, so the mod sees
    one score and 0-dim indices. Returns (B, H, L, S)."""
    lead = len(args) - 4
    fn = mod
    for mapped in (3, 2, 1, 0):  # the innermost maps kv_idx
        fn = torch.vmap(
            fn, in_dims=(0,) * lead + tuple(0 if i == mapped else None for i in range(4))
        )
    return fn(*args)
