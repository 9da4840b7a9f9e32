"""What a flash tile adds to ``q kᵀ · scale + mask``: soft-capping, ALiBi, a window's left edge
and segments, each computed for one (queries q0:q1, keys k0:k1) tile and never for the whole
(Lq, Lk) score matrix; and the forms the compiled kernel takes them in (``kernel_ranges``,
``kernel_slopes``, ``decoding_slopes``, and the empty tensors of an absent rule).

Scores in a tile are in base 2 (see ``loop.py``): every quantity added to them is multiplied by
log2(e) first. Legend: N = B·Hkv key/value heads, g query heads per key/value head, R = g·(q1−q0)
rows of a tile, kt keys of a tile.
"""

from __future__ import annotations

import math

import torch

from qkv import masks
from qkv.backends.base import Rules

LOG2_E = 1.0 / math.log(2.0)  # scores in base-2 units: exp(x) = 2^(x · LOG2_E)


class TileRules:
    """``Rules`` for the tiles of one call: which keys a query tile may reach, and the scores'
    soft-capping, ALiBi and blocked pairs per tile. In a backward pass it also keeps the last
    tile's soft-capping derivative and adds up the ALiBi slopes' gradient."""

    def __init__(
        self,
        rules: Rules,
        batch: tuple[int, ...],
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        grad: bool,
    ) -> None:
        n, g, lq, lk = shape  # key/value heads, query heads per key/value head, lengths
        self.rules, self.lq, self.lk = rules, lq, lk
        self.slopes = None  # (N, g) in base 2
        self.slopes_grad: torch.Tensor | None = None  # (N, g), natural units
        if rules.alibi_slopes is not None:
            hq = rules.alibi_slopes.shape[-1]
            slopes = rules.alibi_slopes.detach().to(dtype).expand(*batch, hq).reshape(n, g)
            self.slopes = slopes * LOG2_E
            if grad and rules.alibi_slopes.requires_grad:
                self.slopes_grad = torch.zeros_like(slopes)
        self.spans = None
        if rules.segments is not None:  # over the whole batch: a tile is skipped for all
            first, last, _ = masks.segment_spans(rules.segments)
            self.spans = first.amin(dim=0), last.amax(dim=0)
        self.cap_derivative: torch.Tensor | None = None  # (N, R, kt): d capped / d raw score
        self._buffer: torch.Tensor | None = None
        self.grad = grad

    def key_range(self, offset: int | None, q0: int, q1: int) -> tuple[int, int]:
        """[start, end): keys that queries q0:q1 may reach (tiles outside it are skipped)."""
        return masks.key_range(offset, self.rules.window_offset, self.spans, q0, q1, self.lk)

    def modify(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """Soft-cap, then add ALiBi to, the (N, R, kt) base-2 scores of a tile, in place."""
        cap = self.rules.softcap
        if cap is not None:
            cap2 = cap * LOG2_E  # softcap · tanh(s / softcap), both sides in base 2
            tanh = scores.div_(cap2).tanh_()
            if self.grad:  # d/ds softcap · tanh(s / softcap) = 1 − tanh², in a reused buffer
                derivative = self._derivative_buffer(tanh)
                self.cap_derivative = torch.mul(tanh, tanh, out=derivative).neg_().add_(1.0)
            tanh.mul_(cap2)
        if self.slopes is not None:
            n, g = self.slopes.shape
            per_head = scores.view(n, g, q1 - q0, k1 - k0)
            distance = self._distance(q0, q1, k0, k1, scores.dtype)
            per_head.sub_(self.slopes[..., None, None] * distance)

    def _derivative_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as ``like`` in memory kept for the call (fresh tile-sized allocations
        cost page faults that rival the arithmetic)."""
        if self._buffer is None or self._buffer.numel() < like.numel():
            self._buffer = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return self._buffer[: like.numel()].view(like.shape)

    def lower_in(self, q0: int, q1: int, k0: int) -> int | None:
        """The window offset if some pair of the tile lies left of the window, else None."""
        lower = self.rules.window_offset
        if lower is None or k0 >= q1 - 1 + lower:
            return None
        return lower

    def gradient(self, ds: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """dL/d(raw score) from dL/d(score) ``ds`` (N, R, kt): add the tile's part of the
        slopes' gradient (dscore/dslope = −distance), then undo soft-capping's derivative."""
        if self.slopes_grad is not None:
            n, g = self.slopes_grad.shape
            distance = self._distance(q0, q1, k0, k1, ds.dtype)
            per_head = ds.view(n, g, q1 - q0, k1 - k0)
            self.slopes_grad.sub_(torch.einsum("ngqk,qk->ng", per_head, distance))
        if self.cap_derivative is not None:
            ds.mul_(self.cap_derivative)
        return ds

    def _distance(self, q0: int, q1: int, k0: int, k1: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.slopes is not None
        shift = self.lk - self.lq  # bottom-right aligned, as the causal rule
        return masks.alibi_distance(q0, q1, k0, k1, shift, self.slopes.device, dtype)


def kernel_ranges(
    segments: tuple[torch.Tensor, torch.Tensor] | None, batch: tuple[int, ...], hq: int, lq: int
) -> tuple[torch.Tensor, int] | None:
    """The compiled kernel's form of packed sequences: the keys [lo, hi) of each query row's
    segment, (R, Lq, 2) int64 for the R = prod(*batch) batch entries, and the heads per entry
    (Hq); an empty tensor without segments; None where the kernel cannot take them (segment
    ids whose keys are not contiguous runs). Built once per pass (the causal rule and a
    window are the kernel's own integer arguments)."""
    if segments is None:
        return torch.empty(0, dtype=torch.long), 1
    query_ids, key_ids = segments
    expanded = query_ids.expand(*batch, lq), key_ids.expand(*batch, key_ids.shape[-1])
    first, last, runs = masks.segment_spans(expanded)
    if not runs:
        return None
    lo, hi = first.reshape(-1, lq).cpu(), last.reshape(-1, lq).cpu() + 1
    return torch.stack([lo, hi], dim=-1).contiguous(), hq


def kernel_slopes(
    alibi_slopes: torch.Tensor | None, batch: tuple[int, ...], hq: int
) -> torch.Tensor | None:
    """ALiBi's slopes as the compiled kernel takes them: float32, one per query head of the
    flattened (*batch, Hq)."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.detach().to(torch.float32).expand(*batch, hq)
    return slopes.reshape(-1).contiguous().cpu()


# An absent rule's tensors for the compiled functions (never written: the kernel reads them only
# where they are not empty), made once rather than on every call: kernel.py's entry points and
# the packed and paged decoding calls (varlen.py, paged.py) pass them.
NO_RANGES = torch.empty(0, dtype=torch.long)
NO_SLOPES = torch.empty(0)


def decoding_slopes(alibi_slopes: torch.Tensor | None) -> torch.Tensor:
    """ALiBi's slopes (one per query head, or None) as the packed and paged decoding calls take
    them: float32, contiguous, on the CPU; NO_SLOPES for none."""
    if alibi_slopes is None:
        return NO_SLOPES
    return alibi_slopes.detach().to(torch.float32).contiguous().cpu()
