"""Flash attention in plain PyTorch, the exercise after self-attention, written as a learner
writes it: a ``torch.autograd.Function`` that walks over tiles of keys keeping a running maximum
and sum per query, saves one log-sum-exp per query row for its backward, and there recomputes
each tile's weights from it. Memory stays linear in length; a causal call skips the key tiles
that lie entirely after a query tile. ``qkv check --flash`` finds nothing wrong with it.

    qkv check examples/tutorials/flash_attention.py:FlashAttention --flash
"""

from __future__ import annotations

import math
from typing import Any

import torch

TILE = 64  # queries, and keys, per tile


def masked(s: torch.Tensor, qs: int, ks: int, offset: int, is_causal: bool) -> torch.Tensor:
    """The tile of scores s (..., rows, keys) starting at query qs and key ks, with -inf where
    key j comes after query i: j > i + offset, offset = Lk - Lq (the last query sees every key,
    as when decoding with a KV cache). Tiles wholly before the diagonal need no mask."""
    rows, keys = s.shape[-2:]
    if not is_causal or ks + keys - 1 <= qs + offset:
        return s
    i = torch.arange(qs, qs + rows, device=s.device)[:, None]
    j = torch.arange(ks, ks + keys, device=s.device)[None, :]
    return s.masked_fill(j > i + offset, -math.inf)


def key_tiles(q_start: int, rows: int, lk: int, is_causal: bool, offset: int) -> range:
    """The starts of the key tiles this query tile needs: with causal, none after its last
    query's last key (those would be masked completely)."""
    end = min(lk, q_start + rows + offset) if is_causal else lk
    return range(0, max(end, 0), TILE)


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv) -> out (..., Lq, Dv), lse (..., Lq)."""
    lq, lk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    offset = lk - lq
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)  # float32
    for qs in range(0, lq, TILE):
        q_tile = q[..., qs : qs + TILE, :].float()
        rows = q_tile.shape[-2]
        row_max = torch.full(q_tile.shape[:-1], -math.inf, device=q.device)  # running maximum
        row_sum = torch.zeros(q_tile.shape[:-1], device=q.device)  # Σ exp(s - row_max)
        acc = torch.zeros(*q_tile.shape[:-1], v.shape[-1], device=q.device)
        for ks in key_tiles(qs, rows, lk, is_causal, offset):
            k_tile, v_tile = k[..., ks : ks + TILE, :].float(), v[..., ks : ks + TILE, :].float()
            s = q_tile @ k_tile.transpose(-2, -1) * scale  # (..., rows, keys)
            s = masked(s, qs, ks, offset, is_causal)
            max_new = torch.maximum(row_max, s.amax(-1))
            # A row with no key yet has a maximum of -inf: measure it against 0, so that exp
            # gives 0 and not exp(-inf + inf) = NaN.
            max_safe = max_new.masked_fill(max_new == -math.inf, 0.0)
            alpha = torch.exp(row_max - max_safe)  # how much the old terms shrink
            p = torch.exp(s - max_safe[..., None])
            row_sum = alpha * row_sum + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v_tile
            row_max = max_new
        has_key = row_sum > 0  # a query with no key gives 0 and lse = -inf
        out[..., qs : qs + rows, :] = torch.where(
            has_key[..., None], acc / row_sum.clamp_min(1e-30)[..., None], 0.0
        ).to(q.dtype)
        lse[..., qs : qs + rows] = torch.where(has_key, row_max + torch.log(row_sum), -math.inf)
    return out, lse


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, recomputing each tile's weights p = exp(s - lse) instead of storing them."""
    lq, lk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    offset = lk - lq
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO * O), (..., Lq)
    # A row with no key has lse = -inf; as +inf it makes exp(s - lse) = 0 there instead of NaN.
    lse = lse.masked_fill(lse == -math.inf, math.inf)
    dq, dk, dv = (torch.zeros(t.shape, device=t.device) for t in (q, k, v))
    for qs in range(0, lq, TILE):
        q_tile, do_tile = q[..., qs : qs + TILE, :].float(), dout[..., qs : qs + TILE, :].float()
        rows = q_tile.shape[-2]
        for ks in key_tiles(qs, rows, lk, is_causal, offset):
            k_tile, v_tile = k[..., ks : ks + TILE, :].float(), v[..., ks : ks + TILE, :].float()
            s = masked(q_tile @ k_tile.transpose(-2, -1) * scale, qs, ks, offset, is_causal)
            p = torch.exp(s - lse[..., qs : qs + rows, None])
            dv[..., ks : ks + TILE, :] += p.transpose(-2, -1) @ do_tile
            dp = do_tile @ v_tile.transpose(-2, -1)
            ds = p * (dp - delta[..., qs : qs + rows, None])
            dq[..., qs : qs + TILE, :] += ds @ k_tile * scale
            dk[..., ks : ks + TILE, :] += ds.transpose(-2, -1) @ q_tile * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        out, lse = flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*flash_backward(q, k, v, out, lse, dout, ctx.is_causal), None)
