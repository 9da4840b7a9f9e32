"""A float64 oracle for packed (varlen) attention, written from the words of the convention and
independent of qkv: every sequence on its own, its allowed keys listed position by position.

Sequence i: q_len queries, k_len keys; query j sits at p = k_len − q_len + j and may attend key
t iff p − left ≤ t ≤ p + right (None: unbounded). Scores: q·k · scale, then softcap · tanh(s /
softcap), then − slope_h · |p − t|; a sink adds exp(sink_h) to the denominator with value 0.
Legend: N sequences, T_q / T_k packed tokens, H_q / H_kv heads, D / Dv features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """A packed batch: query and key lengths per sequence and its tensors."""

    q_lens: list[int]
    k_lens: list[int]
    query: torch.Tensor  # (T_q, H_q, D)
    key: torch.Tensor  # (T_k, H_kv, D)
    value: torch.Tensor  # (T_k, H_kv, Dv)

    @property
    def cu_seq_q(self) -> torch.Tensor:
        return cumulative(self.q_lens)

    @property
    def cu_seq_k(self) -> torch.Tensor:
        return cumulative(self.k_lens)

    @property
    def bounds(self) -> tuple[int, int]:
        return max(self.q_lens, default=0), max(self.k_lens, default=0)


def cumulative(lengths: list[int]) -> torch.Tensor:
    """(N + 1,) int32: 0, then running sums of ``lengths``."""
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32
    )


def batch(
    q_lens: list[int],
    k_lens: list[int],
    hq: int = 4,
    hkv: int = 2,
    d: int = 8,
    dv: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return Batch(
        q_lens,
        k_lens,
        draw(sum(q_lens), hq, d),
        draw(sum(k_lens), hkv, d),
        draw(sum(k_lens), hkv, dv),
    )


def oracle(
    b: Batch,
    *,
    left: int | None = None,
    right: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T_q, H_q, Dv), lse (H_q, T_q)) in float64, differentiable in whatever is passed."""
    q = (b.query if query is None else query).double()
    k = (b.key if key is None else key).double()
    v = (b.value if value is None else value).double()
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(b.q_lens, b.k_lens):
        for j in range(lq):
            p = lk - lq + j
            allowed = [
                t
                for t in range(lk)
                if (left is None or t >= p - left) and (right is None or t <= p + right)
            ]
            row_out, row_lse = [], []
            for h in range(hq):
                keys = k[[k0 + t for t in allowed], h // g]  # (n, D)
                s = keys @ q[q0 + j, h] * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if alibi_slopes is not None:
                    distance = torch.tensor([abs(p - t) for t in allowed], dtype=torch.float64)
                    s = s - alibi_slopes[h].double() * distance
                logits = s if sinks is None else torch.cat([s, sinks[h].double().view(1)])
                if logits.numel() == 0:
                    row_out.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                    row_lse.append(torch.tensor(-math.inf, dtype=torch.float64))
                    continue
                lse = torch.logsumexp(logits, dim=0)
                weights = torch.exp(s - lse)
                row_out.append(weights @ v[[k0 + t for t in allowed], h // g])
                row_lse.append(lse)
            outs.append(torch.stack(row_out))
            lses.append(torch.stack(row_lse))
        q0, k0 = q0 + lq, k0 + lk
    if not outs:
        return torch.zeros(0, hq, v.shape[-1], dtype=torch.float64), torch.zeros(hq, 0).double()
    return torch.stack(outs), torch.stack(lses, dim=1)
