"""The flash algorithm as a PyTorch loop: attention one tile at a time, never holding the
(Lq, Lk) score matrix.

The textbook computation ``softmax(Q Kᵀ · scale) V`` stores every score of a row before it can
normalise them. The flash algorithm instead walks over the keys in tiles and keeps, for each
query row, three running quantities over the keys seen so far:

    m    the largest score                       m = max_j s_j
    l    the sum of exponentials below m         l = Σ_j exp(s_j − m)
    acc  the un-normalised output                acc = Σ_j exp(s_j − m) v_j

A new tile of scores s (one row shown) updates them like this::

    m_new = max(m, max(s))
    alpha = exp(m − m_new)            # ≤ 1: how much the old terms shrink under the new maximum
    p     = exp(s − m_new)            # the tile's terms, measured against the new maximum
    l     = alpha · l + Σ p
    acc   = alpha · acc + p V_tile

Why ``alpha`` is right: every old term was stored as exp(s_j − m); measured against the new
maximum it must be exp(s_j − m_new) = exp(s_j − m) · exp(m − m_new). So one multiplication by
alpha moves all old terms to the new reference point at once. Subtracting the running maximum
keeps every exponential ≤ 1, so nothing overflows, exactly as a one-pass softmax subtracts the row
maximum. After the last tile, ``out = acc / l`` is the softmax-weighted sum of the values, and
``lse = m + log(l)`` is the row's log-sum-exp of scores.

The backward pass saves only q, k, v, out and lse (memory linear in length) and recomputes each
tile's weights exactly as ``p = exp(s − lse)``. With ``D = rowsum(dout ∘ out)``::

    dv += pᵀ dout          dp = dout V_tileᵀ          ds = p ∘ (dp − D)
    dq += ds K_tile · scale                            dk += dsᵀ q · scale

``D`` is used instead of ``rowsum(p ∘ dp)`` because, given the final out and lse of a row, it
is the same number whichever subset of keys a call sees; that is what lets a caller split the
keys into blocks (ring attention does) and add up the blocks' gradients.

Masks: ``qkv.masks.tile_keep`` / ``tile_bias`` give each tile's part of the mask and causal rule,
so a mask is only ever sliced, never expanded. Causal tiles entirely above the diagonal are
skipped; tiles entirely below it need no mask at all. What real models add (``rules.py``):
soft-capping and ALiBi change a tile's scores before the update above (and, in the backward
pass, ds by soft-capping's derivative 1 − tanh², with the slopes' gradient −Σ ds · distance);
key tiles outside a window or a query tile's segments are skipped like causal ones. Sinks are
not here: they join each row after its last tile (``flash.with_sinks``). A query row with no
key it may attend keeps l = 0: its output is 0, its lse −inf, and its gradient 0.

The first tile of a row sets m, l and acc directly (the update above, starting from m = −inf,
l = 0, acc = 0); a call whose keys fit in one tile, such as decoding one token against a KV cache,
is just that first step.

Base 2: the code computes 2^x where the text says exp(x), with scores measured in units of
log2(e) (the factor is folded into the scale of q once, and into a float mask as it is added), so
``exp(s − m) = 2^(s₂ − m₂)``; lse is converted back to natural log at the end. On CPUs 2^x has
no slow path, while exp(x) slows down 10-100× for x below about −87 (where it underflows) and
for x = −inf, which every blocked score becomes.

Grouped-query attention: the g query heads that share a key/value head are stacked as extra rows
of one matrix product with that head's keys, so K and V are never repeated.

Precision: in the loop, float16 and bfloat16 inputs are converted to float32 once per call;
scores, the running m, l and acc, exponentials, sums and all matrix products are float32 (torch's
CPU matrix product would round bfloat16 products' results to bfloat16, scores included). The
compiled kernel multiplies bfloat16 inputs on the CPU's bfloat16 matrix units with float32 sums,
so its scores are the float32 ones too; its weights enter the product with the (bfloat16) values
rounded to bfloat16, which changes the output by less than one unit in its last place, and are
computed with a cheaper 2^x (within 7.5e-5 relative, so lse is within about 1e-4).

The compiled kernel (``kernel.py``, ``flash_cpu.cpp``) runs the same forward recurrence and the
same backward pass for calls without a mask on CPUs; this loop is the specification it is tested
against, and it runs everything else: masks, float64, other devices.

Legend: B batch, H heads (Hq query, Hkv key/value), g = Hq / Hkv, N = B·Hkv, L/Lq query length,
S/Lk key length, R rows of a tile (g · its queries), D features (Dk query/key, Dv value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv import _checks, masks
from qkv.backends.base import Rules, compute_dtype
from qkv.backends.flash.rules import LOG2_E, TileRules  # scores in base-2 units

if TYPE_CHECKING:
    from qkv.backends.flash.mods import TileMods

# Tile sizes: a (rows, keys) tile of scores for all heads of a call should stay in this machine's
# caches while it is exponentiated and summed; measured on a 2-core x86 CPU (see
# docs/performance.md). A call with fewer queries gets proportionally longer key tiles (the same
# QUERY_TILE × KEY_TILE scores per head), so decoding one token is a single tile.
QUERY_TILE = 256
KEY_TILE = 512
LN_2 = math.log(2.0)
# With fewer query rows than this per key/value head, the keys are used as they lie in memory;
# with more, they are first copied transposed, which the products run faster on.
_COPY_KEYS_ROWS = 64

_NEG_INF = float("-inf")


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
    rules: Rules | None = None,
    mods: TileMods | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention forward pass.

    q (*B, Hq, Lq, Dk), k (*B, Hkv, Lk, Dk), v (*B, Hkv, Lk, Dv) with Hq = g·Hkv (key/value head
    j serves query heads j·g … j·g+g−1; K/V are not copied). ``mask`` (bool True = may attend, or
    float added to the scaled scores) broadcasts to (*B, Hq, Lq, Lk); ``causal_offset``: query i
    may attend key j iff j <= i + causal_offset. ``rules``: soft-capping, ALiBi, a window's left
    edge and segments, computed per tile (``rules.py``); key tiles none of a query tile's rows
    may reach are skipped. ``mods``: a score_mod and mask_mod per tile (``mods.py``), which also
    skips the tiles mask_mod empties.

    Returns ``out`` (*B, Hq, Lq, Dv) in the compute dtype (float32 for float16/bfloat16, else the
    input dtype) and ``lse`` (*B, Hq, Lq), the log-sum-exp of each row's scaled, masked scores
    (−inf for a row with no key; its out is 0). No autograd graph is built.
    """
    with torch.no_grad():
        heads = _Heads.of(q, k, v, scale)
        tiles = _Tiles(heads, mask, causal_offset, rules, mods=mods)
        lowest = torch.finfo(heads.dtype).min
        out = heads.new((heads.n, heads.g, heads.lq, heads.dv))
        lse = heads.new((heads.n, heads.g, heads.lq))
        for q0, q1 in _spans(heads.lq, QUERY_TILE):
            q_rows = heads.rows(heads.q, q0, q1)  # (N, R, Dk), times scale · log2(e)
            key_tiles = tiles.keys_for(q0, q1)
            if not key_tiles:  # no key may be attended: out = 0, lse = -inf
                out[:, :, q0:q1] = 0.0
                lse[:, :, q0:q1] = _NEG_INF
                continue
            # The first tile sets m, l and acc. m is clamped to the lowest finite number rather
            # than -inf: then exp(s - m) is 0 for a blocked score s = -inf, never
            # exp(-inf + inf) = NaN, even in a row with no key.
            (k0, k1), *key_tiles = key_tiles
            s = tiles.scores(q_rows, q0, q1, k0, k1)  # (N, R, kt) scaled, masked scores
            m = s.amax(dim=-1).clamp_(min=lowest)  # (N, R) running max
            p = s.sub_(m[..., None]).exp2_()  # (N, R, kt) exp(s - m), in place
            l_sum = p.sum(dim=-1)  # (N, R) running sum l of exp(s - m)
            acc = torch.bmm(p, heads.v[:, k0:k1])  # (N, R, Dv) running Σ exp(s - m) v
            for k0, k1 in key_tiles:  # every further tile updates them
                s = tiles.scores(q_rows, q0, q1, k0, k1)
                m_new = torch.maximum(m, s.amax(dim=-1))
                alpha = torch.exp2(m - m_new)  # (N, R): rescales the old terms to the new max
                p = s.sub_(m_new[..., None]).exp2_()  # exp(s - m_new)
                l_sum.mul_(alpha).add_(p.sum(dim=-1))
                acc.mul_(alpha[..., None]).baddbmm_(p, heads.v[:, k0:k1])  # + p V[k0:k1]
                m = m_new
            # l = 0 only for rows with no key: their acc is 0, so out = 0 (not 0/0 = NaN), and
            # their lse = m + log(0) = -inf.
            tile = (heads.n, heads.g, q1 - q0)
            l_safe = l_sum.clamp(min=torch.finfo(heads.dtype).tiny).view(*tile, 1)
            torch.div(acc.view(*tile, heads.dv), l_safe, out=out[:, :, q0:q1])
            lse2 = m.add_(l_sum.log2_())  # (N, R) lse in base 2
            torch.mul(lse2.view(tile), LN_2, out=lse[:, :, q0:q1])
        return heads.unflatten(out), heads.unflatten(lse)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention over this block of keys (``backward_all`` without rules)."""
    dq, dk, dv, _ = backward_all(
        q, k, v, out, grad_out, lse, scale=scale, causal_offset=causal_offset, mask=mask
    )
    return dq, dk, dv


def backward_all(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    mask: torch.Tensor | None = None,
    rules: Rules | None = None,
    grad_lse: torch.Tensor | None = None,
    mods: TileMods | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of attention over this block of keys.

    Shapes as in ``forward``; ``out`` (*B, Hq, Lq, Dv) and ``lse`` (*B, Hq, Lq) are the FINAL
    output and log-sum-exp of the query rows (over all keys, also those outside this block), and
    ``grad_out`` is the gradient of ``out``. Returns dq, dk, dv with the shapes of q, k, v (dk, dv
    summed over the query heads each key/value head serves), in the compute dtype. When the keys
    are split into blocks, the blocks' dk/dv are the parts of the full ones and their dq add up
    to the full dq. Rows with lse = −inf (no key) get zero gradient.

    ``grad_lse`` (*B, Hq, Lq), the gradient of lse if the caller uses it: d lse / d s_j = p_j, so
    it joins every score's gradient as ds_j = p_j (dp_j − D + grad_lse), i.e. D − grad_lse
    replaces D. The fourth result is the ALiBi slopes' gradient, (*B, Hq) (None unless
    ``rules.alibi_slopes`` requires one). ``mods`` (made for a backward pass) adds up the
    gradients of the tensors its score_mod captures.
    """
    with torch.no_grad():
        heads = _Heads.of(q, k, v, scale)
        tiles = _Tiles(heads, mask, causal_offset, rules, backward=True, mods=mods)
        # D_i = Σ_d dout_id · out_id = Σ_j p_ij dp_ij over ALL keys of row i (see module doc).
        delta = (grad_out.to(heads.dtype) * out.to(heads.dtype)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse.to(heads.dtype)[..., None]
        # exp(s - lse) must be 0 for a row with no key: lse = +inf gives that for any finite s.
        lse = lse.to(heads.dtype)[..., None] * LOG2_E  # in base 2, as the scores
        lse = heads.flatten_rows(lse.masked_fill(lse == _NEG_INF, math.inf))  # (N, g, Lq, 1)
        delta = heads.flatten_rows(delta)  # (N, g, Lq, 1)
        grad_out = heads.flatten_rows(grad_out.to(heads.dtype))  # (N, g, Lq, Dv)

        dq = heads.new((heads.n, heads.g, heads.lq, heads.dk))
        dk = heads.new((heads.n, heads.lk, heads.dk)).zero_()
        dv = heads.new((heads.n, heads.lk, heads.dv)).zero_()
        for q0, q1 in _spans(heads.lq, QUERY_TILE):
            q_rows = heads.rows(heads.q, q0, q1)  # (N, R, Dk), times scale · log2(e)
            dout = heads.rows(grad_out, q0, q1)  # (N, R, Dv)
            lse_rows, delta_rows = heads.rows(lse, q0, q1), heads.rows(delta, q0, q1)  # (N, R, 1)
            dq_rows = heads.new((*q_rows.shape[:2], heads.dk)).zero_()  # (N, R, Dk)
            for k0, k1 in tiles.keys_for(q0, q1):
                s = tiles.scores(q_rows, q0, q1, k0, k1)  # (N, R, kt)
                p = s.sub_(lse_rows).exp2_()  # (N, R, kt) the final softmax weights of this tile
                dv[:, k0:k1].baddbmm_(p.transpose(1, 2), dout)  # (N, kt, Dv)
                dp = tiles.value_products(dout, k0, k1)  # (N, R, kt) dout V[k0:k1]ᵀ
                ds = dp.sub_(delta_rows).mul_(p)  # (N, R, kt) dL/ds = p ∘ (dp − D)
                if tiles.rules is not None:  # through ALiBi and soft-capping to q·k · scale
                    ds = tiles.rules.gradient(ds, q0, q1, k0, k1)
                if mods is not None:  # through the score_mod (and to what it captures)
                    ds = mods.gradient(ds)
                dq_rows.baddbmm_(ds, heads.k[:, k0:k1])  # (N, R, Dk)
                # q_rows carries scale · log2(e): dk = dsᵀ (q · scale) is this times ln(2)
                dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), q_rows)  # (N, kt, Dk)
            dq[:, :, q0:q1] = dq_rows.mul_(scale).view(heads.n, heads.g, q1 - q0, heads.dk)
        dq = heads.unflatten(dq).sum_to_size(q.shape)
        dk = heads.unflatten_kv(dk.mul_(LN_2)).sum_to_size(k.shape)
        dv = heads.unflatten_kv(dv).sum_to_size(v.shape)
        return dq, dk, dv, tiles.slopes_grad()


# --- layout and tiles ----------------------------------------------------------------------------


@dataclass
class _Heads:
    """q, k and v flattened for batched matrix products over N = B·Hkv key/value heads.

    ``q`` is (N, g, Lq, Dk): the g query heads of each key/value head side by side, multiplied
    by scale · log2(e) once (scores in base 2). ``k`` (N, Lk, Dk) and ``v`` (N, Lk, Dv) are views
    whenever the inputs' layout and dtype allow (never copied per query head); ``k_t`` is k
    transposed, (N, Dk, Lk).
    """

    q: torch.Tensor  # (N, g, Lq, Dk) in the compute dtype, times scale · log2(e)
    k: torch.Tensor  # (N, Lk, Dk) in the compute dtype
    k_t: torch.Tensor  # (N, Dk, Lk), contiguous unless there are few queries
    v: torch.Tensor  # (N, Lk, Dv) in the compute dtype
    batch: tuple[int, ...]  # (*B) after broadcasting
    hkv: int

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> _Heads:
        """Flattened heads in the compute dtype."""
        hkv = k.shape[-3]
        q, k, v, batch = flat_heads(q, k, v, compute_dtype(q.dtype))
        q = q * (scale * LOG2_E)  # scores in base 2
        k_t = k.transpose(1, 2)  # (N, Dk, Lk)
        if q.shape[1] * q.shape[2] >= _COPY_KEYS_ROWS:  # g · Lq rows per key/value head
            k_t = k_t.contiguous()
        return cls(q, k, k_t, v, batch, hkv)

    n = property(lambda self: self.q.shape[0])
    g = property(lambda self: self.q.shape[1])
    lq = property(lambda self: self.q.shape[2])
    dk = property(lambda self: self.q.shape[3])
    lk = property(lambda self: self.k.shape[1])
    dv = property(lambda self: self.v.shape[2])
    dtype = property(lambda self: self.q.dtype)
    device = property(lambda self: self.q.device)

    def new(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """An uninitialised tensor in the compute dtype."""
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def flatten_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(*B', Hq, Lq, F) -> (N, g, Lq, F), broadcasting the batch dims."""
        x = x.expand(*self.batch, *x.shape[-3:])
        return x.reshape(self.n, self.g, self.lq, x.shape[-1])

    def rows(self, x: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """Queries q0:q1 of every head of a group as rows of one matrix: (N, g·(q1−q0), F)."""
        if q1 - q0 < x.shape[2]:
            x = x[:, :, q0:q1]
        return x.reshape(self.n, self.g * (q1 - q0), x.shape[-1])

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        """(N, g, Lq, ...) -> (*B, Hq, Lq, ...)."""
        return x.reshape(*self.batch, self.hkv * self.g, *x.shape[2:])

    def unflatten_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(N, Lk, F) -> (*B, Hkv, Lk, F)."""
        return x.reshape(*self.batch, self.hkv, *x.shape[1:])


def flat_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """q (N, g, Lq, Dk), k (N, Lk, Dk), v (N, Lk, Dv) in ``dtype`` and the batch dims (*B), for
    N = B·Hkv key/value heads: query head j·g + i of a batch entry uses key/value head j. Views
    whenever the inputs' layout and dtype allow; K and V are never copied per query head."""
    batch = _batch_shape(q, k, v)
    hq, hkv = q.shape[-3], k.shape[-3]
    groups = hq // hkv if hkv else 1  # query heads per key/value head (no heads: any)
    n = math.prod(batch) * hkv
    q = _flatten(q.to(dtype), batch, n * groups).view(n, groups, *q.shape[-2:])
    return q, _flatten(k.to(dtype), batch, n), _flatten(v.to(dtype), batch, n), batch


def _batch_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(*B): the batch dims of q, k and v broadcast together (callers check they broadcast)."""
    batch = _checks.broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    assert batch is not None, "q, k and v batch dims must broadcast"
    return batch


def _flatten(x: torch.Tensor, batch: tuple[int, ...], n: int) -> torch.Tensor:
    """(*B', H, L, D) -> (B·H, L, D), broadcasting the batch dims (a view when the layout
    allows: never a copy per query head)."""
    if tuple(x.shape[:-3]) != batch:
        x = x.expand(*batch, *x.shape[-3:])
    return x.reshape(n, *x.shape[-2:])


class _Tiles:
    """Which key tiles a query tile needs, and the per-tile (N, R, kt) arithmetic.

    Tiles are computed in buffers allocated once per call and reused by every tile: fresh
    allocations of this size cost page faults, which at these sizes rival the arithmetic.
    """

    def __init__(
        self,
        heads: _Heads,
        mask: torch.Tensor | None,
        offset: int | None,
        rules: Rules | None = None,
        backward: bool = False,
        mods: TileMods | None = None,
    ) -> None:
        self.heads, self.mask, self.offset, self.mods = heads, mask, offset, mods
        self.rules = None
        if rules is not None and (rules.structured or rules.modified_scores):
            shape = (heads.n, heads.g, heads.lq, heads.lk)
            self.rules = TileRules(rules, heads.batch, shape, heads.dtype, backward)
        self._causal_blocked: dict[tuple[int, int, int], torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.key_tile = max(KEY_TILE, QUERY_TILE * KEY_TILE // max(1, min(QUERY_TILE, heads.lq)))
        self.single = heads.lq <= QUERY_TILE and heads.lk <= self.key_tile  # one tile in all

    def keys_for(self, q0: int, q1: int) -> list[tuple[int, int]]:
        """Key tiles that queries q0:q1 may see: all of them, or those up to the last query's
        causal diagonal, from the first query's window edge, within their segments (tiles
        outside are skipped)."""
        if self.rules is not None:
            start, end = self.rules.key_range(self.offset, q0, q1)
            spans = _spans(end, self.key_tile, start)
        else:
            end = self.heads.lk
            if self.offset is not None:
                end = max(0, min(end, q1 - 1 + self.offset + 1))
            spans = _spans(end, self.key_tile)
        return spans if self.mods is None else self.mods.occupied(q0, q1, spans)

    def slopes_grad(self) -> torch.Tensor | None:
        """(*B, Hq): the ALiBi slopes' gradient a backward pass added up (None if none)."""
        if self.rules is None or self.rules.slopes_grad is None:
            return None
        heads = self.heads
        return self.rules.slopes_grad.reshape(*heads.batch, heads.hkv * heads.g)

    def scores(self, q_rows: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """``_scores``, then the mask_mod's blocked pairs set to −inf."""
        scores = self._scores(q_rows, q0, q1, k0, k1)
        if self.mods is not None:
            self.mods.block(scores, q0, q1, k0, k1)
        return scores

    def _scores(self, q_rows: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """(N, R, k1−k0) scores of queries q0:q1 against keys k0:k1 in base 2 (q_rows carries
        scale · log2(e)), float mask added, blocked pairs set to −inf."""
        heads = self.heads
        keys_t = heads.k_t[:, :, k0:k1]  # (N, Dk, kt)
        if self.single:  # nothing to reuse a buffer for
            scores = torch.bmm(q_rows, keys_t)
        else:
            shape = (heads.n, q_rows.shape[1], k1 - k0)
            scores = torch.bmm(q_rows, keys_t, out=self._buffer("scores", shape, heads.dtype))
        if self.mods is not None:  # the score_mod, before soft-capping and ALiBi
            self.mods.modify(scores, q0, q1, k0, k1)
        offset = self._offset_in(q0, k1)
        lower, segments = None, None
        if self.rules is not None:
            self.rules.modify(scores, q0, q1, k0, k1)  # soft-capping, ALiBi
            lower, segments = self.rules.lower_in(q0, q1, k0), self.rules.rules.segments
        if self.mask is None and offset is None and lower is None and segments is None:
            return scores
        per_head = scores.view(*heads.batch, heads.hkv * heads.g, q1 - q0, k1 - k0)
        bias = masks.tile_bias(self.mask, q0, q1, k0, k1)
        if bias is not None:  # a float mask's values are added to the scaled scores
            per_head.add_(bias, alpha=LOG2_E)
        if self.mask is not None or lower is not None or segments is not None:
            keep = masks.tile_keep(
                self.mask,
                offset,
                q0,
                q1,
                k0,
                k1,
                heads.device,
                window_offset=lower,
                segments=segments,
            )
            if keep is not None:
                per_head.masked_fill_(keep.logical_not(), _NEG_INF)
        else:  # only the columns that reach above the diagonal need the causal mask
            assert offset is not None  # (no mask and no offset returned above)
            first = max(0, q0 + offset + 1 - k0)  # columns before it are seen by every query
            per_head[..., first:].masked_fill_(self._blocked(q0, q1, k0 + first, k1), _NEG_INF)
        return scores

    def value_products(self, dout: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """(N, R, kt) dout (N, R, Dv) @ V[k0:k1]ᵀ."""
        values_t = self.heads.v[:, k0:k1].transpose(1, 2)
        shape = (self.heads.n, dout.shape[1], k1 - k0)
        return torch.bmm(dout, values_t, out=self._buffer("dp", shape, dout.dtype))

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` in buffer ``name``, which is allocated on first use
        with room for the largest (N, R, kt) tile of the call and then reused."""
        if name not in self._buffers:
            heads = self.heads
            size = heads.n * heads.g * min(QUERY_TILE, heads.lq) * min(self.key_tile, heads.lk)
            self._buffers[name] = torch.empty(size, dtype=dtype, device=heads.device)
        return self._buffers[name][: math.prod(shape)].view(shape)

    def _offset_in(self, q0: int, k1: int) -> int | None:
        """The causal offset if the tile reaches above the diagonal, None if entirely below."""
        if self.offset is None or k1 - 1 <= q0 + self.offset:
            return None
        return self.offset

    def _blocked(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """(q1−q0, k1−k0) True above the causal diagonal; tiles with the same shape and the same
        position relative to the diagonal share one."""
        key = (q1 - q0, k1 - k0, q0 - k0)
        if key not in self._causal_blocked:
            keep = masks.tile_keep(None, self.offset, q0, q1, k0, k1, self.heads.device)
            assert keep is not None
            self._causal_blocked[key] = keep.logical_not()
        return self._causal_blocked[key]


def _spans(length: int, tile: int, first: int = 0) -> list[tuple[int, int]]:
    """[(first, first + tile), …] covering range(first, length); the last may be shorter."""
    return [(start, min(start + tile, length)) for start in range(first, length, tile)]
