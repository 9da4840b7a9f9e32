"""The inputs a check feeds an implementation: x (B, L, E) for a module, q, k, v for a function.

Checks change them position by position (a later token, a padded key, another batch item) and
compare what comes out; ``Inputs`` does those changes the same way for both kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Inputs:
    """The positional arguments of one call; ``seq_dim`` is the dim of the positions."""

    tensors: tuple[torch.Tensor, ...]
    seq_dim: int

    @property
    def batch(self) -> int:
        return int(self.tensors[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.tensors[0].shape[self.seq_dim])

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def replaced(self, item: int, positions: Sequence[int], *, seed: int = 1) -> Inputs:
        """New random content at ``positions`` of batch item ``item``, everything else kept."""
        generator = torch.Generator().manual_seed(seed)
        changed = []
        for tensor in self.tensors:
            new = tensor.detach().clone()
            index = [slice(None)] * new.dim()
            index[0] = slice(item, item + 1)
            index[self.seq_dim] = list(positions)  # type: ignore[call-overload]
            shape = new[tuple(index)].shape
            new[tuple(index)] = torch.randn(shape, generator=generator).to(new.dtype)
            changed.append(new)
        return Inputs(tuple(changed), self.seq_dim)

    def item(self, index: int) -> Inputs:
        """Batch item ``index`` alone, still with a batch dim of 1."""
        return Inputs(tuple(t[index : index + 1] for t in self.tensors), self.seq_dim)

    def to(self, dtype: torch.dtype) -> Inputs:
        return Inputs(tuple(t.detach().to(dtype) for t in self.tensors), self.seq_dim)

    def with_grad(self) -> Inputs:
        return Inputs(
            tuple(t.detach().clone().requires_grad_() for t in self.tensors), self.seq_dim
        )
