"""How two outputs are compared: the largest difference, and the round-off allowed for it."""

from __future__ import annotations

import math

import torch

# Round-off between two computations of the same attention output, in units of the dtype's
# epsilon per unit of magnitude: summation order, a fused kernel or a float64 recomputation of
# float32 inputs stay far below it; every mistake qkv check names is far above it.
ROUND_OFF = 1000


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; inf when the shapes differ or a NaN appears in one only."""
    if a.shape != b.shape:
        return math.inf
    both_nan = a.isnan() & b.isnan()
    value = (a.double() - b.double()).masked_fill(both_nan, 0.0).abs()
    if value.numel() == 0:
        return 0.0
    found = float(value.max())
    return math.inf if math.isnan(found) else found


def tolerance(reference: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Round-off allowed between two computations of an output like ``reference`` in ``dtype``."""
    finite = reference[reference.isfinite()]
    magnitude = float(finite.abs().max()) if finite.numel() else 1.0
    return ROUND_OFF * torch.finfo(dtype).eps * (1.0 + magnitude)
