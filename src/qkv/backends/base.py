"""What every backend receives: one checked, canonical attention call.

``qkv.attention`` validates its arguments and canonicalises the mask and the causal rule once;
backends never check arguments again. Legend: B batch, H heads, L/Lq query length, S/Lk key
length, D features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv import _checks


class Unsupported(ValueError):
    """A backend cannot do this combination of arguments (the message says why and what to use)."""


@dataclass(frozen=True)
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
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for float16/bfloat16 (scores, softmax and sums), otherwise the input dtype."""
        return torch.float32 if self.q.dtype in (torch.float16, torch.bfloat16) else self.q.dtype
