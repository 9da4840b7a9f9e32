"""Flash attention with one planted mistake each, for ``qkv check --flash``'s tests.

``Flash`` is right: a function f(q, k, v, causal=False) -> (out, lse) over key tiles of 32 with
a running maximum m and sum (``total``) of exp(s − m), bottom-right causal alignment with the
key tiles after a query tile skipped, rows with no key giving 0 and lse −inf, and a tiled
backward that recomputes p = exp(s − lse). Each subclass overrides one small step with a mistake
that flash attention exercises really see. Legend: L/Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.checker.flash import cost as flash_cost

Tensor = torch.Tensor


def _flops(call: Any, device: torch.device) -> float:
    """The work check's clock, replaced: matrix-product flops of one call (1 when none are seen,
    as for a compiled kernel)."""
    with FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops()) or 1.0


def small_and_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory counted at L = 128 and 512 instead of 512 and 2,048, and work counted in flops
    at L = 256 instead of timed at 4,096: fast, and no test times code."""
    monkeypatch.setattr(flash_cost, "MEMORY_LENGTHS", (128, 512))
    monkeypatch.setattr(flash_cost, "WORK_LENGTH", 256)
    monkeypatch.setattr(flash_cost, "_seconds", _flops)


class Saved(NamedTuple):
    """What the forward saves for the backward."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, flash: Flash, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Any:
        out, lse = flash.forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.flash, ctx.causal = flash, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _: Tensor) -> Any:
        return (None, *ctx.flash.backward(Saved(*ctx.saved_tensors), dout, ctx.causal), None)


class Flash:
    tile = 32

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Any:
        return _Apply.apply(self, q, k, v, causal)

    def upcast(self, t: Tensor) -> Tensor:
        return t.float()  # scores, softmax and sums in float32

    def scale(self, q: Tensor, v: Tensor) -> float:
        return q.shape[-1] ** -0.5

    def offset(self, lq: int, lk: int) -> int:  # the causal mask's: bottom-right
        return lk - lq

    def key_starts(self, qs: int, rows: int, lq: int, lk: int, causal: bool) -> Sequence[int]:
        end = min(lk, qs + rows + lk - lq) if causal else lk  # skip tiles after the diagonal
        return range(0, max(end, 0), self.tile)

    def masked(self, s: Tensor, qs: int, ks: int, lq: int, lk: int, causal: bool) -> Tensor:
        if not causal:
            return s
        i = torch.arange(qs, qs + s.shape[-2])[:, None] + self.offset(lq, lk)
        j = torch.arange(ks, ks + s.shape[-1])[None, :]
        return s.masked_fill(j > i, -math.inf)

    def update(
        self, m: Tensor, total: Tensor, acc: Tensor, s: Tensor, v: Tensor
    ) -> tuple[Tensor, ...]:
        m_new = torch.maximum(m, s.amax(-1))
        safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key yet: exp(-inf) = 0, not NaN
        alpha, p = torch.exp(m - safe), torch.exp(s - safe[..., None])
        return m_new, alpha * total + p.sum(-1), alpha[..., None] * acc + p.to(v.dtype) @ v

    def finish(self, m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
        has_key = total > 0
        out = torch.where(has_key[..., None], acc / total.clamp_min(1e-30)[..., None], 0.0)
        return out, torch.where(has_key, m + total.log(), -math.inf)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        lq, lk, scale = q.shape[-2], k.shape[-2], self.scale(q, v)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = torch.zeros(q.shape[:-1])
        for qs in range(0, lq, self.tile):
            q_tile = self.upcast(q[..., qs : qs + self.tile, :])
            m = torch.full(q_tile.shape[:-1], -math.inf, dtype=q_tile.dtype)
            total = torch.zeros(q_tile.shape[:-1], dtype=q_tile.dtype)
            acc = torch.zeros(*q_tile.shape[:-1], v.shape[-1], dtype=q_tile.dtype)
            for ks in self.key_starts(qs, q_tile.shape[-2], lq, lk, causal):
                s = q_tile @ self.upcast(k[..., ks : ks + self.tile, :]).transpose(-2, -1) * scale
                s = self.masked(s, qs, ks, lq, lk, causal)
                v_tile = self.upcast(v[..., ks : ks + self.tile, :])
                m, total, acc = self.update(m, total, acc, s, v_tile)
            tile_out, tile_lse = self.finish(m, total, acc)
            out[..., qs : qs + self.tile, :] = tile_out.to(q.dtype)
            lse[..., qs : qs + self.tile] = tile_lse.float()
        return out, lse

    def ds(self, p: Tensor, dp: Tensor, delta: Tensor) -> Tensor:
        return p * (dp - delta[..., None])

    def backward(self, saved: Saved, dout: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = saved
        lq, lk, scale = q.shape[-2], k.shape[-2], self.scale(q, v)
        delta = (dout.float() * out.float()).sum(-1)
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # no key: p = exp(s - inf) = 0
        dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
        for qs in range(0, lq, self.tile):
            rows = slice(qs, qs + self.tile)
            q_tile, do_tile = q[..., rows, :].float(), dout[..., rows, :].float()
            for ks in self.key_starts(qs, q_tile.shape[-2], lq, lk, causal):
                keys = slice(ks, ks + self.tile)
                s = q_tile @ k[..., keys, :].float().transpose(-2, -1) * scale
                s = self.masked(s, qs, ks, lq, lk, causal)
                p = torch.exp(s - lse[..., rows, None])
                dv[..., keys, :] += p.transpose(-2, -1) @ do_tile
                ds = self.ds(
                    p, do_tile @ v[..., keys, :].float().transpose(-2, -1), delta[..., rows]
                )
                dq[..., rows, :] += ds @ k[..., keys, :].float() * scale
                dk[..., keys, :] += ds.transpose(-2, -1) @ q_tile * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class NoRescaleOfSum(Flash):
    def update(
        self, m: Tensor, total: Tensor, acc: Tensor, s: Tensor, v: Tensor
    ) -> tuple[Tensor, ...]:
        m_new, _, acc = super().update(m, total, acc, s, v)
        safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        return (
            m_new,
            total + torch.exp(s - safe[..., None]).sum(-1),
            acc,
        )  # the sum is never multiplied by alpha


class Base2Lse(Flash):
    def finish(self, m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
        out, lse = super().finish(m, total, acc)
        return out, lse / math.log(2)  # a Triton kernel's m₂ + log₂ l₂, never converted


class Exp2WithoutLog2e(Flash):
    def scale(self, q: Tensor, v: Tensor) -> float:
        return q.shape[-1] ** -0.5 * math.log(2)  # what 2^s instead of e^s amounts to


class ScaleByValueWidth(Flash):
    def scale(self, q: Tensor, v: Tensor) -> float:
        return v.shape[-1] ** -0.5


class DropsPartialKeyTile(Flash):
    def key_starts(self, qs: int, rows: int, lq: int, lk: int, causal: bool) -> range:
        return range(0, lk - lk % self.tile, self.tile)  # only whole tiles (no causal here)


class NaNWhereNoKey(Flash):
    def finish(self, m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
        return acc / total[..., None], m + total.log()  # 0 / 0 where a row has no key


class FiniteLseWhereNoKey(Flash):
    def finish(self, m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
        out, _ = super().finish(m, total, acc)
        safe = m.masked_fill(m == -math.inf, 0.0)
        return out, safe + total.clamp_min(1e-30).log()  # about -69 where it must be -inf


class MisalignedCausal(Flash):
    def offset(self, lq: int, lk: int) -> int:
        return 0  # the mask is top-left while the skipped tiles are bottom-right's


class HidesDiagonal(Flash):
    def masked(self, s: Tensor, qs: int, ks: int, lq: int, lk: int, causal: bool) -> Tensor:
        if not causal:
            return s
        i = torch.arange(qs, qs + s.shape[-2])[:, None] + self.offset(lq, lk)
        j = torch.arange(ks, ks + s.shape[-1])[None, :]
        return s.masked_fill(j >= i, -math.inf)


class NoScaleInDq(Flash):
    def backward(self, saved: Saved, dout: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = super().backward(saved, dout, causal)
        return dq / self.scale(saved.q, saved.v), dk, dv  # dq = ds·K, the scale left out


class NoDeltaInBackward(Flash):
    def ds(self, p: Tensor, dp: Tensor, delta: Tensor) -> Tensor:
        return p * dp


class DenseBackward(Flash):
    """A tiled forward with a backward that recomputes the whole (Lq, Lk) p at once."""

    def backward(self, saved: Saved, dout: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = saved
        scale = self.scale(q, v)
        s = self.masked(q @ k.transpose(-2, -1) * scale, 0, 0, q.shape[-2], k.shape[-2], causal)
        p = torch.exp(s - lse.masked_fill(lse == -math.inf, math.inf)[..., None])
        ds = self.ds(p, dout @ v.transpose(-2, -1), (dout * out).sum(-1))
        return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


class NoCausalSkip(Flash):
    def key_starts(self, qs: int, rows: int, lq: int, lk: int, causal: bool) -> range:
        return range(0, lk, self.tile)  # every tile, masked


class LowPrecisionSoftmax(Flash):
    def upcast(self, t: Tensor) -> Tensor:
        return t  # scores, running max and sum in the inputs' dtype


class KeyTilesInAnyOrder(Flash):
    """Key tiles summed in an order that changes from call to call, as atomic adds sum them."""

    def key_starts(self, qs: int, rows: int, lq: int, lk: int, causal: bool) -> Sequence[int]:
        starts = list(super().key_starts(qs, rows, lq, lk, causal))
        return [starts[int(i)] for i in torch.randperm(len(starts))]


class RacyBackward(Flash):
    """A stand-in for a race: dq depends on which program happened to write first."""

    def backward(self, saved: Saved, dout: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = super().backward(saved, dout, causal)
        return dq + 1e-2 * torch.randn(dq.shape), dk, dv
