"""Tutorial 001 ("self-attention vs attention"), re-typed: the functional form and multi-head.

Its mask marks what is *blocked* (True = may not attend, as ``triu(..., diagonal=1)`` gives),
the opposite of qkv's convention (True = may attend). ``qkv check`` detects the polarity it is
given and says so. What it finds wrong: a query whose keys are all masked gets a row of -inf
scores, and the softmax of that row is 0/0 = NaN.

    qkv check examples/tutorials/tutorial_001_the_cat_sat.py:attend
    qkv check examples/tutorials/tutorial_001_the_cat_sat.py:MultiHeadAttention
"""

from __future__ import annotations

import math

import torch
from torch import nn


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / √d_k) v; ``mask`` True = blocked."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, H, L, d_k)
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.d_k).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, width = x.shape
        out, _ = attend(
            self.heads(self.w_q(x)), self.heads(self.w_k(x)), self.heads(self.w_v(x)), mask
        )
        return self.w_o(out.transpose(1, 2).reshape(batch, length, width))
