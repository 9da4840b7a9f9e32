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


def positive_float(name: str, value: Any) -> float:
    """A finite real number > 0."""
    number = finite_float(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {number}")
    return number


def head_values(
    name: str, x: Any, q: torch.Tensor, target: Sequence[int], expected: str
) -> torch.Tensor:
    """A floating tensor of per-head values (last dim Hq) on q's device that broadcasts to
    ``target`` = (*batch, Hq)."""
    tensor(name, x, min_ndim=1)
    floating(name, x)
    if x.shape[-1] != target[-1]:
        raise ValueError(
            f"{name} must have one value per query head, shape {expected} with Hq = "
            f"{target[-1]}, got {shape_str(x.shape)}"
        )
    broadcastable(name, x.shape, target, expected)
    same_device(("q", name), (q, x))
    checked: torch.Tensor = x
    return checked


def window(name: str, value: Any, causal: Any) -> int | tuple[int | None, int | None]:
    """A local window: a positive int w (the w most recent keys; needs a causal rule aligned
    bottom-right) or a (left, right) pair of ints >= 0 or None (unbounded)."""
    if isinstance(value, int) and not isinstance(value, bool):
        positive_int(name, value)
        if causal not in (True, "bottom-right"):
            raise ValueError(
                f"{name}={value} (the {value} most recent keys) needs causal=True, got "
                f"causal={causal!r}; pass window=(left, right) for a window that is not causal"
            )
        return value
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(
            f"{name} must be an int or a (left, right) tuple of ints or None, got {value!r}"
        )
    for side, bound in zip(("left", "right"), value):
        if bound is not None:
            non_negative_int(f"{name}[{side}]", bound)
    left, right = value
    return left, right


def segments(
    name: str, value: Any, q: torch.Tensor, batch: Sequence[int], lq: int, lk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids: one integer tensor (*batch, Lk) (queries take its last Lq ids, the alignment
    of a KV cache) or a (query ids (*batch, Lq), key ids (*batch, Lk)) pair."""
    pair = isinstance(value, tuple)
    if pair and len(value) != 2:
        raise TypeError(f"{name} must be a tensor or a (query ids, key ids) pair, got {value!r}")
    ids = value if pair else (value, value)
    for part, x, length in zip(("query ids", "key ids"), ids, (lq, lk)):
        label = f"{name} ({part})" if pair else name
        tensor(label, x, min_ndim=1)
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{label} must be an integer tensor of segment ids, got {x.dtype}")
        expected = length if pair else lk
        if x.shape[-1] != expected:
            raise ValueError(
                f"{label} must have length {'Lq' if pair and part == 'query ids' else 'Lk'} = "
                f"{expected} in its last dim, got shape {shape_str(x.shape)}"
            )
        broadcastable(label, x.shape[:-1], batch, "the batch dims (*batch)")
        same_device(("q", label), (q, x))
    if not pair and lq > lk:
        raise ValueError(
            f"{name} as one tensor of Lk ids gives the queries its last Lq ids, which needs "
            f"Lq <= Lk, got Lq = {lq} and Lk = {lk}; pass (query ids, key ids)"
        )
    query_ids, key_ids = ids
    return (query_ids if pair else query_ids[..., lk - lq :]), key_ids
