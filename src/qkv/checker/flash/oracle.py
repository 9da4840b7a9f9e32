"""The float64 truth for a flash implementation, and the usual flash mistakes, recomputed.

The truth is ``qkv.attention(..., backend="reference", return_lse=True)`` in float64 on the
implementation's own inputs, and its float64 autograd for dq, dk, dv. When a result differs,
each candidate below recomputes what an implementation *with that mistake* returns; the one that
reproduces it is named. The flash recurrence they change (``qkv/backends/flash/loop.py`` explains
it): per key tile, m_new = max(m, max s), alpha = exp(m − m_new), l = alpha·l + Σ exp(s − m_new),
acc = alpha·acc + exp(s − m_new)·V; out = acc / l, lse = m + log l.
Legend: L/Lq query length, Lk key length, D features, T a key tile's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkv.canonical import Causal
from qkv.checker.compare import difference
from qkv.functional import attention

LN2 = math.log(2.0)
TILES = (16, 32, 64, 128)  # the key tiles learners and kernels use
RESCALES = {  # (rescale l, rescale acc) -> what is missing
    (False, True): (
        "the running sum l is not rescaled when the maximum grows: at each key tile l must "
        "become exp(m_old − m_new)·l + Σ p, just as the accumulator is rescaled"
    ),
    (True, False): (
        "the accumulator is not rescaled when the maximum grows: at each key tile it must "
        "become exp(m_old − m_new)·acc + p·V, just as the running sum l is rescaled"
    ),
    (False, False): (
        "neither the running sum l nor the accumulator is rescaled when the maximum grows: "
        "at each key tile both must be multiplied by exp(m_old − m_new) before the tile is added"
    ),
}


@dataclass
class Expected:
    """What a right implementation returns, in float64."""

    out: torch.Tensor
    lse: torch.Tensor
    grads: tuple[torch.Tensor, ...] | None


def expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: Causal,
    dout: torch.Tensor | None = None,
) -> Expected:
    """out, lse and (given dout) dq, dk, dv of the contract's attention, in float64."""
    q, k, v = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    with torch.set_grad_enabled(dout is not None):
        out, lse = attention(q, k, v, causal=causal, return_lse=True, backend="reference")
        grads = None
        if dout is not None:
            grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return Expected(out.detach(), lse.detach(), grads)


def _online(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int, rescale: tuple[bool, bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash forward (no mask) over key tiles of ``tile``, in float64, with the running sum
    and the accumulator rescaled as ``rescale`` says."""
    scale = q.shape[-1] ** -0.5
    m = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)
    total = torch.zeros(q.shape[:-1], dtype=torch.float64)
    acc = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float64)
    for start in range(0, k.shape[-2], tile):
        scores = q @ k[..., start : start + tile, :].transpose(-2, -1) * scale  # (..., L, T)
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        total = (alpha * total if rescale[0] else total) + p.sum(-1)
        acc = (alpha[..., None] * acc if rescale[1] else acc) + p @ v[..., start : start + tile, :]
        m = m_new
    return acc / total[..., None], m + total.log()


def _candidates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what is wrong, its out, its lse) for each flash mistake these lengths can show."""
    found = []
    length = k.shape[-2]
    for rescale, text in RESCALES.items():
        for tile in (t for t in TILES if t < length):
            out, lse = _online(q, k, v, tile, rescale)
            found.append((f"{text} (this reproduces it with key tiles of {tile})", out, lse))
    kept_by_tile: dict[int, list[int]] = {}
    for tile in TILES:
        kept_by_tile.setdefault(length // tile * tile, []).append(tile)
    for kept, tiles in kept_by_tile.items():
        if kept < length:
            out, lse = attention(q, k[..., :kept, :], v[..., :kept, :], return_lse=True)
            found.append((_dropped(kept, length, tiles), out, lse))
    out, lse = attention(q, k, v, scale=q.shape[-1] ** -0.5 * LN2, return_lse=True)
    found.append((_EXP2, out, lse))
    return found


def _dropped(kept: int, length: int, tiles: list[int]) -> str:
    named = (
        ", ".join(str(t) for t in tiles[:-1]) + f" or {tiles[-1]}" if tiles[1:] else str(tiles[0])
    )
    return (
        f"keys {kept}–{length - 1} are never read: Lk = {length} is not a multiple of a key "
        f"tile of {named}, and the last, partial tile is skipped; loop over ceil(Lk / tile) "
        "tiles and mask the keys past Lk in the last one"
    )


_EXP2 = (
    "the scores are exponentiated with 2^x as they are: 2^s = e^(s·ln 2), so the softmax sees "
    "them multiplied by ln 2 = 0.693; fold log₂e = 1.4427 into the scale when using exp2"
)


def explain_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, limit: float
) -> str:
    """The flash mistake that reproduces ``out`` (no causal rule) to ``limit``, or ''."""
    q, k, v = (t.double() for t in (q, k, v))
    right = attention(q, k, v)
    for text, predicted, _ in _candidates(q, k, v):
        # a mistake that changes nothing at these lengths cannot explain a difference
        if difference(predicted, out) <= limit < difference(predicted, right):
            return text
    return ""


def explain_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, limit: float
) -> str:
    """What ``lse`` (no causal rule) is instead of the natural log-sum-exp, to ``limit``, or ''."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1)
    right = (scores * q.shape[-1] ** -0.5).logsumexp(-1)
    row_max = (scores * q.shape[-1] ** -0.5).amax(-1)
    named = [
        (
            right / LN2,
            "your lse is in base 2 (m₂ + log₂ l₂ of scores in units of log₂e): multiply it by "
            "ln 2 = 0.6931 for the natural log-sum-exp that a backward's exp(s − lse) needs",
        ),
        (row_max, "your lse is only the row maximum m; the log-sum-exp is m + log(l)"),
        (right - row_max, "your lse is log(l) without the maximum; the log-sum-exp is m + log(l)"),
        (
            scores.logsumexp(-1),
            "your lse is the log-sum-exp of the unscaled scores QKᵀ; it is of the scaled scores "
            "QKᵀ/√Dk",
        ),
    ]
    named += [(lse_, text) for text, _, lse_ in _candidates(q, k, v)]
    for predicted, text in named:
        if difference(predicted, lse) <= limit < difference(predicted, right):
            return text
    return ""


def explain_gradient(
    name: str,
    found: torch.Tensor,
    right: torch.Tensor,
    without_delta: torch.Tensor | None,
    head: int,
    limit: float,
) -> str:
    """Why ``found`` (dq, dk or dv) differs from ``right``: a constant factor, or the missing D
    term; '' when neither explains it."""
    found, right = found.double(), right.double()
    if without_delta is not None and difference(found, without_delta) <= limit:
        return (
            f"its {name} is what ds = p ∘ dp gives: the backward leaves out D = rowsum(dO ∘ O) in "
            "ds = p ∘ (dp − D), the term that accounts for the softmax's normalisation"
        )
    energy = float((right * right).sum())
    factor = float((found * right).sum()) / energy if energy > 0 else 0.0
    if factor == 0.0 or difference(found, factor * right) > limit * max(1.0, abs(factor)):
        return ""
    formula = {"dq": "dq = ds·K·scale", "dk": "dk = dsᵀ·Q·scale", "dv": "dv = pᵀ·dO"}[name]
    known = {
        head**0.5: f"its {name} is √{head} = {head**0.5:.4g} times too large: the scale "
        f"1/√{head} is missing from it ({formula})",
        head**-0.5: f"its {name} is multiplied by the scale 1/√{head} once too often ({formula})",
        LN2: f"its {name} is ln 2 = 0.693 times the right one: a base-2 quantity is used as "
        "natural",
        1 / LN2: f"its {name} is log₂e = 1.443 times the right one: a base-2 quantity is used as "
        "natural",
    }
    for value, text in known.items():
        if abs(factor - value) <= 1e-3 * value:
            return text
    return f"its {name} is {factor:.4g} times the right one ({formula})"


def from_saved(
    observed_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the right backward (no causal rule) given what a forward saved, its out and
    lse, right or not: p = exp(s − lse), D = rowsum(dO ∘ O), in float64."""
    q, k, v, out, lse, dout = (t.double() for t in (observed_q, k, v, out, lse, dout))
    scale = q.shape[-1] ** -0.5
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])  # (..., Lq, Lk)
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def without_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dq, dk of the backward that leaves out D (ds = p ∘ dp), no causal rule, in float64."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5
    p = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (..., Lq, Lk)
    ds = p * (dout @ v.transpose(-2, -1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale
