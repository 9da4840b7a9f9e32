"""Tutorial 000 ("QKV computation from scratch"), re-typed: one head, optional causal rule.

Bias-free query/key/value projections, an output projection with a bias, dropout on the weights,
and the weights returned beside the output. With a single head the query/key size is the model
width, so dividing by √embed_dim is the right scale here. ``qkv check`` finds it correct; it has
no mask argument, so the padding checks are skipped.

    qkv check examples/tutorials/tutorial_000_single_head.py:SingleHeadAttention
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SingleHeadAttention(nn.Module):
    def __init__(self, embed_dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.size = embed_dim  # one head: d_k is the whole width
        self.to_query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.to_key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.to_value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.to_output = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        length = x.shape[1]
        queries, keys, values = self.to_query(x), self.to_key(x), self.to_value(x)  # (B, L, E)
        scores = queries @ keys.transpose(1, 2) / math.sqrt(self.size)  # (B, L, L)
        if causal:
            future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        weights = self.dropout(scores.softmax(dim=-1))
        return self.to_output(weights @ values), weights
