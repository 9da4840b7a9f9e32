"""Attention against a paged KV cache, its pages read where they lie.

Keys and values live in pools (P, page_size, H_kv, D); sequence i's key t is token
t % page_size of page table[i, t // page_size]. The compiled kernel (``paged.h``) walks each
sequence's pages in place, on the decoding core every decoding path runs (``decode.h``: a
long sequence's pages split across threads, a paged call the same arithmetic as a packed one).
Without it (float16, float64, another device, no kernel) this module's
loop runs the same online softmax as ``loop.py``, a tile of pages at a time: only the tile's
pages are gathered, never a sequence's whole cache. Legend: T query tokens, H_q / H_kv heads,
g = H_q / H_kv, D / Dv features, n keys of a tile.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from qkv.backends.base import compute_dtype
from qkv.backends.flash import kernel
from qkv.backends.flash.rules import decoding_slopes

if TYPE_CHECKING:
    from qkv.backends.flash.sequences import VarlenRules

PAGES_PER_TILE = 16  # the Python loop's tile: 16 pages of keys at a time


def attend(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (T, H_q, Dv) in the compute dtype and lse (H_q, T), without sinks. ``table``
    (N, max_pages) int64 and ``rows`` (T, 4) int64 (sequence, lo, hi, position) on the CPU."""
    # the kernel's paged path takes float32 and bfloat16 (float16 runs the loop)
    if query.dtype == torch.float16 or not kernel.takes(query, pool_k, pool_v):
        return _loop(query, pool_k, pool_v, table, rows, rules)
    module = kernel.load()
    assert module is not None  # built by takes
    out, lse = module.paged_decode(
        query.contiguous(),
        pool_k.contiguous(),
        pool_v.contiguous(),
        table.contiguous(),
        rows,
        rules.scale,
        rules.softcap or 0.0,
        decoding_slopes(rules.alibi_slopes),
        kernel.DECODE_SPLITS,
    )
    return out, lse.transpose(0, 1)


def _loop(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax over page tiles, sequence by sequence (see ``attend``)."""
    dtype = compute_dtype(query.dtype)
    t, hq, dv = query.shape[0], query.shape[1], pool_v.shape[-1]
    out = torch.zeros(t, hq, dv, dtype=dtype, device=query.device)
    lse = torch.full((hq, t), -math.inf, dtype=dtype, device=query.device)
    sequences = rows[:, 0]
    for i in torch.unique(sequences).tolist():
        tokens = (sequences == i).nonzero().flatten()  # (L,) this sequence's query tokens
        first, last = int(tokens[0]), int(tokens[-1]) + 1
        seq_rows = rows[first:last].to(query.device)
        o, s = _sequence(query[first:last].to(dtype), pool_k, pool_v, table[i], seq_rows, rules)
        out[first:last], lse[:, first:last] = o, s
    return out, lse


def _sequence(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    pages: torch.Tensor,
    rows: torch.Tensor,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L queries q (L, H_q, D) over its pages: out (L, H_q, Dv), lse (H_q, L)."""
    length, hq = q.shape[0], q.shape[1]
    page_size, hkv, dv = pool_k.shape[1], pool_k.shape[2], pool_v.shape[-1]
    g, dtype = hq // hkv, q.dtype
    lo, hi, position = rows[:, 1], rows[:, 2], rows[:, 3]  # (L,)
    queries = q.permute(1, 0, 2).reshape(hkv, g * length, -1)  # (H_kv, g·L, D)
    top = torch.full((hkv, g * length), -math.inf, dtype=dtype, device=q.device)
    total = torch.zeros_like(top)
    acc = torch.zeros(hkv, g * length, dv, dtype=dtype, device=q.device)
    end = int(hi.max()) if length else 0
    tile = PAGES_PER_TILE * page_size
    for k0 in range(0, end, tile):
        k1 = min(end, k0 + tile)
        used = pages[k0 // page_size : -(-k1 // page_size)].to(q.device)  # (k0: a page's first)
        keys = pool_k[used].flatten(0, 1)[: k1 - k0]  # (n, H_kv, D): this tile's pages only
        values = pool_v[used].flatten(0, 1)[: k1 - k0]
        scores = torch.einsum("hrd,nhd->hrn", queries, keys.to(dtype)) * rules.scale
        scores = _rules(scores.view(hkv, g, length, -1), rules, position, k0, k1).flatten(1, 2)
        key_index = torch.arange(k0, k1, device=q.device)
        allowed = (key_index >= lo[:, None]) & (key_index < hi[:, None])  # (L, n)
        scores = scores.masked_fill(~allowed.repeat(g, 1), -math.inf)
        new_top = torch.maximum(top, scores.amax(dim=-1))
        safe = new_top.masked_fill(new_top == -math.inf, 0.0)  # rows with no key yet: no NaN
        weights = torch.exp(scores - safe[..., None])
        rescale = torch.exp(top - safe)
        total = total * rescale + weights.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.einsum("hrn,nhe->hre", weights, values.to(dtype))
        top = new_top
    seen = total > 0
    out = torch.where(seen[..., None], acc / total.clamp_min(1e-30)[..., None], 0.0)
    lse = torch.where(seen, top + torch.log(total), -math.inf)
    out = out.view(hkv, g, length, dv).flatten(0, 1).permute(1, 0, 2)  # (L, H_q, Dv)
    return out, lse.view(hq, length)


def _rules(
    scores: torch.Tensor, rules: VarlenRules, position: torch.Tensor, k0: int, k1: int
) -> torch.Tensor:
    """Soft-capping, then ALiBi (−slope · |p − t|), on scores (H_kv, g, L, n) of keys k0:k1."""
    if rules.softcap is not None:
        scores = rules.softcap * torch.tanh(scores / rules.softcap)
    if rules.alibi_slopes is not None:
        hkv, g = scores.shape[:2]
        keys = torch.arange(k0, k1, device=scores.device)
        distance = (position[:, None] - keys).abs().to(scores.dtype)  # (L, n)
        slopes = rules.alibi_slopes.detach().to(scores.dtype).view(hkv, g, 1, 1)
        scores = scores - slopes * distance
    return scores
