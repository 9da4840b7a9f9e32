"""A first try at flash attention's forward, with the mistake that first tries make most: when a
new tile of keys raises a row's running maximum, the accumulator is rescaled by
exp(old max - new max) but the running sum is not. The sum then mixes terms measured against
different maxima, so every row whose maximum grew after its first tile is divided by too much.
One tile hides it (nothing is rescaled then), so graders that test short sequences pass it.

Everything else is flash_attention.py's: its tiles, its causal mask, its backward (which is
right, but recomputes the weights from this forward's wrong lse). ``qkv check --flash`` names
the mistake, and the tile size that reproduces it.

    qkv check examples/tutorials/flash_attention_no_rescale.py:FlashAttention --flash
"""

from __future__ import annotations

import math
from typing import Any

import flash_attention
import torch
from flash_attention import TILE, key_tiles, masked


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv) -> out (..., Lq, Dv), lse (..., Lq)."""
    lq, lk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    offset = lk - lq
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
    for qs in range(0, lq, TILE):
        q_tile = q[..., qs : qs + TILE, :].float()
        row_max = torch.full(q_tile.shape[:-1], -math.inf, device=q.device)
        row_sum = torch.zeros(q_tile.shape[:-1], device=q.device)
        acc = torch.zeros(*q_tile.shape[:-1], v.shape[-1], device=q.device)
        for ks in key_tiles(qs, q_tile.shape[-2], lk, is_causal, offset):
            k_tile, v_tile = k[..., ks : ks + TILE, :].float(), v[..., ks : ks + TILE, :].float()
            s = masked(q_tile @ k_tile.transpose(-2, -1) * scale, qs, ks, offset, is_causal)
            max_new = torch.maximum(row_max, s.amax(-1))
            max_safe = max_new.masked_fill(max_new == -math.inf, 0.0)
            p = torch.exp(s - max_safe[..., None])
            row_sum = row_sum + p.sum(-1)  # the mistake: row_sum is never multiplied by alpha
            acc = torch.exp(row_max - max_safe)[..., None] * acc + p @ v_tile
            row_max = max_new
        has_key = row_sum > 0
        rows = slice(qs, qs + q_tile.shape[-2])
        out[..., rows, :] = torch.where(
            has_key[..., None], acc / row_sum.clamp_min(1e-30)[..., None], 0.0
        ).to(q.dtype)
        lse[..., rows] = torch.where(has_key, row_max + torch.log(row_sum), -math.inf)
    return out, lse


class FlashAttention(flash_attention.FlashAttention):
    """flash_attention.FlashAttention with this forward; the backward is inherited."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        out, lse = flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out
