"""Tutorial 003 ("three levels of hand-crafting"), re-typed: V1, V2 and V3.

V1 has three projections, V2 one fused projection; both are single-head, so √hidden_dim is the
right scale. V3 adds an attention mask, dropout and an output projection, and keeps the
tutorial's mistake: masked scores are set to 1e-20. A score of about 0 is an ordinary score, so
padded keys keep their share of the weight. ``qkv check`` fails ``padding`` on V3 and says why.

    qkv check examples/tutorials/tutorial_003_three_levels.py:SelfAttentionV3
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SelfAttentionV1(nn.Module):
    def __init__(self, hidden_dim: int = 728) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.query = nn.Linear(hidden_dim, hidden_dim)
        self.key = nn.Linear(hidden_dim, hidden_dim)
        self.value = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(-1, -2) / math.sqrt(self.hidden_dim)
        return scores.softmax(dim=-1) @ self.value(x)


class SelfAttentionV2(nn.Module):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.project = nn.Linear(hidden_dim, 3 * hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x).split(self.hidden_dim, dim=-1)
        return (q @ k.transpose(-1, -2) / math.sqrt(self.hidden_dim)).softmax(dim=-1) @ v


class SelfAttentionV3(nn.Module):
    def __init__(self, hidden_dim: int, dropout_rate: float = 0.1) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.project = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.dropout = nn.Dropout(dropout_rate)
        self.output = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(x).split(self.hidden_dim, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hidden_dim)
        if attention_mask is not None:  # the tutorial's mistake: 1e-20 masks nothing
            scores = scores.masked_fill(attention_mask == 0, 1e-20)
        weights = self.dropout(scores.softmax(dim=-1))
        return self.output(weights @ v)
