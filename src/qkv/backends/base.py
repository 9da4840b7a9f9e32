"""What every backend receives: one checked, canonical attention call.

``qkv.attention`` validates its arguments and canonicalises the mask and the causal rule once;
backends never check arguments again. Legend: B batch, H heads, L/Lq query length, S/Lk key
length, D features.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkv import _checks, masks


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in for inputs of ``dtype``: float16 and bfloat16 are widened to
    float32 for the scores, softmax and sums (their 8- or 11-bit mantissas would round the
    exponentials' sum and overflow float16's range); every other dtype computes as itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def default_scale(head_dim: int) -> float:
    """1/√d_k: q·k sums d_k products, so its variance grows with d_k; dividing by √d_k keeps the
    scores' spread the same for every head size, and the softmax from saturating to one-hot."""
    return 1.0 / math.sqrt(head_dim)


class Unsupported(ValueError):
    """A backend cannot do this combination of arguments (the message says why and what to use)."""


@dataclass(frozen=True, slots=True)
class Rules:
    """A call's score rules beyond the mask and the causal offset (None: not used), built once
    per call by ``qkv.canonical`` and handed as they are to every backend and operator."""

    softcap: float | None = None  # scores s -> softcap · tanh(s / softcap), before the biases
    alibi_slopes: torch.Tensor | None = None  # (*batch, Hq): adds −slope · |i + Lk − Lq − j|
    window_offset: int | None = None  # query i may attend key j only if j >= i + window_offset
    segments: tuple[torch.Tensor, torch.Tensor] | None = None  # ids (*batch, Lq), (*batch, Lk)
    sinks: torch.Tensor | None = None  # (Hq,) one extra logit per head with a zero value
    # Your own rule (FlexAttention's signatures; ``qkv.mods``): score_mod(score, b, h, q_idx,
    # kv_idx) replaces the scaled score before softcap/ALiBi/mask; mask_mod(b, h, q_idx, kv_idx)
    # is True where the query may attend, and joins the other rules.
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    # A packed batch's rules as data (``qkv.varlen_attn`` on flash's kernel, which alone reads
    # them): (R, Lq, 3) int64 per query row of each of the R = prod(*batch) entries, the keys
    # [lo, hi) it may see and its ALiBi shift (distance i + shift − j); the causal and window
    # offsets are then None, and the ranges hold each sequence's own.
    key_ranges: torch.Tensor | None = None

    @property
    def structured(self) -> bool:
        """Whether keys are restricted by a window, segments or key ranges (beyond mask and
        causal)."""
        return (
            self.window_offset is not None
            or self.segments is not None
            or self.key_ranges is not None
        )

    @property
    def modified_scores(self) -> bool:
        """Whether scores are changed beyond ``q kᵀ · scale + mask`` (softcap or ALiBi)."""
        return self.softcap is not None or self.alibi_slopes is not None

    @property
    def mods(self) -> bool:
        """Whether there is a ``score_mod`` or a ``mask_mod``."""
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def empty(self) -> bool:
        """No rule at all."""
        return not (self.structured or self.modified_scores or self.sinks is not None or self.mods)


NO_RULES = Rules()


@dataclass(frozen=True, slots=True)  # slots: built once per call, on every decoding step
class Call:
    q: torch.Tensor  # (*batch, Hq, Lq, Dk)  -- at least 3 dims: a head dim is added if absent
    k: torch.Tensor  # (*batch, Hkv, Lk, Dk)
    v: torch.Tensor  # (*batch, Hkv, Lk, Dv)
    mask: torch.Tensor | None  # bool (True = may attend) or float (added); broadcastable to
    #                            (*batch, Hq, Lq, Lk) and never expanded
    causal_offset: int | None  # query i may attend key j iff j <= i + causal_offset
    scale: float
    dropout_p: float
    return_weights: bool
    rules: Rules = NO_RULES  # what real models add to the formula; see ``qkv.attention``
    return_lse: bool = False

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1: multi-head; Hq: multi-query)."""
        return self.q.shape[-3] // self.k.shape[-3] if self.k.shape[-3] else 1

    @property
    def scores_shape(self) -> tuple[int, ...]:
        """(*batch, Hq, Lq, Lk) after broadcasting."""
        batch = _checks.broadcast_shape(self.q.shape[:-3], self.k.shape[:-3], self.v.shape[:-3])
        assert batch is not None  # checked when the call was built
        return (*batch, self.q.shape[-3], self.q.shape[-2], self.k.shape[-2])

    @property
    def out_shape(self) -> tuple[int, ...]:
        """(*batch, Hq, Lq, Dv) after broadcasting."""
        return (*self.scores_shape[:-1], self.v.shape[-1])

    @property
    def needs_gradients(self) -> bool:
        """Whether autograd records this call (a backward pass may follow)."""
        return torch.is_grad_enabled() and (
            self.q.requires_grad
            or self.k.requires_grad
            or self.v.requires_grad
            or (self.mask is not None and self.mask.requires_grad)
            or (self.rules.sinks is not None and self.rules.sinks.requires_grad)
            or (self.rules.alibi_slopes is not None and self.rules.alibi_slopes.requires_grad)
        )

    @property
    def structured(self) -> bool:
        """Whether the call restricts keys by a window or segments (beyond mask and causal)."""
        return self.rules.structured

    @property
    def mods(self) -> bool:
        """Whether the call has a ``score_mod`` or a ``mask_mod``."""
        return self.rules.mods

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for float16/bfloat16 (scores, softmax and sums), otherwise the input dtype."""
        return compute_dtype(self.q.dtype)

    def may_attend(self, with_mask: bool = True) -> torch.Tensor | None:
        """Bool "may attend" over the whole call, broadcastable to (*batch, Hq, Lq, Lk): the
        mask (unless ``with_mask`` is False), the causal rule, the window and the segments
        together; None where every query may attend every key."""
        return masks.tile_keep(
            self.mask if with_mask else None,
            self.causal_offset,
            0,
            self.q.shape[-2],
            0,
            self.k.shape[-2],
            self.q.device,
            window_offset=self.rules.window_offset,
            segments=self.rules.segments,
        )


@dataclass(slots=True)
class CacheWrite:
    """A KV cache step still to be written: ``k_new`` (B, Hkv, L, Dk) and ``v_new`` (B, Hkv, L, Dv)
    go into the cache's buffers ``keys`` (B, Hkv, capacity, Dk) and ``values`` (B, Hkv,
    capacity, Dv) at positions ``start`` … ``start + L − 1``. The call it comes with reads the
    buffers' first ``start + L`` positions, so a backend writes first (``apply``) or fuses the
    write into its attention."""

    k_new: torch.Tensor
    v_new: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    start: int

    def apply(self) -> None:
        """Copy the new keys and values into the buffers."""
        added = self.k_new.shape[-2]
        self.keys.narrow(-2, self.start, added).copy_(self.k_new)
        self.values.narrow(-2, self.start, added).copy_(self.v_new)
