"""``KVCache``: the keys and values one attention layer has seen, for decoding step by step.

Decoding writes each step's keys and values after the cached ones and attends to all of them
(``qkv.attention_with_cache``). Storage is pre-allocated and doubles when full, so decoding n
tokens copies O(n) elements in all, not O(n²). A step happens in two moves so that a rejected
call leaves the cache as it was: ``prepare`` makes room and returns the step (the keys and values
the call will read, and what still has to be written there), ``commit`` counts it once the call
has run. ``append`` does both at once. When the new keys or values need gradients, the cache
concatenates instead of writing into a buffer, so that autograd sees every step.

Legend: B batch, Hkv key/value heads, L new positions, S cached positions, D features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkv import _checks
from qkv.backends.base import CacheWrite


@dataclass(slots=True)
class CacheStep:
    """One step prepared by ``KVCache.prepare``: ``keys`` (B, Hkv, S + L, Dk) and ``values``
    (B, Hkv, S + L, Dv) are what the step attends to. ``write`` is the copy of the new keys and
    values into them still to be made (None: they are already there, concatenated)."""

    keys: torch.Tensor
    values: torch.Tensor
    write: CacheWrite | None


class KVCache:
    """The keys (B, Hkv, S, Dk) and values (B, Hkv, S, Dv) one attention layer has seen.

    ``len(cache)`` is S, the number of cached positions; ``cache.keys`` and ``cache.values``
    are views of them; ``cache.reset()`` empties it.
    """

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None  # (B, Hkv, capacity, Dk)
        self._values: torch.Tensor | None = None  # (B, Hkv, capacity, Dv)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        shape = None if self._keys is None else _checks.shape_str(self.keys.shape)
        return f"KVCache(len={self._length}, keys={shape})"

    def reset(self) -> None:
        """Forget everything cached."""
        self._keys = self._values = None
        self._length = 0

    @property
    def keys(self) -> torch.Tensor:
        """(B, Hkv, S, Dk) cached keys."""
        if self._keys is None:
            raise ValueError("cache is empty: no keys have been appended")
        return self._keys[..., : self._length, :]

    @property
    def values(self) -> torch.Tensor:
        """(B, Hkv, S, Dv) cached values."""
        if self._values is None:
            raise ValueError("cache is empty: no values have been appended")
        return self._values[..., : self._length, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys k (B, Hkv, L, Dk) and values v (B, Hkv, L, Dv); return all cached ones."""
        step = self.prepare(k, v)
        if step.write is not None:
            step.write.apply()
        self.commit(step)
        return step.keys, step.values

    def prepare(self, k: torch.Tensor, v: torch.Tensor) -> CacheStep:
        """Check k (B, Hkv, L, Dk) and v (B, Hkv, L, Dv) against the cache and make room for
        them; ``len(self)`` is unchanged until ``commit(step)``. The buffers grow (doubling)
        when full; an empty cache takes its shape, dtype and device from k and v."""
        if not self._continues(k, v):
            self._check(k, v)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if self._keys is None or self._values is None or self._length == 0:
                return CacheStep(k, v, None)
            keys = torch.cat([self.keys, k], dim=-2)
            return CacheStep(keys, torch.cat([self.values, v], dim=-2), None)
        start, added = self._length, k.shape[-2]
        self._keys = _grown(self._keys, start, added, k)
        self._values = _grown(self._values, start, added, v)
        write = CacheWrite(k, v, self._keys, self._values, start)
        end = start + added
        return CacheStep(self._keys.narrow(-2, 0, end), self._values.narrow(-2, 0, end), write)

    def commit(self, step: CacheStep) -> None:
        """Count a prepared step's positions as cached (after its write has been made)."""
        if step.write is None:  # concatenated: the step's tensors are the cache from now on
            self._keys, self._values = step.keys, step.values
            self._length = step.keys.shape[-2]
        else:
            self._length = step.write.start + step.write.k_new.shape[-2]

    def _continues(self, k: Any, v: Any) -> bool:
        """Whether k and v plainly continue what is cached (the common step): tensors with the
        cache's (B, Hkv, ·, D), dtype and device, agreeing in length. ``_check`` says what is
        wrong with anything else, or lets a first call through."""
        keys, values = self._keys, self._values
        return (
            keys is not None
            and values is not None
            and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and k.dtype == keys.dtype == v.dtype
            and k.device == keys.device == v.device
            and k.dim() == 4
            and v.dim() == 4
            and k.shape[:2] == keys.shape[:2] == v.shape[:2]
            and k.shape[2] == v.shape[2]
            and k.shape[3] == keys.shape[3]
            and v.shape[3] == values.shape[3]
        )

    def _check(self, k: Any, v: Any) -> None:
        """k and v: (B, Hkv, L, D) floating tensors that agree, and match the cache if any."""
        _checks.tensor("k", k, ndims=(4,))
        _checks.tensor("v", v, ndims=(4,))
        _checks.floating("k", k)
        _checks.same_dtype(("k", "v"), (k, v))
        _checks.same_device(("k", "v"), (k, v))
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(
                f"k and v must agree in (B, Hkv, L), got k {_checks.shape_str(k.shape)} and v "
                f"{_checks.shape_str(v.shape)}"
            )
        if self._keys is None or self._values is None:
            return
        for name, new, old in (("k", k, self._keys), ("v", v, self._values)):
            if new.shape[:2] != old.shape[:2] or new.shape[-1] != old.shape[-1]:
                raise ValueError(
                    f"{name} of shape {_checks.shape_str(new.shape)} does not match the cache "
                    f"(B, Hkv, ·, D) = "
                    f"{_checks.shape_str((*old.shape[:2], self._length, old.shape[-1]))}"
                )
            if new.dtype != old.dtype or new.device != old.device:
                raise TypeError(
                    f"{name} must have the cache's dtype {old.dtype} on {old.device}, got "
                    f"{new.dtype} on {new.device}"
                )


def _grown(
    buffer: torch.Tensor | None, length: int, added: int, like: torch.Tensor
) -> torch.Tensor:
    """``buffer`` if it has room for ``added`` positions after ``length``, else a copy with
    double the room (geometric growth keeps appending amortised O(1) per position), shaped
    (*like's dims but -2, capacity, like's last dim) in like's dtype and device."""
    needed = length + added
    if buffer is not None and buffer.shape[-2] >= needed:
        return buffer
    capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[-2]), 16)
    grown = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
    if buffer is not None:
        grown[..., :length, :] = buffer[..., :length, :]
    return grown
