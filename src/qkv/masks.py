"""Masks: the public helpers, and the one conversion of mask + causal into what backends use.

**The convention: True (or 1) means "may attend".** A bool mask keeps the positions that are True;
a float mask is added to the scaled scores (``-inf`` blocks). ``causal`` is turned into an integer
offset: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

Legend: B batch, H heads, L / Lq query length, S / Lk key length, D features.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv import _checks

ALIGNMENTS = ("bottom-right", "top-left")
CAUSAL_VALUES = (False, True, "bottom-right", "top-left")


def causal_offset(causal: Any, lq: int, lk: int) -> int | None:
    """The diagonal offset of a causal rule, or None when ``causal`` is False.

    ``"bottom-right"`` (also ``True``) aligns the last query with the last key, which is what a
    KV cache needs: the Lq new queries are the last Lq positions of the Lk keys. ``"top-left"``
    aligns the first query with the first key (torch's ``is_causal``).
    """
    _checks.choice("causal", causal, CAUSAL_VALUES)
    if causal is False:
        return None
    return 0 if causal == "top-left" else lk - lq


def _lengths(lq: Any, lk: Any) -> tuple[int, int]:
    lq = _checks.non_negative_int("Lq", lq)
    lk = lq if lk is None else _checks.non_negative_int("Lk", lk)
    return lq, lk


def causal_mask(
    Lq: int,
    Lk: int | None = None,
    *,
    align: str = "bottom-right",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(Lq, Lk) bool, True where query i may attend key j: j <= i (+ Lk - Lq if bottom-right)."""
    lq, lk = _lengths(Lq, Lk)
    _checks.choice("align", align, ALIGNMENTS)
    offset = causal_offset(align, lq, lk)
    assert offset is not None
    return _diagonal_keep(offset, 0, lq, 0, lk, device)


def sliding_window_mask(
    Lq: int,
    Lk: int | None = None,
    *,
    window: int,
    align: str = "bottom-right",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(Lq, Lk) bool: causal, and each query sees at most the ``window`` most recent keys
    (itself included): ``i + offset - window < j <= i + offset``."""
    window = _checks.positive_int("window", window)
    keep = causal_mask(Lq, Lk, align=align, device=device)
    lq, lk = keep.shape
    offset = causal_offset(align, lq, lk)
    assert offset is not None
    too_old = _diagonal_keep(offset - window, 0, lq, 0, lk, device)
    return keep & ~too_old


def padding_mask(x: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """(B, 1, 1, L) bool key mask, True at real tokens.

    ``x`` is either a (B, L) bool or 0/1 tensor (True/1 = real token, the Hugging Face
    ``attention_mask`` convention) or a (B,) integer tensor of lengths, with ``length`` = L.
    The result broadcasts against scores of shape (B, H, Lq, L).
    """
    _checks.tensor("x", x, ndims=(1, 2))
    if x.dim() == 2:
        if length is not None:
            raise ValueError(
                f"length must be None when x is a (B, L) mask, got length={length} "
                f"for x of shape {_checks.shape_str(x.shape)}"
            )
        if x.dtype == torch.bool:
            keep = x
        elif x.dtype.is_complex:
            raise TypeError(f"x must be bool or 0/1 integer/float, got {x.dtype}")
        else:
            if not bool(((x == 0) | (x == 1)).all()):
                raise ValueError("x must contain only 0 and 1 when given as a (B, L) mask")
            keep = x != 0
        return keep[:, None, None, :]
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"x must be an integer tensor of lengths when 1-D, got {x.dtype}")
    if length is None:
        raise ValueError("length must be given when x is a (B,) tensor of lengths, got None")
    length = _checks.non_negative_int("length", length)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > length):
        raise ValueError(
            f"x lengths must lie in [0, length] = [0, {length}] (length={length} is the padded "
            f"length L), got min {int(x.min())}, max {int(x.max())}; pass length >= "
            f"{int(x.max())}"
        )
    positions = torch.arange(length, device=x.device)
    return (positions[None, :] < x[:, None])[:, None, None, :]


def combine(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    """Both masks at once: a key must pass both. Bool and float masks mix: the result is float
    (0 where allowed, -inf where a bool mask blocks) when either is float."""
    if first is None or second is None:
        return first if second is None else second
    if first.dtype == torch.bool and second.dtype == torch.bool:
        return first & second
    dtype = first.dtype if first.is_floating_point() else second.dtype
    return as_additive(first, dtype) + as_additive(second, dtype)


def as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask to add to scores: bool True -> 0, False -> -inf; floats are kept."""
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, float("-inf"))
    return mask.to(dtype)


# --- what backends use ------------------------------------------------------------------------


def _diagonal_keep(
    offset: int, q0: int, q1: int, k0: int, k1: int, device: torch.device | str | None
) -> torch.Tensor:
    """(q1-q0, k1-k0) bool: key j may be attended by query i iff j <= i + offset."""
    rows = torch.arange(q0, q1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    return cols <= rows + offset


def _tile(mask: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Rows q0:q1 and columns k0:k1 of a mask whose last two dims may be broadcast (size 1)."""
    if mask.shape[-2] != 1:
        mask = mask[..., q0:q1, :]
    if mask.shape[-1] != 1:
        mask = mask[..., k0:k1]
    return mask


def tile_keep(
    mask: torch.Tensor | None,
    offset: int | None,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Bool "may attend" for queries q0:q1 against keys k0:k1, broadcastable to
    (*batch, H, q1-q0, k1-k0); None when every pair may attend.

    A pair may attend when the bool mask is True (or the float mask is not -inf) and the causal
    rule allows it. This is the single place where masks and causality meet.
    """
    keep = None
    if mask is not None:
        part = _tile(mask, q0, q1, k0, k1)
        keep = part if part.dtype == torch.bool else part != float("-inf")
    if offset is not None:
        causal = _diagonal_keep(offset, q0, q1, k0, k1, device)
        keep = causal if keep is None else keep & causal
    return keep


def tile_bias(mask: torch.Tensor | None, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
    """The float mask's values to add to scores of queries q0:q1 and keys k0:k1 (None if bool)."""
    if mask is None or mask.dtype == torch.bool:
        return None
    return _tile(mask, q0, q1, k0, k1)
