"""Small self-attention modules with one planted mistake each, for ``qkv check``'s tests.

``Attention`` is right: separate Q, K, V projections, heads split as (B, L, H, D) then
transposed, scores scaled by 1/√D, masked scores set to -inf with rows that have no key giving 0,
softmax over the keys, heads merged back, an output projection. Each subclass overrides one
small step with a mistake learners and kernels really make.
Legend: B batch, H heads, L length, E d_model, D head size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    """forward(x, mask=None, causal=False, return_weights=False); mask (B, L), True = real."""

    def __init__(self, d_model: int, n_heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.head_dim = n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, H, L, D)
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def merge(self, out: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B, L, E)
        batch, heads, length, size = out.shape
        return out.transpose(1, 2).reshape(batch, length, heads * size)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, L, L)

    def allowed(self, mask: torch.Tensor | None, causal: bool, length: int) -> torch.Tensor:
        allowed = torch.ones(length, length, dtype=torch.bool)
        if causal:
            allowed = torch.tril(allowed)
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]  # padded keys: columns
        return allowed

    def fill(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~allowed, float("-inf"))

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(scores, dim=-1)
        return torch.where(scores.isneginf().all(-1, keepdim=True), 0.0, weights)

    def drop(self, weights: torch.Tensor) -> torch.Tensor:
        return self.dropout(weights)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        q = self.split(self.q_proj(x))
        k = self.split(self.k_proj(x))
        v = self.split(self.v_proj(x))
        scores = self.fill(self.scores(q, k), self.allowed(mask, causal, x.shape[1]))
        weights = self.softmax(scores)
        out = self.out_proj(self.merge(self.drop(weights) @ v))
        return (out, weights) if return_weights else out


class WrongScale(Attention):
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        d_model = self.heads * self.head_dim
        return q @ k.transpose(-2, -1) / math.sqrt(d_model)


class NoScale(Attention):
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1)


class ScaleAfterSoftmax(Attention):
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return super().softmax(scores) / math.sqrt(self.head_dim)


class SoftmaxOverQueries(Attention):
    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-2)


class TinyMaskFill(Attention):
    def fill(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~allowed, 1e-20)


class PositiveMaskFill(Attention):
    def fill(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~allowed, 1e9)


class SplitWithoutTranspose(Attention):
    def split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, self.heads, length, self.head_dim)


class MergeWithoutTranspose(Attention):
    def merge(self, out: torch.Tensor) -> torch.Tensor:
        batch, heads, length, size = out.shape
        return out.reshape(batch, length, heads * size)


class CausalHidesDiagonal(Attention):
    def allowed(self, mask: torch.Tensor | None, causal: bool, length: int) -> torch.Tensor:
        allowed = super().allowed(mask, False, length)
        if causal:
            allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril(-1)
        return allowed


class CausalFlipped(Attention):
    def allowed(self, mask: torch.Tensor | None, causal: bool, length: int) -> torch.Tensor:
        allowed = super().allowed(mask, False, length)
        if causal:
            allowed = allowed & torch.ones(length, length, dtype=torch.bool).triu()
        return allowed


class DropoutInEval(Attention):
    def drop(self, weights: torch.Tensor) -> torch.Tensor:
        return F.dropout(weights, 0.1)  # training defaults to True: drops in eval mode too


class DropoutByDefault(Attention):
    """Dropout in eval mode at the constructor's default rate; built with dropout=0 (as qkv
    check builds a class) it never shows."""

    def __init__(self, d_model: int, n_heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__(d_model, n_heads, dropout)

    def drop(self, weights: torch.Tensor) -> torch.Tensor:
        return F.dropout(weights, p=self.dropout.p)  # nn.Dropout's rate, but not its mode


class NaNOnFullyPadded(Attention):
    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)


class BatchMixing(Attention):
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = super().scores(q, k)
        return scores - scores.mean(dim=0, keepdim=True)  # "centred" over the batch


class PaddingOverQueries(Attention):
    def allowed(self, mask: torch.Tensor | None, causal: bool, length: int) -> torch.Tensor:
        allowed = super().allowed(None, causal, length)
        if mask is not None:
            allowed = allowed & mask[:, None, :, None]  # padded queries: rows
        return allowed


class CrashOnEmpty(Attention):
    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        top = scores.max(dim=-1, keepdim=True).values  # no keys: nothing to take the max of
        shifted = (scores - top).exp()
        weights = shifted / shifted.sum(-1, keepdim=True)
        return torch.where(scores.isneginf().all(-1, keepdim=True), 0.0, weights)


class CausalIgnored(Attention):
    def allowed(self, mask: torch.Tensor | None, causal: bool, length: int) -> torch.Tensor:
        return super().allowed(mask, False, length)  # takes causal=..., never uses it
