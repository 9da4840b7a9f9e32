"""Tutorial 004 ("a single token's perspective"), re-typed: d_in != d_out, five outputs.

It keeps the tutorial's mistake: the scores are divided by √d_in, the width of the input, while
the scale is 1/√d_k with d_k = d_out, the size of the queries and keys. ``qkv check`` fails
``scale`` and ``oracle`` and names both numbers. (The tutorial also reads a global ``d_in``
inside ``forward``; here it is stored on the module.)

    qkv check examples/tutorials/tutorial_004_single_token.py:SelfAttention
"""

from __future__ import annotations

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, no_of_tokens: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = d_in
        self.query_matrix = nn.Linear(d_in, d_out)
        self.key_matrix = nn.Linear(d_in, d_out)
        self.value_matrix = nn.Linear(d_in, d_out)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        queries = self.query_matrix(tokens)
        keys = self.key_matrix(tokens)
        values = self.value_matrix(tokens)
        weights = torch.softmax(queries @ keys.transpose(-2, -1) / self.d_in**0.5, dim=-1)
        return weights @ values, queries, keys, values, weights
