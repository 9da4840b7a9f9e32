"""Ring attention: one sequence split across the processes of a ``torch.distributed`` group.

Each of the P ranks holds a shard of the queries, keys and values. Attention needs every query to
meet every key, so the key/value blocks travel around a ring: at step t rank r holds the block of
rank r - t, computes its queries against it, and passes the block on to rank r + 1 piece by
piece, each piece as soon as it is done with it, receiving the next block's piece in its place
(``_Circulation``). After P steps every query has met every key, and no rank ever held more than
one travelling block, plus a piece in flight, besides its own.

Merging partial results. Each block gives, for every query row, the attention output over that
block's keys alone, ``o_b``, and the log of that row's softmax denominator, ``lse_b =
log Σ_{j in b} exp(s_j)``. Over two blocks the denominator is the sum of theirs, so

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) · o_a + exp(lse_b - lse) · o_b

(each block's output re-weighted by its share of the whole denominator; ``qkv.logsumexp``, as
``qkv.merge``). ``merge_`` does this in place, folding the blocks in one at a time; a row that
has seen no key keeps lse = -inf and o = 0.

Backward. The gradient of a row depends on the blocks only through its final output and lse
(the softmax probabilities of key j are exp(s_j - lse)), so each block's gradient is computed
alone with the final (out, lse), and the blocks' contributions add up. The key/value blocks go
around the ring once more, now with accumulators for their gradients riding along, piece by piece
in the same way: every rank adds what its queries contribute to dk and dv, and after P steps each
accumulator is back home. Memory per rank: its shard's q, k, v, out, output gradient and dq, plus
one travelling key/value block and its accumulators: about 10 rows of T/P positions, against 8
rows of T for one process.

Causal attention skips the blocks whose keys all lie in the future of the rank's queries: they are
neither computed nor masked, only passed on. Which tiles each rank computes, and the load-balanced
zigzag layout, are in ``qkv.distributed.layout``; the attention of one tile is the flash backend's
(``qkv.backends.flash.forward`` / ``backward``).

Legend: B batch, Hq query heads, Hkv key/value heads, L query positions per rank, S key positions
per rank, Dk query/key features, Dv value features, P ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from qkv import _checks, logsumexp, masks
from qkv.backends import flash
from qkv.backends.base import compute_dtype
from qkv.canonical import Causal, canonical_call
from qkv.distributed import layout as layouts
from qkv.distributed._comm import Ring, Transfer


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    padding_mask: torch.Tensor | None = None,
    timeout: float | timedelta | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of a ``torch.distributed`` group.

    Every rank of ``group`` (default: the default group) calls this at once with its shard of
    the sequence (dim -2) and gets back its shard of the output: the same result, in every dtype,
    as ``qkv.attention(q, k, v, causal=causal, scale=scale, mask=...)`` on the whole sequence,
    differentiable. Shapes, per rank (leading dims broadcast as in ``qkv.attention``)::

        q: (*batch, Hq, L, Dk)    or any (*batch, L, Dk)
        k: (*batch, Hkv, S, Dk)
        v: (*batch, Hkv, S, Dv)
        returns out: (*batch, Hq, L, Dv) in q's dtype

    All ranks pass the same shapes; the whole sequences have P·L queries and P·S keys.
    Grouped-query heads (Hq a multiple of Hkv) work as in ``qkv.attention``.

    ``layout``: which positions each rank holds. ``"contiguous"`` (the default): rank r holds the
    r-th contiguous equal shard. ``"zigzag"``: the sequence is cut into 2P chunks and rank r
    holds chunk r followed by chunk 2P-1-r, which balances causal work across ranks (see
    ``ring_work``); make and reassemble such shards with ``shard`` and ``unshard``.

    ``causal``: as in ``qkv.attention``, applied to the whole sequences (``True`` /
    ``"bottom-right"``: query i may attend key j iff j <= i + P·S - P·L; ``"top-left"``: j <= i).
    Blocks of keys entirely in the future of a rank's queries are skipped, not computed.

    ``padding_mask``: this rank's shard of a key mask, **True = real token (may attend)**, bool,
    broadcastable to (*batch, Hq, 1, S) — e.g. ``qkv.padding_mask(tokens_shard)`` (B, 1, 1, S).
    It travels around the ring with its keys. A query with no key it may attend gets 0 output
    and 0 gradient.

    ``timeout``: seconds (or a ``timedelta``) to wait for any one transfer between neighbours
    before raising ``TimeoutError`` naming the peer rank; None uses the process group's own
    timeout (``init_process_group(timeout=...)``). A peer whose process has exited makes the
    transfer fail at once with a ``RuntimeError`` naming it. After either error the process group
    is unusable: let the process exit (torchrun then stops the job).
    """
    call, squeeze_head = canonical_call(
        q,
        k,
        v,
        mask=None,
        causal=causal,
        scale=scale,
        dropout_p=0.0,
        return_weights=False,
        backend="flash",
    )
    layout = layouts.check_layout(layout)
    if layout == "zigzag":
        for name, x in (("q", q), ("k", k)):
            if x.shape[-2] % 2 != 0:
                raise ValueError(
                    f'{name} must have an even length per rank (dim -2) for layout="zigzag" '
                    f"(two equal chunks), got shape {_checks.shape_str(x.shape)}"
                )
    ring = Ring(_check_group(group), _check_timeout(timeout))
    q, k, v = call.q, call.k, call.v
    lq, lk = q.shape[-2], k.shape[-2]
    key_mask = _check_padding_mask(padding_mask, call.q, call.scores_shape, squeeze_head)

    # One batch shape for all: the blocks that travel and their gradients then have fixed shapes.
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3])
    assert batch is not None  # checked by canonical_call
    q = q.expand(*batch, *q.shape[-3:])  # (*B, Hq, L, Dk)
    k = k.expand(*batch, *k.shape[-3:])  # (*B, Hkv, S, Dk)
    v = v.expand(*batch, *v.shape[-3:])  # (*B, Hkv, S, Dv)
    plan = _Plan(
        ring, layout, call.scale, masks.causal_offset(causal, ring.size * lq, ring.size * lk)
    )
    out: torch.Tensor = _RingAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, key_mask, plan
    )  # (*B, Hq, L, Dv)
    return out.squeeze(-3) if squeeze_head else out


@dataclass(frozen=True)
class _Plan:
    ring: Ring
    layout: str
    scale: float
    causal_offset: int | None  # of the whole sequences

    def tiles(self, source: int, lq: int, lk: int) -> list[layouts.Tile]:
        """What this rank computes against the block of rank ``source``."""
        ring = self.ring
        return layouts.tiles(self.layout, ring.rank, source, ring.size, lq, lk, self.causal_offset)

    def steps(self, lq: int, lk: int) -> list[tuple[int, int]]:
        """(step, source rank of the block held at that step); none when there is nothing to do."""
        if lq == 0 or lk == 0:
            return []
        return [(step, (self.ring.rank - step) % self.ring.size) for step in range(self.ring.size)]


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's partial attention into the running result, in place.

    ``out`` (..., L, Dv) and ``lse`` (..., L) hold the result over the keys seen so far;
    ``block_out``/``block_lse`` the result over one more block of keys. Rows that have seen no
    key have lse = -inf and out = 0, and stay so (never NaN); NaN in either input propagates.
    """
    merged, share, block_share = logsumexp.shares(lse, block_lse)
    out.mul_(share.unsqueeze(-1))
    out.add_(block_out * block_share.unsqueeze(-1))
    lse.copy_(merged)


def _rows(x: torch.Tensor, chunk: layouts.Chunk) -> torch.Tensor:
    """The positions of ``chunk`` along the sequence dim (-2) of a (..., L, D) tensor."""
    return x.narrow(-2, chunk.local, chunk.size)


# Blocks travel, and the flash kernels are called, in pieces of at most this many key (and
# query) positions. A rank then holds one travelling block plus a piece in flight besides its
# own shard, and what one kernel call allocates besides its result (its scaled copy of the
# queries, the keys transposed, the gradients of its queries, keys and values) stays bounded by
# the piece instead of growing with the shard, as does the temporary of each merge. A multiple
# of the kernels' tiles (``flash.QUERY_TILE``, ``flash.KEY_TILE``), so the pieces cut no tile.
_PIECE = 1024


def _key_pieces(lk: int) -> list[layouts.Chunk]:
    """The pieces a block of ``lk`` keys travels in (``local``: where each starts in it)."""
    return _runs(layouts.Chunk(0, 0, lk))


def _pieces(tile: layouts.Tile, keys: layouts.Chunk) -> Iterator[layouts.Tile]:
    """The part of ``tile`` whose keys lie in the block positions ``keys``, cut into runs of at
    most ``_PIECE`` queries, leaving out the runs whose keys all lie in the future."""
    first = max(tile.k.local, keys.local)
    end = min(tile.k.local + tile.k.size, keys.local + keys.size)
    if end <= first:
        return
    shift = first - tile.k.local  # the piece's keys start this far into the tile's
    keys = layouts.Chunk(first, tile.k.start + shift, end - first)
    for rows in _runs(tile.q):
        piece_keys, offset = keys, tile.causal_offset
        if offset is not None:
            # query i of the run is query i + (rows.local - tile.q.local) of the tile, and key j
            # of the piece is key j + shift of the tile
            offset += (rows.local - tile.q.local) - shift
            seen = rows.size + offset  # how many keys the run's last query may attend
            if seen <= 0:  # not even the last query sees the first key
                continue
            if seen < keys.size:  # the keys after those are in the future of every query
                piece_keys = layouts.Chunk(keys.local, keys.start, seen)
        yield layouts.Tile(rows, piece_keys, offset)


def _runs(chunk: layouts.Chunk) -> list[layouts.Chunk]:
    """``chunk`` cut into consecutive runs of at most ``_PIECE`` positions."""
    return [
        layouts.Chunk(chunk.local + a, chunk.start + a, min(_PIECE, chunk.size - a))
        for a in range(0, chunk.size, _PIECE)
    ]


_KV_TAG, _GRAD_TAG = 0, 3  # message tags of the key/value blocks and of their gradients


class _Circulation:
    """Blocks of tensors, one per rank, that visit every rank in turn: at step t this rank holds
    the block of rank r - t. Every tensor is (..., S, ·), its key positions along dim -2.

    A block moves piece by piece (``_key_pieces``): when this rank is done with a piece it
    passes it on to the next rank and receives the same piece of the next block from the
    previous rank, into the place the piece it sent leaves free. Besides its own block a rank so
    holds one travelling block and one piece in flight, and each piece's transfer overlaps with
    the work on the next piece.
    """

    def __init__(
        self,
        ring: Ring,
        own: list[torch.Tensor] | None,
        like: list[tuple[torch.Size, torch.dtype, torch.device]],
        what: str,
        tag: int,
    ) -> None:
        self.ring, self.what, self.tag = ring, what, tag
        self.held = own  # the block worked on now; None: this rank makes its own block's pieces
        self._like = like  # (shape, dtype, device) of each tensor of a block
        self._slots: list[torch.Tensor] | None = None  # where the travelling blocks live
        self._in_flight: tuple[Transfer, layouts.Chunk] | None = None

    def piece(self, keys: layouts.Chunk) -> list[torch.Tensor]:
        """The held block's tensors at the positions ``keys``."""
        assert self.held is not None
        return [x.narrow(-2, keys.local, keys.size) for x in self.held]

    def pass_on(self, keys: layouts.Chunk, piece: list[torch.Tensor] | None = None) -> None:
        """Send ``piece`` (default: the held block at ``keys``), once this rank is done with it, to
        the next rank, and start receiving the previous rank's piece in its place."""
        self._complete()
        piece = self.piece(keys) if piece is None else piece
        transfer = self.ring.shift(piece, what=self.what, tag=self.tag)
        self._in_flight = (transfer, keys)

    def next_step(self) -> None:
        """Wait for the last piece to arrive; the block received is held from now on."""
        self._complete()
        assert self._slots is not None
        self.held = self._slots

    def _complete(self) -> None:
        if self._in_flight is None:
            return
        transfer, keys = self._in_flight
        received = transfer.wait()  # the piece sent is gone: its place is free
        if self._slots is None:
            self._slots = [torch.empty(shape, dtype=t, device=at) for shape, t, at in self._like]
        for slot, x in zip(self._slots, received):
            slot.narrow(-2, keys.local, keys.size).copy_(x)
        self._in_flight = None


def _travelling(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors of this rank's key/value block: k, v and, if given, the key mask (..., 1, S)
    turned to (..., S, 1) so that it is cut along dim -2 like k and v."""
    if mask is None:
        return [k, v]
    return [k, v, mask.expand(*mask.shape[:-1], k.shape[-2]).transpose(-1, -2)]


def _specs(tensors: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    return [(x.shape, x.dtype, x.device) for x in tensors]


def _unpack(piece: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k, v, key mask (..., 1, S) or None) of a piece of a key/value block."""
    return piece[0], piece[1], piece[2].transpose(-1, -2) if len(piece) > 2 else None


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, plan: _Plan
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over all keys: out (*B, Hq, L, Dv) and lse (*B, Hq, L)
    in the compute dtype (float32 for float16/bfloat16)."""
    dtype = compute_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)  # (*B, Hq, L, Dv)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=dtype)  # (*B, Hq, L): no key seen yet
    lq, lk = q.shape[-2], k.shape[-2]
    own = _travelling(k, v, mask)
    blocks = _Circulation(plan.ring, own, _specs(own), "keys/values", _KV_TAG)
    steps = plan.steps(lq, lk)
    for step, source in steps:
        tiles = plan.tiles(source, lq, lk)
        for keys in _key_pieces(lk):
            block_k, block_v, block_mask = _unpack(blocks.piece(keys))
            for tile in tiles:
                for piece in _pieces(tile, keys):
                    at = piece.k.local - keys.local  # where the piece's keys start in block_k
                    piece_out, piece_lse = flash.forward(
                        _rows(q, piece.q),
                        block_k.narrow(-2, at, piece.k.size),
                        block_v.narrow(-2, at, piece.k.size),
                        scale=plan.scale,
                        causal_offset=piece.causal_offset,
                        mask=_key_columns(block_mask, at, piece.k.size),
                    )
                    lse_rows = lse.narrow(-1, piece.q.local, piece.q.size)
                    merge_(_rows(out, piece.q), lse_rows, piece_out, piece_lse)
            if step < len(steps) - 1:  # the last block goes nowhere
                blocks.pass_on(keys)
        if step < len(steps) - 1:
            blocks.next_step()
    return out, lse


def _key_columns(mask: torch.Tensor | None, at: int, size: int) -> torch.Tensor | None:
    """Columns ``at`` ... ``at + size - 1`` of a key mask (..., 1, S)."""
    return None if mask is None else mask.narrow(-1, at, size)


def _ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    plan: _Plan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shard, in the compute dtype.

    The key/value blocks go around once more, and with them (dk, dv) accumulators: at each
    step this rank adds what its queries contribute to the block's accumulators and passes them
    on; after the last step each block's accumulators arrive back at its owner."""
    dtype = out.dtype
    grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)  # (*B, Hq, L, Dk)
    lq, lk = q.shape[-2], k.shape[-2]
    steps = plan.steps(lq, lk)
    if not steps:  # empty sequences: nothing to compute
        return grad_q, torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)
    own = _travelling(k, v, mask)
    blocks = _Circulation(plan.ring, own, _specs(own), "keys/values", _KV_TAG)
    like = [(x.shape, dtype, x.device) for x in (k, v)]
    grads = _Circulation(plan.ring, None, like, "key/value gradients", _GRAD_TAG)
    for step, source in steps:
        tiles = plan.tiles(source, lq, lk)
        for keys in _key_pieces(lk):
            block_k, block_v, block_mask = _unpack(blocks.piece(keys))
            if step == 0:  # this rank's own block: its accumulators start here, piece by piece
                grad_k, grad_v = (x.new_zeros(x.shape, dtype=dtype) for x in (block_k, block_v))
            else:
                grad_k, grad_v = grads.piece(keys)
            for tile in tiles:
                for piece in _pieces(tile, keys):
                    at = piece.k.local - keys.local
                    piece_dq, piece_dk, piece_dv = flash.backward(
                        _rows(q, piece.q),
                        block_k.narrow(-2, at, piece.k.size),
                        block_v.narrow(-2, at, piece.k.size),
                        _rows(out, piece.q),
                        _rows(grad_out, piece.q),
                        lse.narrow(-1, piece.q.local, piece.q.size),
                        scale=plan.scale,
                        causal_offset=piece.causal_offset,
                        mask=_key_columns(block_mask, at, piece.k.size),
                    )
                    _rows(grad_q, piece.q).add_(piece_dq)
                    grad_k.narrow(-2, at, piece.k.size).add_(piece_dk)
                    grad_v.narrow(-2, at, piece.k.size).add_(piece_dv)
            if step < len(steps) - 1:
                blocks.pass_on(keys)
            # The accumulators follow their block; after the last step they go back to its owner.
            grads.pass_on(keys, [grad_k, grad_v])
        if step < len(steps) - 1:
            blocks.next_step()
        grads.next_step()
    assert grads.held is not None  # this rank's own accumulators, back home
    grad_k, grad_v = grads.held
    return grad_q, grad_k, grad_v


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        plan: _Plan,
    ) -> torch.Tensor:
        out, lse = _ring_forward(q, k, v, mask, plan)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ring_backward(q, k, v, mask, out, lse, grad_out, ctx.plan)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


# --- argument checks ---------------------------------------------------------------------------


def _check_group(group: Any) -> dist.ProcessGroup | None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) on every process first (torchrun sets up "
            "its environment)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"group must contain this process (global rank {dist.get_rank()}), but it does not"
        )
    return group


def _check_timeout(timeout: Any) -> timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = _checks.finite_float("timeout", timeout)
    if seconds <= 0:
        raise ValueError(f"timeout must be positive (seconds), got {timeout}")
    return timedelta(seconds=seconds)


def _check_padding_mask(
    mask: Any, q: torch.Tensor, scores_shape: tuple[int, ...], squeeze_head: bool
) -> torch.Tensor | None:
    """The key mask, with as many dims as the scores (*B, Hq, L, S) and dim -2 of size 1."""
    if mask is None:
        return None
    _checks.tensor("padding_mask", mask, min_ndim=1)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"padding_mask must be bool (True = real token, may attend), got {mask.dtype}; "
            f"convert 0/1 masks with .bool()"
        )
    _checks.same_device(("q", "padding_mask"), (q, mask))
    target = (*scores_shape[:-2], 1, scores_shape[-1])  # (*B, Hq, 1, S)
    if squeeze_head:
        target = target[1:]
    if mask.dim() >= 2 and mask.shape[-2] != 1:
        raise ValueError(
            f"padding_mask is a key mask: its dim -2 must be 1, as in (*batch, Hq, 1, S), got "
            f"shape {_checks.shape_str(mask.shape)}"
        )
    _checks.broadcastable("padding_mask", mask.shape, target, "(*batch, Hq, 1, S)")
    keep: torch.Tensor = mask.reshape((1,) * (len(scores_shape) - mask.dim()) + tuple(mask.shape))
    return keep
