"""Ring attention: one sequence split across the processes of a ``torch.distributed`` group.

Each of the P ranks holds a shard of the queries, keys and values. Attention needs every query to
meet every key, so the key/value blocks travel around a ring: at step t rank r holds the block of
rank r - t, computes its queries against it, and meanwhile passes the block on to rank r + 1.
After P steps every query has met every key, and no rank ever held more than two blocks besides
its own.

Merging partial results. Each block gives, for every query row, the attention output over that
block's keys alone, ``o_b``, and the log of that row's softmax denominator, ``lse_b =
log Σ_{j in b} exp(s_j)``. Over two blocks the denominator is the sum of theirs, so

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) · o_a + exp(lse_b - lse) · o_b

(each block's output re-weighted by its share of the whole denominator). ``merge_`` does this in
place, folding the blocks in one at a time; a row that has seen no key keeps lse = -inf and o = 0.

Backward. The gradient of a row depends on the blocks only through its final output and lse
(the softmax probabilities of key j are exp(s_j - lse)), so each block's gradient is computed
alone with the final (out, lse), and the blocks' contributions add up. The key/value blocks go
around the ring once more, now with accumulators for their gradients riding along: every rank
adds what its queries contribute to dk and dv, and after P steps each accumulator is back home.

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

from qkv import _checks, masks
from qkv.backends import flash
from qkv.distributed import layout as layouts
from qkv.distributed._comm import Ring
from qkv.functional import Causal, _canonical_call


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
    call, squeeze_head = _canonical_call(
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
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    q = q.expand(*batch, *q.shape[-3:])  # (*B, Hq, L, Dk)
    k = k.expand(*batch, *k.shape[-3:])  # (*B, Hkv, S, Dk)
    v = v.expand(*batch, *v.shape[-3:])  # (*B, Hkv, S, Dv)
    plan = _Plan(
        ring, layout, call.scale, masks.causal_offset(causal, ring.size * lq, ring.size * lk)
    )
    out = _RingAttention.apply(q, k, v, key_mask, plan)  # (*B, Hq, L, Dv)
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
    merged = torch.logaddexp(lse, block_lse)
    # Subtracting the merged lse keeps the exponents <= 0. A row with no key on either side has
    # merged = -inf, and exp(-inf - (-inf)) would be NaN: subtract 0 there, so both weights are 0.
    shift = merged.masked_fill(merged == -math.inf, 0.0)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - shift).unsqueeze(-1))
    lse.copy_(merged)


def _rows(x: torch.Tensor, chunk: layouts.Chunk) -> torch.Tensor:
    """The positions of ``chunk`` along the sequence dim (-2) of a (..., L, D) tensor."""
    return x.narrow(-2, chunk.local, chunk.size)


def _keys(mask: torch.Tensor | None, chunk: layouts.Chunk) -> torch.Tensor | None:
    """The columns of ``chunk`` of a key mask (..., 1, S), unless it is broadcast over keys."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask.narrow(-1, chunk.local, chunk.size)


# The flash kernels are called on pieces of at most this many query (and, in the backward, key)
# positions. What one call allocates besides its result (its scaled copy of the queries, the keys
# transposed, the gradients of its queries, keys and values) then stays bounded by the piece
# instead of growing with the shard, and so does the temporary of each merge. A multiple of the
# kernels' tiles (``flash.QUERY_TILE``, ``flash.KEY_TILE``), so the pieces cut no tile.
_PIECE = 1024


def _pieces(tile: layouts.Tile, *, split_keys: bool) -> Iterator[layouts.Tile]:
    """``tile`` cut into runs of at most ``_PIECE`` queries (and keys, if ``split_keys``),
    leaving out the pieces whose keys all lie in the future of their queries."""
    key_runs = _runs(tile.k) if split_keys else [tile.k]
    for rows in _runs(tile.q):
        for keys in key_runs:
            offset = tile.causal_offset
            if offset is not None:
                # query i of the piece is query i + a of the tile, key j is key j + b
                # (a, b: where the piece's queries and keys start in the tile's)
                offset += (rows.local - tile.q.local) - (keys.local - tile.k.local)
                seen = rows.size + offset  # how many keys the piece's last query may attend
                if seen <= 0:  # not even the last query sees the first key
                    continue
                if seen < keys.size:  # the keys after those are in the future of every query
                    keys = layouts.Chunk(keys.local, keys.start, seen)
            yield layouts.Tile(rows, keys, offset)


def _runs(chunk: layouts.Chunk) -> list[layouts.Chunk]:
    """``chunk`` cut into consecutive runs of at most ``_PIECE`` positions."""
    return [
        layouts.Chunk(chunk.local + a, chunk.start + a, min(_PIECE, chunk.size - a))
        for a in range(0, chunk.size, _PIECE)
    ]


_KV_TAG, _GRAD_TAG = 0, 3  # message tags of the key/value blocks and of their gradients


class _Held:
    """The key/value block (and key mask) of rank ``source`` that this rank holds at one step."""

    def __init__(self, source: int, tensors: list[torch.Tensor], has_mask: bool) -> None:
        self.source, self._tensors, self._has_mask = source, tensors, has_mask

    k = property(lambda self: self._tensors[0])  # (*B, Hkv, S, Dk)
    v = property(lambda self: self._tensors[1])  # (*B, Hkv, S, Dv)
    mask = property(lambda self: self._tensors[2] if self._has_mask else None)  # (*B, H, 1, S)

    def release(self) -> None:
        self._tensors = []


def _travelling_blocks(
    plan: _Plan, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, lq: int
) -> Iterator[_Held]:
    """The key/value blocks this rank holds in turn, its own first.

    Each block is passed on to the next rank while the caller computes with it (the last one
    goes nowhere). When the caller is done with a block, it is let go before the next one is
    waited for, so that a rank holds at most two blocks besides its own.
    """
    block = [k, v] if mask is None else [k, v, mask]
    steps = plan.steps(lq, k.shape[-2])
    for step, source in steps:
        transfer = None
        if step < len(steps) - 1:
            transfer = plan.ring.shift(block, what="keys/values", tag=_KV_TAG)
        held = _Held(source, block, mask is not None)
        yield held
        held.release()
        if transfer is not None:
            block = transfer.wait()


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, plan: _Plan
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over all keys: out (*B, Hq, L, Dv) and lse (*B, Hq, L)
    in the compute dtype (float32 for float16/bfloat16)."""
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)  # (*B, Hq, L, Dv)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=dtype)  # (*B, Hq, L): no key seen yet
    lq, lk = q.shape[-2], k.shape[-2]
    for block in _travelling_blocks(plan, k, v, mask, lq):
        for tile in plan.tiles(block.source, lq, lk):
            for piece in _pieces(tile, split_keys=False):
                piece_out, piece_lse = flash.forward(
                    _rows(q, piece.q),
                    _rows(block.k, piece.k),
                    _rows(block.v, piece.k),
                    scale=plan.scale,
                    causal_offset=piece.causal_offset,
                    mask=_keys(block.mask, piece.k),
                )
                rows = piece.q
                lse_rows = lse.narrow(-1, rows.local, rows.size)
                merge_(_rows(out, rows), lse_rows, piece_out, piece_lse)
    return out, lse


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
    """(dq, dk, dv) of this rank's shard, in the compute dtype."""
    dtype = out.dtype
    grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)  # (*B, Hq, L, Dk)
    incoming = None  # the accumulators of (dk, dv) of the block now held, arriving from behind
    spare = None  # buffers for this rank's part of a block's (dk, dv), reused step after step
    lq, lk = q.shape[-2], k.shape[-2]
    for block in _travelling_blocks(plan, k, v, mask, lq):
        if spare is None:
            spare = [torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (k, v)]
        else:
            spare = [x.zero_() for x in spare]
        grad_k, grad_v = spare  # (*B, Hkv, S, Dk), (*B, Hkv, S, Dv)
        for tile in plan.tiles(block.source, lq, lk):
            for piece in _pieces(tile, split_keys=True):
                piece_dq, piece_dk, piece_dv = flash.backward(
                    _rows(q, piece.q),
                    _rows(block.k, piece.k),
                    _rows(block.v, piece.k),
                    _rows(out, piece.q),
                    _rows(grad_out, piece.q),
                    lse.narrow(-1, piece.q.local, piece.q.size),
                    scale=plan.scale,
                    causal_offset=piece.causal_offset,
                    mask=_keys(block.mask, piece.k),
                )
                _rows(grad_q, piece.q).add_(piece_dq)
                _rows(grad_k, piece.k).add_(piece_dk)
                _rows(grad_v, piece.k).add_(piece_dv)
        if incoming is None:  # the block's first stop: this rank's part starts its accumulators
            accumulated, spare = spare, None
        else:  # add this rank's part to what the ranks before it accumulated
            accumulated = incoming.wait()
            accumulated[0].add_(grad_k)
            accumulated[1].add_(grad_v)
        # The accumulators follow their block; after the last step they go back to its owner.
        incoming = plan.ring.shift(accumulated, what="key/value gradients", tag=_GRAD_TAG)
    if incoming is None:  # empty sequences: nothing was computed
        return grad_q, torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)
    grad_k, grad_v = incoming.wait()
    return grad_q, grad_k, grad_v


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
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
    return mask.reshape((1,) * (len(scores_shape) - mask.dim()) + tuple(mask.shape))
