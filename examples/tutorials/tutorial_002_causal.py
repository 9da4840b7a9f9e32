"""Tutorial 002 ("TR02 causal self-attention"), re-typed: always causal, one fused projection.

One bias-free Linear gives Q, K and V at once; heads are split as (B, L, H, D) and transposed
to (B, H, L, D); the causal rule is built in. ``qkv check`` finds it causal by itself (no
flag) and correct.

    qkv check examples/tutorials/tutorial_002_causal.py:CausalSelfAttention
"""

from __future__ import annotations

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, return_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        batch, length, width = x.shape
        q, k, v = (
            part.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )  # each (B, H, L, D)
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5  # (B, H, L, L)
        seen = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        out = (self.dropout(weights) @ v).transpose(1, 2).reshape(batch, length, width)
        out = self.proj(out)
        return (out, weights) if return_weights else out
