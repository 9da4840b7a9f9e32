"""Your own attention rule: FlexAttention's ``score_mod`` and ``mask_mod``, as qkv takes them.

    score_mod(score, b, h, q_idx, kv_idx) -> new score     (score: the scaled q·k)
    mask_mod(b, h, q_idx, kv_idx) -> bool, True = may attend

torch's FlexAttention calls them once per score (under ``torch.vmap``). qkv calls them once per
block of scores with broadcast index tensors, so any elementwise torch arithmetic works as it
would on one score:

    score   (B, Hq, R, C)  the block's scaled scores, in the compute dtype (float32 for
                           float16/bfloat16 inputs); a floating result of another dtype
                           comes back in it
    b       (B, 1, 1, 1)   batch index (all batch dims flattened), int32
    h       (1, Hq, 1, 1)  query head index
    q_idx   (1, 1, R, 1)   query positions of the block
    kv_idx  (1, 1, 1, C)   key positions of the block

A result may be anything FlexAttention broadcasts: a 0-dim tensor, one value per query, per key,
per head or per batch entry. A mod written for one score at a time, which fails on a block
(``torch.dot`` of gathered rows), runs per score under ``torch.vmap`` (``resolve``,
``per_score``), as torch runs every mod; so does every mod inside torch.compile, where the dense
evaluation below is what a traced call runs. A score_mod that sets a pair to −inf blocks it
(``kept``): a row it empties gives 0, as a masked one.

This module is the one place that builds those index tensors, checks what a mod returns (shape,
dtype, elementwise), and finds the tensors a mod captures that need gradients. The dense
evaluation (``dense_scores``, ``dense_keep``) is what the reference backend runs; flash runs the
same per tile (``qkv.backends.flash.mods``). Legend: B batch (flattened), Hq query heads, Lq/Lk
lengths, R/C rows and columns of a block.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from qkv import _checks, _tracing

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]
Indices = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_mod(name: str, mod: Any, arity: int) -> Any:
    """A mod argument: None or a callable of ``arity`` positional arguments (TypeError)."""
    if mod is None:
        return None
    if not callable(mod):
        raise TypeError(f"{name} must be a callable or None, got {type(mod).__name__}")
    if torch.compiler.is_compiling():  # (a tracer does not follow inspect; eager calls check)
        return mod
    try:
        inspect.signature(mod).bind(*range(arity))
    except TypeError:
        signature = "(score, b, h, q_idx, kv_idx)" if arity == 5 else "(b, h, q_idx, kv_idx)"
        raise TypeError(
            f"{name} must take {arity} positional arguments {signature}, got a callable with "
            f"signature {inspect.signature(mod)}"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return mod


def indices(
    batch: int, heads: int, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> Indices:
    """b (B, 1, 1, 1), h (1, Hq, 1, 1), q_idx (1, 1, q1−q0, 1), kv_idx (1, 1, 1, k1−k0), int32."""

    def positions(start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, dtype=torch.int32, device=device)

    return (
        positions(0, batch).view(batch, 1, 1, 1),
        positions(0, heads).view(1, heads, 1, 1),
        positions(q0, q1).view(1, 1, q1 - q0, 1),
        positions(k0, k1).view(1, 1, 1, k1 - k0),
    )


def checked(name: str, result: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A mod's result for a block of ``shape``, as FlexAttention takes it: a tensor that
    broadcasts to ``shape`` without growing it (a 0-dim tensor, one value per query, per key, per
    head or per batch entry included). A mask_mod's is bool; a score_mod's is floating and comes
    back in ``dtype`` (as torch writes a score_mod's result into its scores). TypeError or
    ValueError naming the mod otherwise."""
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"{name} must return a tensor (as FlexAttention's do), got {type(result).__name__}; "
            f"build constants from the arguments, e.g. b.new_ones((), dtype=torch.bool)"
        )
    if dtype == torch.bool and result.dtype != torch.bool:
        raise TypeError(f"{name} must return bool (True = may attend), got {result.dtype}")
    if dtype != torch.bool and not result.is_floating_point():
        raise TypeError(
            f"{name} must return a floating tensor (the new score, computed in {dtype}), got "
            f"{result.dtype}; convert it with .to(score.dtype)"
        )
    grown = _checks.broadcast_shape(result.shape, shape) if result.dim() <= len(shape) else None
    if grown != tuple(shape):
        raise ValueError(
            f"{name} must return one value per score: a tensor broadcastable to the block's "
            f"{tuple(shape)} (b, h, q_idx, kv_idx broadcast against each other), got "
            f"{tuple(result.shape)}; use elementwise arithmetic on its arguments"
        )
    return result if result.dtype == dtype else result.to(dtype)


def resolve(name: str, mod: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> Any:
    """``mod`` as qkv evaluates it, decided on one block's ``args`` (index tensors last four):
    itself, run on whole blocks with broadcast indices; or, for a mod written for one score at
    a time that fails on a block (``torch.dot`` of gathered rows, a gathered row indexed by
    position), ``per_score(mod)``: the way torch's FlexAttention evaluates every mod. A block
    result of the wrong shape or dtype is an error (``checked``), and so is a failure both ways
    (the block evaluation's error)."""
    shape = _checks.broadcast_shape(*(a.shape for a in args)) or ()
    try:
        result = mod(*args)
    except (RuntimeError, IndexError, ValueError) as error:
        scalar = per_score(mod)
        try:
            checked(name, scalar(*args), shape, dtype)
        except Exception:
            raise error from None
        return scalar
    checked(name, result, shape, dtype)
    return mod


def per_score(mod: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``mod`` evaluated one score at a time under ``torch.vmap`` over b, h, q_idx and kv_idx
    (a score_mod's score mapped along with them), as torch's FlexAttention does: every
    function of one score is elementwise by construction. Returns (B, Hq, R, C)."""

    def run(*args: torch.Tensor) -> torch.Tensor:
        *score, b, h, q_idx, kv_idx = args
        axes = (b.reshape(-1), h.reshape(-1), q_idx.reshape(-1), kv_idx.reshape(-1))
        full = tuple(a.numel() for a in axes)
        lead = tuple(s.expand(full) for s in score)
        fn: Callable[..., Any] = mod
        for mapped in reversed(range(4)):  # the innermost vmap maps kv_idx
            dims = tuple(0 if i == mapped else None for i in range(4))
            fn = torch.vmap(fn, in_dims=(0,) * len(lead) + dims)
        result: torch.Tensor = fn(*lead, *axes)
        return result

    run.qkv_per_score = True  # type: ignore[attr-defined]
    return run


def check_elementwise(name: str, mod: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """ValueError if ``mod`` reads other scores (or positions) than its own: a block evaluated
    whole must equal its halves evaluated apart, split by rows and by columns. A reduction over
    scores (a max, a softmax, a cumsum, a flip) changes when it sees half of them; elementwise
    arithmetic does not. ``args``: the block's arguments, index tensors last four."""
    whole = mod(*args)
    if not isinstance(whole, torch.Tensor):
        return  # (checked() says what is wrong)
    for dim in (-2, -1):
        size = max((a.shape[dim] for a in args if a.dim() >= 2), default=1)
        if size < 2:
            continue
        half = size // 2
        for start, stop in ((0, half), (half, size)):
            part = [_narrow(a, dim, start, stop) for a in args]
            full = _checks.broadcast_shape(*(a.shape for a in args))
            expected = _narrow(whole.expand(full or whole.shape), dim, start, stop)
            got = mod(*part)
            if not isinstance(got, torch.Tensor) or not same(got, expected):
                raise ValueError(
                    f"{name} is not elementwise: its value for a score depends on other scores "
                    f"or positions (a block evaluated whole differs from its halves evaluated "
                    f"apart along dim {dim}); FlexAttention's mods see one score at a time, so "
                    f"use only elementwise arithmetic and indexing by b, h, q_idx, kv_idx"
                )


def _narrow(x: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    if x.dim() < -dim or x.shape[dim] == 1:
        return x
    return x.narrow(dim, start, stop - start).contiguous()


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to a few units in the last place (vectorised and scalar paths may round apart)."""
    if got.shape != expected.shape:  # one value per score, or broadcast to them
        if _checks.broadcast_shape(got.shape, expected.shape) != tuple(expected.shape):
            return False
        got = got.expand_as(expected)
    if got.dtype == torch.bool:
        return bool(torch.equal(got, expected))
    tol = 8 * torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    return bool(torch.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True))


# --- tensors a mod captures ----------------------------------------------------------------------


def captured_tensors(mod: Any, every: bool = False) -> list[torch.Tensor]:
    """The tensors that require gradients which ``mod`` reads through its closure, its globals,
    a ``functools.partial``'s arguments, a bound method's object or a module's parameters
    (followed into nested functions), in a fixed order, each once. These become explicit inputs
    of flash's autograd function, so that gradients reach them (a learned bias table, learned
    ALiBi slopes). ``every``: all tensors it reads, also those without gradients."""
    found: dict[int, torch.Tensor] = {}
    _collect(mod, found, set(), 0, every)
    return list(found.values())


def _collect(
    obj: Any, found: dict[int, torch.Tensor], seen: set[int], depth: int, every: bool
) -> None:
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad or every:
            found.setdefault(id(obj), obj)
    elif isinstance(obj, torch.nn.Module):
        for parameter in obj.parameters():
            _collect(parameter, found, seen, depth + 1, every)
    elif isinstance(obj, functools.partial):
        for value in (obj.func, *obj.args, *obj.keywords.values()):
            _collect(value, found, seen, depth + 1, every)
    elif inspect.ismethod(obj):
        _collect(obj.__self__, found, seen, depth + 1, every)
        _collect(obj.__func__, found, seen, depth + 1, every)
    elif inspect.isfunction(obj):
        for cell in obj.__closure__ or ():
            try:
                _collect(cell.cell_contents, found, seen, depth + 1, every)
            except ValueError:  # an empty cell
                continue
        names = _global_names(obj.__code__)
        for name in names:
            if name in obj.__globals__:
                _collect(obj.__globals__[name], found, seen, depth + 1, every)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, found, seen, depth + 1, every)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, found, seen, depth + 1, every)
    elif callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
        _collect(vars(obj), found, seen, depth + 1, every)  # a callable object's attributes


def _global_names(code: Any) -> list[str]:
    """Global names a code object (and the functions defined in it) reads."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names.extend(_global_names(constant))
    return names


# --- the dense evaluation (the reference backend) -------------------------------------------------


def dense_scores(
    score_mod: Callable[..., Any], scores: torch.Tensor, batch: tuple[int, ...]
) -> torch.Tensor:
    """``score_mod`` applied to every score of (*batch, Hq, Lq, Lk) scaled ``scores``."""
    flat = scores.reshape(math.prod(batch), *scores.shape[-3:])  # (B, Hq, Lq, Lk)
    b, hq, lq, lk = flat.shape
    args = (flat, *indices(b, hq, 0, lq, 0, lk, scores.device))
    if _tracing.traced(scores):  # a tracer follows torch.vmap, not a failed block evaluation
        score_mod = per_score(score_mod)
    else:
        score_mod = resolve("score_mod", score_mod, corner(args), flat.dtype)
    result = checked("score_mod", score_mod(*args), tuple(flat.shape), flat.dtype)
    if not _tracing.traced(scores) and not hasattr(score_mod, "qkv_per_score"):
        with torch.no_grad():  # as flash does: the same refusals on every backend
            check_elementwise("score_mod", score_mod, corner(args))
    return result.expand(flat.shape).reshape(scores.shape)


def corner(args: tuple[torch.Tensor, ...], rows: int = 32, cols: int = 64) -> tuple[Any, ...]:
    """A score_mod's arguments (score, b, h, q_idx, kv_idx) cut to a block's first ``rows``
    queries and ``cols`` keys: enough for ``check_elementwise`` to tell, and cheap."""
    score, b, h, q_idx, kv_idx = args
    rows, cols = min(rows, score.shape[-2]), min(cols, score.shape[-1])
    return (score[..., :rows, :cols].detach(), b, h, q_idx[..., :rows, :], kv_idx[..., :cols])


def kept(scores: torch.Tensor) -> torch.Tensor:
    """Bool like ``scores``: the pairs a score_mod left open (it blocks a pair by setting its
    score to −inf; a row it blocks whole gives 0 output, −inf lse and 0 gradient, as a mask)."""
    return scores != float("-inf")


def dense_keep(
    mask_mod: Callable[..., Any], shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """``mask_mod`` over (*batch, Hq, Lq, Lk) ``shape``: bool, broadcastable to it."""
    *batch, hq, lq, lk = shape
    b = math.prod(batch)
    if torch.compiler.is_compiling() or device.type == "meta":
        mask_mod = mask_mod if hasattr(mask_mod, "qkv_occupancy") else per_score(mask_mod)
    else:
        corner_args = indices(b, hq, 0, min(lq, 32), 0, min(lk, 64), device)
        mask_mod = resolve("mask_mod", mask_mod, corner_args, torch.bool)
    keep = mask_mod(*indices(b, hq, 0, lq, 0, lk, device))
    keep = checked("mask_mod", keep, (b, hq, lq, lk), torch.bool)
    return keep.expand(b, hq, lq, lk).reshape(shape)
