"""A packed batch's layout and rules, shared by flash's varlen and paged paths: where each
sequence's queries and keys lie, and which keys each query row may see.

Legend: N sequences, T_q packed query tokens, H_q heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where each of N sequences lies: its first query and key token and its lengths (the keys
    it uses); ``table`` (N, max_pages) int64 on the CPU for a paged call (keys then start at 0
    in each sequence's pages)."""

    q_start: list[int]
    q_len: list[int]
    k_start: list[int]
    k_len: list[int]
    table: torch.Tensor | None


@dataclass(frozen=True)
class VarlenRules:
    """A varlen call's checked score rules: each query at position p sees keys
    p − left … p + right (None: unbounded; causal is right = 0)."""

    scale: float
    left: int | None
    right: int | None
    softcap: float | None
    alibi_slopes: torch.Tensor | None  # (H_q,)
    sinks: torch.Tensor | None  # (H_q,)


def rows(packing: Packing, rules: VarlenRules) -> torch.Tensor:
    """(T_q, 4) int64 per query token: its sequence, the first and one past the last key it may
    see among its sequence's keys, and its position p (its diagonal)."""
    q_len = torch.tensor(packing.q_len, dtype=torch.long)
    k_len = torch.tensor(packing.k_len, dtype=torch.long)
    q_start = torch.tensor(packing.q_start, dtype=torch.long)
    ends = q_start + q_len
    tokens = torch.arange(int(ends[-1]) if len(packing.q_len) else 0)
    # (T_q,): the sequence of each token, the first whose end lies beyond it (searchsorted, not
    # repeat_interleave: that one took milliseconds for a few dozen sequences)
    sequence = torch.searchsorted(ends, tokens, right=True)
    local = tokens - q_start[sequence]
    length = k_len[sequence]
    position = local + length - q_len[sequence]
    lo = torch.zeros_like(position)
    hi = length.clone()
    if rules.left is not None:
        lo = torch.clamp(position - rules.left, min=0)
    if rules.right is not None:
        hi = torch.minimum(hi, position + rules.right + 1)
    hi = torch.maximum(hi, lo)  # a row that sees nothing: an empty range
    return torch.stack([sequence, torch.minimum(lo, length), hi, position], dim=1)
