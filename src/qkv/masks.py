"""Masks: the public helpers, and the one conversion of mask + causal into what backends use.

**The convention: True (or 1) means "may attend".** A bool mask keeps the positions that are True;
a float mask is added to the scaled scores (``-inf`` blocks). ``causal`` is turned into an integer
offset: query ``i`` may attend key ``j`` iff ``j <= i + offset``. A ``window`` becomes two such
diagonals (its right edge joins the causal offset, its left edge is the window offset), and
``segments`` (document ids, with the ``cu_seqlens`` converters) block keys of other documents;
``tile_keep`` turns all of them into one tile's bool "may attend", and ALiBi's bias is computed
per tile too (``alibi_bias``), so that flash never forms an (Lq, Lk) tensor.

Legend: B batch, H heads, L / Lq query length, S / Lk key length, D features.
"""

from __future__ import annotations

import math
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


def binding_offset(causal: Any, lq: int, lk: int) -> int | None:
    """``causal_offset``, or None where the rule blocks no key (every query may attend every key,
    e.g. one new token against a KV cache): backends run fastest without a rule."""
    offset = causal_offset(causal, lq, lk)
    return None if offset is not None and offset >= lk - 1 else offset


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


def window_bounds(window: Any) -> tuple[int | None, int | None]:
    """(left, right) of a checked ``window``: an int w is (w − 1, 0), the w most recent keys."""
    if window is None:
        return None, None
    if isinstance(window, int):
        return window - 1, 0
    left, right = window
    return left, right


def window_offsets(window: Any, lq: int, lk: int) -> tuple[int | None, int | None]:
    """(upper, lower) diagonal offsets of a window, bottom-right aligned: query i may attend key j
    iff i' − left <= j <= i' + right with i' = i + Lk − Lq, i.e. i + lower <= j <= i + upper
    (None: that side is unbounded)."""
    left, right = window_bounds(window)
    shift = lk - lq
    return (
        None if right is None else shift + right,
        None if left is None else shift - left,
    )


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """(L,) int64 segment ids from cumulative sequence lengths (FlashAttention's ``cu_seqlens``,
    Hugging Face's ``cu_seq_lens``): ``cu_seqlens = [0, 3, 5]`` gives ``[0, 0, 0, 1, 1]``.

    ``length`` (default ``cu_seqlens[-1]``) pads the ids to L; positions past the last sequence
    get id −1, a segment of padding tokens that attend only to each other."""
    _checks.tensor("cu_seqlens", cu_seqlens, ndims=(1,))
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype in (torch.bool, torch.complex64):
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.to(torch.long)
    if bounds.numel() == 0 or int(bounds[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0 and never decrease, got {bounds.tolist()[:8]}"
        )
    total = int(bounds[-1])
    length = total if length is None else _checks.non_negative_int("length", length)
    if length < total:
        raise ValueError(f"length must be >= cu_seqlens[-1] = {total}, got {length}")
    positions = torch.arange(length, device=bounds.device)
    ids = torch.searchsorted(bounds[1:], positions, right=True)  # sequences ending at or before
    return torch.where(positions < total, ids, -1)


def cu_seqlens_from_segments(segments: torch.Tensor) -> torch.Tensor:
    """(n + 1,) int32 cumulative lengths of the runs of equal ids in a (L,) tensor of segment ids
    (``segments_from_cu_seqlens``'s inverse for ids without padding): ``[0, 0, 0, 1, 1]`` gives
    ``[0, 3, 5]``."""
    _checks.tensor("segments", segments, ndims=(1,))
    if segments.is_floating_point() or segments.dtype == torch.bool:
        raise TypeError(f"segments must be an integer tensor, got {segments.dtype}")
    _, lengths = torch.unique_consecutive(segments, return_counts=True)
    zero = torch.zeros(1, dtype=torch.long, device=segments.device)
    return torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)


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
    *,
    window_offset: int | None = None,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Bool "may attend" for queries q0:q1 against keys k0:k1, broadcastable to
    (*batch, H, q1-q0, k1-k0); None when every pair may attend.

    A pair may attend when the bool mask is True (or the float mask is not -inf), the causal rule
    and a window's right edge allow it (j <= i + offset), a window's left edge does
    (j >= i + window_offset), and query and key lie in the same segment. This is the single place
    where masks, causality, windows and segments meet.
    """
    keep = None
    if mask is not None:
        part = _tile(mask, q0, q1, k0, k1)
        keep = part if part.dtype == torch.bool else part != float("-inf")
    if offset is not None:
        causal = _diagonal_keep(offset, q0, q1, k0, k1, device)
        keep = causal if keep is None else keep & causal
    if window_offset is not None:
        recent = ~_diagonal_keep(window_offset - 1, q0, q1, k0, k1, device)  # j >= i + offset
        keep = recent if keep is None else keep & recent
    if segments is not None:
        same = segment_keep(segments, q0, q1, k0, k1)
        keep = same if keep is None else keep & same
    return keep


def segment_keep(
    segments: tuple[torch.Tensor, torch.Tensor], q0: int, q1: int, k0: int, k1: int
) -> torch.Tensor:
    """(*batch, 1, q1-q0, k1-k0) bool: query and key carry the same segment id."""
    query_ids, key_ids = segments  # (*batch, Lq), (*batch, Lk)
    return (query_ids[..., q0:q1, None] == key_ids[..., None, k0:k1]).unsqueeze(-3)


def alibi_bias(
    slopes: torch.Tensor, q0: int, q1: int, k0: int, k1: int, shift: int, dtype: torch.dtype
) -> torch.Tensor:
    """(*batch, Hq, q1-q0, k1-k0): ALiBi's −slope · |i + shift − j| for queries q0:q1 and keys
    k0:k1 (shift = Lk − Lq aligns the last query with the last key); ``slopes`` (*batch, Hq)."""
    distance = alibi_distance(q0, q1, k0, k1, shift, slopes.device, dtype)
    return -slopes.to(dtype)[..., None, None] * distance


def alibi_distance(
    q0: int, q1: int, k0: int, k1: int, shift: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(q1-q0, k1-k0): |i + shift − j|, the distance ALiBi penalises."""
    rows = torch.arange(q0 + shift, q1 + shift, device=device, dtype=dtype)[:, None]
    cols = torch.arange(k0, k1, device=device, dtype=dtype)[None, :]
    return (rows - cols).abs_()


def key_range(
    offset: int | None,
    window_offset: int | None,
    segment_keys: tuple[torch.Tensor, torch.Tensor] | None,
    q0: int,
    q1: int,
    lk: int,
) -> tuple[int, int]:
    """[start, end): the keys that queries q0:q1 may possibly attend under a causal rule, a window
    and segments (keys outside it are blocked for every query of the tile)."""
    start, end = 0, lk
    if offset is not None:
        end = min(end, q1 - 1 + offset + 1)
    if window_offset is not None:
        start = max(start, q0 + window_offset)
    if segment_keys is not None:
        first, last = segment_keys  # (Lq,): per query, the first and last key of its segments
        if q1 > q0:
            start = max(start, int(first[q0:q1].min()))
            end = min(end, int(last[q0:q1].max()) + 1)
    return max(0, start), max(0, min(end, lk))


def segment_spans(
    segments: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(first, last, runs): first and last, each (R, Lq) for the R = prod(*batch) batch entries,
    are per query position the first and the last key position whose segment id equals the
    query's (first > last when none does); ``runs`` says whether every id's keys are one
    contiguous run in every entry (packed sequences), so that [first, last] holds exactly the
    keys of a query's segment."""
    query_ids, key_ids = segments
    lq, lk = query_ids.shape[-1], key_ids.shape[-1]
    batch = _checks.broadcast_shape(query_ids.shape[:-1], key_ids.shape[:-1])
    assert batch is not None  # checked with the call
    rows = math.prod(batch)
    query_ids = query_ids.expand(*batch, lq).reshape(rows, lq)
    key_ids = key_ids.expand(*batch, lk).reshape(rows, lk)
    positions = torch.arange(lk, device=query_ids.device)
    first, last, runs = [], [], True
    for row in range(rows):  # per batch entry, each id's first and last key
        ids, inverse = torch.unique(torch.cat([key_ids[row], query_ids[row]]), return_inverse=True)
        key_id, query_id = inverse[:lk], inverse[lk:]
        lo = torch.full((ids.numel(),), lk, device=positions.device)
        hi = torch.full((ids.numel(),), -1, device=positions.device)
        lo, hi = (
            lo.scatter_reduce(0, key_id, positions, "amin"),
            hi.scatter_reduce(0, key_id, positions, "amax"),
        )
        count = torch.zeros_like(lo).scatter_add_(0, key_id, torch.ones_like(positions))
        runs = runs and bool((count == 0).logical_or(count == hi - lo + 1).all())
        first.append(lo[query_id])
        last.append(hi[query_id])
    empty = torch.empty(0, lq, dtype=torch.long, device=positions.device)
    return (torch.stack(first) if first else empty), (torch.stack(last) if last else empty), runs


def tile_bias(mask: torch.Tensor | None, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
    """The float mask's values to add to scores of queries q0:q1 and keys k0:k1 (None if bool)."""
    if mask is None or mask.dtype == torch.bool:
        return None
    return _tile(mask, q0, q1, k0, k1)
