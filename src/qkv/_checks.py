"""Argument checks shared by every public entry point.

Each check raises a ``TypeError`` (wrong kind of object or dtype) or a ``ValueError`` (wrong shape
or value) whose message names the argument and gives what was expected and what was received.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def tensor(
    name: str, x: Any, *, min_ndim: int = 0, ndims: Sequence[int] | None = None
) -> torch.Tensor:
    """``x`` must be a tensor of rank >= ``min_ndim`` (or one of ``ndims``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndims is not None and x.dim() not in ndims:
        expected = " or ".join(str(n) for n in ndims)
        raise ValueError(
            f"{name} must have {expected} dimensions, got {x.dim()} (shape {shape_str(x.shape)})"
        )
    if x.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got {x.dim()} "
            f"(shape {shape_str(x.shape)})"
        )
    return x


def floating(name: str, x: torch.Tensor) -> None:
    """``x`` must hold real floating-point numbers (no ints, bools or complex)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got {x.dtype}"
        )


def same_dtype(names: Sequence[str], xs: Sequence[torch.Tensor]) -> None:
    if len({x.dtype for x in xs}) > 1:
        got = ", ".join(f"{n}={x.dtype}" for n, x in zip(names, xs))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {got}")


def same_device(names: Sequence[str], xs: Sequence[torch.Tensor]) -> None:
    if len({x.device for x in xs}) > 1:
        got = ", ".join(f"{n} on {x.device}" for n, x in zip(names, xs))
        raise ValueError(f"{', '.join(names)} must be on one device, got {got}")


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def probability(name: str, value: Any) -> float:
    """A dropout probability: a real number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def finite_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def choice(name: str, value: Any, options: Sequence[Any]) -> Any:
    """``value`` must be one of ``options`` and of the same type (1 is not True)."""
    for option in options:
        if value is option or (type(value) is type(option) and value == option):
            return value
    expected = ", ".join(repr(o) for o in options)
    raise ValueError(f"{name} must be one of {expected}, got {value!r}")


def mask(name: str, x: Any, target: Sequence[int], target_desc: str) -> torch.Tensor:
    """An attention mask: bool (True = may attend) or floating (added to the scores) that
    broadcasts to ``target``."""
    tensor(name, x)
    if x.dtype != torch.bool and not x.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = may attend) or floating (added to scores), got "
            f"{x.dtype}; convert 0/1 masks with {name}.bool()"
        )
    broadcastable(name, x.shape, target, target_desc)
    checked: torch.Tensor = x
    return checked


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to by torch's rules, or None if they do not broadcast.

    Plain Python on tuples: it runs on every attention call, where ``torch.broadcast_shapes``
    costs more than a whole decoding step's attention."""
    first = tuple(shapes[0])
    if all(tuple(shape) == first for shape in shapes[1:]):
        return first
    ndim = max(len(shape) for shape in shapes)
    result = []
    for dim in range(-ndim, 0):
        sizes = {shape[dim] for shape in shapes if len(shape) >= -dim} - {1}
        if len(sizes) > 1:
            return None
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def broadcastable(name: str, shape: Sequence[int], target: Sequence[int], target_desc: str) -> None:
    """``shape`` must broadcast to ``target`` (torch rules, without growing ``target``)."""
    ok = len(shape) <= len(target) and all(
        s == t or s == 1 for s, t in zip(reversed(shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape_str(shape)} is not broadcastable to {target_desc} "
            f"= {shape_str(target)}"
        )
