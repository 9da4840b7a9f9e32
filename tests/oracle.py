"""The float64 oracle every backend is checked against, and how tests call a backend.

The oracle is written independently of qkv, for clarity over speed: the set of keys each query may
attend is built position by position from the contract's words, and the softmax runs over that
set only. Legend: B batch, H heads, Lq query length, Lk key length, Dk / Dv features.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import qkv
from qkv.backends.base import Call, Unsupported
from qkv.backends.dispatch import why_not

BACKENDS = ("reference", "sdpa", "flash", "auto")

# Per dtype: (atol, rtol) against the float64 oracle. float16/bfloat16 allow about one unit in the
# last place of the output: the contract computes them in float32, so only the final rounding (and
# the rounding of the inputs, which the oracle shares) separates them from float64.
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1.5e-3, 1.5e-3),
    torch.bfloat16: (1.2e-2, 1.2e-2),
}


def allowed_keys(
    lq: int, lk: int, causal: Any, mask: torch.Tensor | None, scores_shape: tuple[int, ...]
) -> torch.Tensor:
    """(*batch, Hq, Lq, Lk) bool: may query i attend key j, straight from the contract's words."""
    allowed = torch.ones(scores_shape, dtype=torch.bool)
    if causal is not False:
        rule = torch.ones(lq, lk, dtype=torch.bool)
        for i in range(lq):
            for j in range(lk):
                if causal == "top-left":
                    rule[i, j] = j <= i
                else:  # True or "bottom-right": the last query sits on the last key
                    rule[i, j] = j <= i + (lk - lq)
        allowed = allowed & rule
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == torch.bool else mask != -math.inf)
    return allowed


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: Any = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, weights) of attention in float64, without dropout; differentiable.

    Shapes as in ``qkv.attention``; a query with no allowed key gets 0 output and 0 weights.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    squeeze = q.dim() == k.dim() == v.dim() == 2
    q, k, v = (t if t.dim() >= 3 else t.unsqueeze(0) for t in (q, k, v))
    kv_lead = torch.broadcast_shapes(k.shape[:-2], v.shape[:-2])  # k and v broadcast together
    k, v = k.expand(*kv_lead, *k.shape[-2:]), v.expand(*kv_lead, *v.shape[-2:])
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq % hkv == 0 and hkv not in (1, hq):
        # grouped heads: key/value head j serves query heads j*g ... j*g+g-1
        index = torch.tensor([h // (hq // hkv) for h in range(hq)])
        k, v = k.index_select(-3, index), v.index_select(-3, index)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("...qd,...kd->...qk", q, k) * scale  # (*B, Hq, Lq, Lk)
    if mask is not None:
        mask = mask.cpu()
        if mask.dtype != torch.bool:
            scores = scores + mask.to(torch.float64)
    lq, lk = q.shape[-2], k.shape[-2]
    allowed = allowed_keys(lq, lk, causal, mask, scores.shape)
    scores, allowed = torch.broadcast_tensors(scores, allowed)
    if lk == 0:
        row_max = scores.sum(dim=-1, keepdim=True)  # no keys at all: zeros of the row's shape
    else:
        row_max = scores.masked_fill(~allowed, -math.inf).amax(dim=-1, keepdim=True)
    row_max = row_max.nan_to_num(neginf=0.0)  # rows with no allowed key: any finite shift
    exps = torch.where(allowed, (scores - row_max).exp(), torch.zeros(()).double())
    totals = exps.sum(dim=-1, keepdim=True)
    weights = exps / torch.where(totals > 0, totals, torch.ones(()).double())
    out = torch.einsum("...qk,...kd->...qd", weights, v)  # (*B, Hq, Lq, Dv)
    if squeeze:
        out, weights = out.squeeze(0), weights.squeeze(0)
    return out, weights


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (any dtype) equals the float64 ``expected`` within ``dtype``'s tolerance."""
    atol, rtol = TOLERANCE[dtype]
    assert got.shape == expected.shape, f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol, equal_nan=True)


# --- calling a backend ------------------------------------------------------------------------


def available(backend: str) -> bool:
    """False only when the backend's module is not part of this installation (yet)."""
    tiny = torch.zeros(1, 1, 1)
    reason = why_not(backend, Call(tiny, tiny, tiny, None, None, 1.0, 0.0, False))
    return reason is None or "not available" not in reason


def require(backend: str) -> None:
    if backend != "auto" and not available(backend):
        pytest.skip(f'backend "{backend}" is not available in this installation')


def may_refuse(backend: str, q: torch.Tensor, k: torch.Tensor, **kwargs: Any) -> bool:
    """The refusals each backend documents; any other refusal is a bug.

    - reference and auto run everything that fits in memory.
    - sdpa: torch's fused kernel returns no weights and takes no empty sequence; it adds masks
      to the scores, so a NaN/Inf in q or k under a mask or causal rule would leak into rows that
      may not attend it: it refuses those calls.
    - flash: may refuse dropout, returning weights, and a float mask that needs a gradient.
    """
    if backend == "sdpa":
        masked = kwargs.get("mask") is not None or kwargs.get("causal", False) is not False
        return (
            kwargs.get("return_weights", False)
            or q.shape[-2] == 0
            or k.shape[-2] == 0
            or (masked and not (bool(q.isfinite().all()) and bool(k.isfinite().all())))
        )
    if backend == "flash":
        mask = kwargs.get("mask")
        return (
            kwargs.get("dropout_p", 0.0) > 0
            or kwargs.get("return_weights", False)
            or (mask is not None and mask.requires_grad)
        )
    return False


def attend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """``qkv.attention(q, k, v, backend=backend, **kwargs)``, or None when the backend refused
    the call for a reason it documents. Skips when the backend is not installed; fails on any
    other refusal."""
    require(backend)
    try:
        return qkv.attention(q, k, v, backend=backend, **kwargs)
    except Unsupported as error:
        if not may_refuse(backend, q, k, **kwargs):
            pytest.fail(f'backend="{backend}" refused a call it must run: {error}')
        return None
