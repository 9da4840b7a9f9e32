"""The tutorials' mistakes, corrected: each passes every check that applies.

``SelfAttentionV3`` (tutorial 003) fills masked scores with -inf and gives a row with no key
zero weights instead of NaN; ``SelfAttention`` (tutorial 004) scales by 1/√d_out, the key size;
``attend`` (tutorial 001) takes qkv's convention, True = may attend, and never returns NaN.

    qkv check examples/tutorials/corrected.py:SelfAttentionV3
"""

from __future__ import annotations

import math

import torch
from torch import nn


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys; a row whose scores are all -inf (no key allowed) gives zeros."""
    has_key = ~scores.isneginf().all(dim=-1, keepdim=True)
    weights = scores.masked_fill(~has_key, 0.0).softmax(dim=-1)
    return weights * has_key  # no NaN is ever made, so the gradient is finite too


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / √d_k) v; ``mask`` True = may attend."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = safe_softmax(scores)
    return weights @ v, weights


class SelfAttentionV3(nn.Module):
    def __init__(self, hidden_dim: int, dropout_rate: float = 0.1) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.project = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.dropout = nn.Dropout(dropout_rate)
        self.output = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(x).split(self.hidden_dim, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hidden_dim)  # (B, L, L)
        if attention_mask is not None:  # (B, L), 1 = real token: hide padded keys (columns)
            scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        weights = self.dropout(safe_softmax(scores))
        return self.output(weights @ v)


class SelfAttention(nn.Module):
    def __init__(self, no_of_tokens: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_out = d_out
        self.query_matrix = nn.Linear(d_in, d_out)
        self.key_matrix = nn.Linear(d_in, d_out)
        self.value_matrix = nn.Linear(d_in, d_out)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        queries = self.query_matrix(tokens)
        keys = self.key_matrix(tokens)
        values = self.value_matrix(tokens)
        weights = torch.softmax(queries @ keys.transpose(-2, -1) / self.d_out**0.5, dim=-1)
        return weights @ values, queries, keys, values, weights
