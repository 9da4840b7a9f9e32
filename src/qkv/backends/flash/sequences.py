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
    # Per sequence: its number, its keys, and its first query token's position less that token's
    # index (tokens lie packed in sequence order); then per token. A decoding step runs this
    # every call: a few operations on whole tensors, not one per sequence.
    per_sequence = torch.tensor(
        [
            (i, lk, lk - lq - q0)
            for i, (q0, lq, lk) in enumerate(zip(packing.q_start, packing.q_len, packing.k_len))
        ],
        dtype=torch.long,
    ).view(-1, 3)
    total = sum(packing.q_len)
    per_token = per_sequence.repeat_interleave(
        torch.tensor(packing.q_len, dtype=torch.long), dim=0, output_size=total
    )
    sequence, length, offset = per_token.unbind(1)
    position = offset + torch.arange(total)
    lo = torch.zeros_like(position) if rules.left is None else (position - rules.left).clamp(min=0)
    hi = length if rules.right is None else torch.minimum(length, position + (rules.right + 1))
    hi = torch.maximum(hi, lo)  # a row that sees nothing: an empty range
    return torch.stack([sequence, torch.minimum(lo, length), hi, position], dim=1)
