"""How a sequence is split across the ranks of a ring, and which blocks each rank computes.

A layout says which positions of the whole sequence (length T) rank r of P holds:

- ``"contiguous"``: the r-th contiguous shard, positions ``r·T/P … (r+1)·T/P - 1``.
- ``"zigzag"``: the sequence cut into 2P equal chunks; rank r holds chunk r and chunk 2P-1-r,
  one early and one late, in that order.

With causal attention a query only sees keys at or before it, so in the contiguous layout rank 0
has one block of work and rank P-1 has P: the last rank sets the pace. Zigzag pairs an early chunk
(little work) with a late one (much work) and every rank gets the same amount.

Legend: T whole sequence length, P ranks (world size), L positions per rank (T/P).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv import _checks

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive positions of the whole sequence held by one rank."""

    local: int  # where it starts in the rank's shard
    start: int  # where it starts in the whole sequence
    size: int


@dataclass(frozen=True)
class Tile:
    """One piece of work: a chunk of this rank's queries against a chunk of a block's keys."""

    q: Chunk
    k: Chunk
    causal_offset: int | None  # query i of the tile may attend key j iff j <= i + offset


def chunks(layout: str, rank: int, world_size: int, length: int) -> tuple[Chunk, ...]:
    """The chunks of rank ``rank``'s shard of ``length`` positions, in shard order."""
    if layout == "contiguous":
        return (Chunk(0, rank * length, length),)
    half = length // 2  # zigzag: chunk r, then chunk 2P-1-r
    return (Chunk(0, rank * half, half), Chunk(half, (2 * world_size - 1 - rank) * half, half))


def tiles(
    layout: str,
    rank: int,
    source: int,
    world_size: int,
    lq: int,
    lk: int,
    causal_offset: int | None,
) -> list[Tile]:
    """What ``rank`` (holding ``lq`` queries) computes against the key/value block of ``source``
    (``lk`` keys), given the causal offset of the whole sequences (query i may attend key j iff
    j <= i + offset; None: no causal rule).

    Tiles whose keys all lie in the future of all their queries are left out: they are never
    computed. A tile whose keys are all visible gets no causal rule (offset None).
    """
    work = []
    for q in chunks(layout, rank, world_size, lq):
        for k in chunks(layout, source, world_size, lk):
            if q.size == 0 or k.size == 0:
                continue
            if causal_offset is None:
                work.append(Tile(q, k, None))
                continue
            offset = causal_offset + q.start - k.start  # the same rule in the tile's coordinates
            if offset < -(q.size - 1):  # even the last query sees none of these keys
                continue
            work.append(Tile(q, k, None if offset >= k.size - 1 else offset))
    return work


def check_layout(layout: object) -> str:
    _checks.choice("layout", layout, LAYOUTS)
    assert isinstance(layout, str)
    return layout


def _pieces(layout: str, world_size: int, length: int, name: str) -> int:
    """Positions per rank for a sequence of ``length``; ValueError if it does not split evenly."""
    parts = world_size * (2 if layout == "zigzag" else 1)
    if length % parts != 0:
        raise ValueError(
            f'{name} must have a sequence length divisible by {parts} for layout="{layout}" '
            f"over {world_size} ranks, got length {length}"
        )
    return length // world_size


def shard(
    x: torch.Tensor, rank: int, world_size: int, *, layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """Rank ``rank``'s shard of a whole sequence ``x`` (sequence along ``dim``, default -2).

    ``x``: (..., T, D) → (..., T/P, D). ``"contiguous"``: a view of positions r·T/P onwards;
    ``"zigzag"``: chunk r and chunk 2P-1-r of 2P chunks, concatenated (a copy).
    The inverse, run on every rank at once, is ``unshard``.
    """
    _checks.tensor("x", x, min_ndim=1)
    world_size = _checks.positive_int("world_size", world_size)
    rank = _checks.non_negative_int("rank", rank)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size = {world_size}, got {rank}")
    layout = check_layout(layout)
    dim = _dim(x, dim)
    length = _pieces(layout, world_size, x.shape[dim], "x")
    parts = [x.narrow(dim, c.start, c.size) for c in chunks(layout, rank, world_size, length)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(
    x: torch.Tensor,
    *,
    layout: str = "contiguous",
    group: torch.distributed.ProcessGroup | None = None,
    dim: int = -2,
) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (a collective: every rank of ``group``
    calls it with a shard of the same shape, and every rank gets the whole sequence).

    ``x``: (..., T/P, D) → (..., T, D). Not differentiable (it uses ``all_gather``).
    """
    _checks.tensor("x", x, min_ndim=1)
    layout = check_layout(layout)
    dim = _dim(x, dim)
    world_size = torch.distributed.get_world_size(group)
    length = x.shape[dim]
    if layout == "zigzag" and length % 2 != 0:
        raise ValueError(
            f'x must have an even number of positions per rank for layout="zigzag", got {length}'
        )
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, x, group=group)
    shape = list(x.shape)
    shape[dim] = length * world_size
    whole = x.new_empty(shape)
    for rank, part in enumerate(gathered):
        for c in chunks(layout, rank, world_size, length):
            whole.narrow(dim, c.start, c.size).copy_(part.narrow(dim, c.local, c.size))
    return whole


def _dim(x: torch.Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape "
            f"{_checks.shape_str(x.shape)}, got {dim}"
        )
    return dim % x.dim()


@dataclass(frozen=True)
class RingWork:
    """How much attention work each rank of a ring does.

    ``tiles[r]``: query×key tile pairs rank r hands to the attention kernel, with the sequence cut
    into 2P equal chunks so that a tile is one chunk of queries against one chunk of keys (the
    same unit for every layout; tiles on the causal diagonal count whole).
    ``imbalance``: max / mean of ``tiles`` — how much longer the slowest rank works than an even
    split would take (1.0 = balanced).
    """

    layout: str
    world_size: int
    causal: bool
    tiles: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        mean = sum(self.tiles) / len(self.tiles)
        return max(self.tiles) / mean if mean else 1.0


def ring_work(world_size: int, *, layout: str = "contiguous", causal: bool = True) -> RingWork:
    """Per-rank work of ``ring_attention`` over ``world_size`` ranks, counted from the same plan
    the ring runs (``tiles``), for self-attention (query and key sequences of one length).

    >>> ring_work(4, layout="contiguous").tiles, ring_work(4, layout="zigzag").tiles
    ((4, 8, 12, 16), (9, 9, 9, 9))
    """
    world_size = _checks.positive_int("world_size", world_size)
    layout = check_layout(layout)
    causal = _checks.boolean("causal", causal)
    offset = 0 if causal else None
    # Two positions per rank: one per zigzag chunk, so a 1×1 tile is one chunk against one chunk.
    per_rank = tuple(
        sum(
            t.q.size * t.k.size
            for source in range(world_size)
            for t in tiles(layout, rank, source, world_size, 2, 2, offset)
        )
        for rank in range(world_size)
    )
    return RingWork(layout, world_size, causal, per_rank)
