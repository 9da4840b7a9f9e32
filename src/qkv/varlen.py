"""``qkv.varlen_attn``: a packed batch of sequences of different lengths, each with its own
queries and keys, in one call (chunked prefill and decoding together, as servers batch them).

The signature and meanings are those of ``torch.nn.attention.varlen.varlen_attn`` (a drop-in:
its ``(-1, -1)`` window sentinels and ``AuxRequest`` are taken as they are), plus qkv's
``causal``, ``softcap``, ``alibi_slopes`` and ``sinks``. Sequence i has queries
``cu_seq_q[i] : cu_seq_q[i + 1]`` and keys ``cu_seq_k[i] : cu_seq_k[i + 1]`` (the first
``seqused_k[i]`` of them where given), or with ``block_table`` its keys lie in a pool of pages.

Causal and windows are aligned bottom-right *per sequence* (flash-attn's varlen convention): with
q_len queries and k_len keys, query j of a sequence sits at key position p = k_len − q_len + j
and may attend key t iff p − left ≤ t ≤ p + right (−1: unbounded; causal: right = 0)::

    q_len 2, k_len 5, causal:   keys 0 1 2 3 4
                      query 0        x x x x .
                      query 1        x x x x x

Legend: N sequences, T_q / T_k packed query / key tokens, H_q / H_kv heads, D / Dv features,
P pages of page_size tokens.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

from qkv import _checks
from qkv.backends import dispatch
from qkv.backends.base import default_scale
from qkv.backends.flash import varlen as flash_varlen
from qkv.backends.flash.sequences import Packing, VarlenRules
from qkv.canonical import canonical_call

__all__ = ["AuxRequest", "varlen_attn"]


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``varlen_attn`` returns (torch's ``AuxRequest`` works as well)."""

    lse: bool = False


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of N sequences, each of its own query and key length.

    Shapes::

        query:  (T_q, H_q, D)                        sequences packed one after another
        key:    (T_k, H_kv, D)   or a page pool (P, page_size, H_kv, D) with block_table
        value:  (T_k, H_kv, Dv)  or (P, page_size, H_kv, Dv)
        cu_seq_q, cu_seq_k: (N + 1,) int32/int64, 0 first, never decreasing, last T_q / T_k
        seqused_k: (N,) keys each sequence uses (its first ones); needed with block_table
        block_table: (N, max_pages) int32/int64, sequence i's key t lies at token
                     t % page_size of page block_table[i, t // page_size]
        returns out (T_q, H_q, Dv) in query's dtype [, lse (H_q, T_q)]

    ``max_q`` / ``max_k`` bound the query / key lengths (an error names a longer sequence).
    ``window_size`` = (left, right), −1 unbounded: (−1, 0) is causal, (W, 0) causal with the W
    keys before each query's own; ``causal=True`` is the same as right = 0. Both align
    bottom-right per sequence (see the module's docstring). ``enable_gqa``: H_kv may divide
    H_q, key/value head j serving query heads j·g … j·g + g − 1. ``softcap``, ``alibi_slopes``
    (H_q,) and ``sinks`` (H_q,) mean what they mean in ``qkv.attention``, ALiBi's distance
    measured per sequence (p − t). ``return_aux=AuxRequest(lse=True)`` also returns each row's
    natural log-sum-exp, (H_q, T_q) as torch's kernel gives it, −inf where a row has no key.
    A row with no key gives 0. Differentiable for contiguous keys; a paged call is inference
    only (an error says so if gradients are asked for).
    """
    if _plain(return_aux, window_size, softcap, alibi_slopes, sinks):
        out = flash_varlen.plain(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table,
            scale=scale, causal=causal, enable_gqa=enable_gqa,
        )  # fmt: skip
        if out is not None:
            return out
    _check_tensors(query, key, value, block_table is not None)
    paged = block_table is not None
    hq, hkv = query.shape[1], key.shape[2 if paged else 1]
    _check_heads(hq, hkv, enable_gqa)
    packing = _packing(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table)
    rules = _rules(query, scale, window_size, causal, softcap, alibi_slopes, sinks)
    want_lse = _checks.boolean("return_aux.lse", _aux_lse(return_aux))
    if paged:
        _refuse_gradients(query, key, value, alibi_slopes, sinks)
        out, lse = flash_varlen.paged(query, key, value, packing, rules)
    else:
        result = flash_varlen.packed(query, key, value, packing, rules)
        out, lse = result or one_by_one(query, key, value, packing, rules)
    return (out, lse) if want_lse else out


def one_by_one(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packing: Packing,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone, as ``qkv.attention`` runs it (causal and window bottom-right, ALiBi
    aligned the same way): the exact path where the kernel does not run."""
    window = None if rules.left is None and rules.right is None else (rules.left, rules.right)
    outs, lses = [], []
    for q0, lq, k0, lk in zip(packing.q_start, packing.q_len, packing.k_start, packing.k_len):
        if lq == 0:
            continue
        q, k, v = (
            x.transpose(0, 1) for x in (query[q0 : q0 + lq], key[k0 : k0 + lk], value[k0 : k0 + lk])
        )
        call, _ = canonical_call(
            q,
            k,
            v,
            mask=None,
            causal=False,
            scale=rules.scale,
            dropout_p=0.0,
            return_weights=False,
            backend="auto",
            softcap=rules.softcap,
            sinks=rules.sinks,
            alibi_slopes=rules.alibi_slopes,
            window=window,
            return_lse=True,
        )
        out, _, lse = dispatch.run(call, "auto")  # (H_q, lq, Dv), (H_q, lq)
        assert lse is not None
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    hq, dv = query.shape[1], value.shape[-1]
    if not outs:
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        empty = query.new_zeros(0, hq, dv)
        return empty, torch.zeros(hq, 0, dtype=lse_dtype, device=query.device)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _plain(return_aux: Any, window_size: Any, *rules: Any) -> bool:
    """Whether a call asks nothing but its lengths, causal and scale: no lse (``return_aux`` None,
    or its ``lse`` False, as ``attention_with_cache`` on a ``PagedKVCache`` asks), window (-1, -1)
    as ints, no softcap, ALiBi or sinks (``flash.varlen.plain`` then may run it)."""
    return (
        (return_aux is None or getattr(return_aux, "lse", None) is False)
        and type(window_size) is tuple
        and len(window_size) == 2
        and all(type(side) is int and side == -1 for side in window_size)
        and all(rule is None for rule in rules)
    )


def _aux_lse(return_aux: Any) -> Any:
    if return_aux is None:
        return False
    if not hasattr(return_aux, "lse"):
        raise TypeError(
            f"return_aux must be None or an AuxRequest(lse=...), got {type(return_aux).__name__}"
        )
    return return_aux.lse


def _check_tensors(query: Any, key: Any, value: Any, paged: bool) -> None:
    """query (T_q, H_q, D), key/value (T_k, H_kv, ·) or pools (P, page_size, H_kv, ·)."""
    kv_dims, kv_shape = (4, "(P, page_size, H_kv, D)") if paged else (3, "(T_k, H_kv, D)")
    _checks.tensor("query", query, ndims=(3,))
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != kv_dims:
            shape = _checks.shape_str(x.shape) if isinstance(x, torch.Tensor) else type(x)
            raise ValueError(
                f"{name} must be {kv_shape}{' with block_table' if paged else ''}, got {shape}"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.floating(name, x)
    _checks.same_dtype(("query", "key", "value"), (query, key, value))
    _checks.same_device(("query", "key", "value"), (query, key, value))
    if query.shape[-1] != key.shape[-1] or key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"query and key must share D (last dim) and key and value all but their last dim, "
            f"got query {_checks.shape_str(query.shape)}, key {_checks.shape_str(key.shape)}, "
            f"value {_checks.shape_str(value.shape)}"
        )


def _check_heads(hq: int, hkv: int, enable_gqa: Any) -> None:
    """torch's rule: H_q == H_kv, or with enable_gqa a multiple of it."""
    _checks.boolean("enable_gqa", enable_gqa)
    if not enable_gqa and hq != hkv:
        raise ValueError(
            f"query and key/value must have the same number of heads, got H_q={hq} and "
            f"H_kv={hkv}; set enable_gqa=True for grouped-query attention"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"enable_gqa needs H_q a multiple of H_kv, got H_q={hq}, H_kv={hkv}")


def _refuse_gradients(*tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        raise RuntimeError(
            "varlen_attn with block_table (a paged KV cache) is inference only and has no "
            "backward pass: run it under torch.no_grad() (or pass tensors that do not require "
            "grad), or pass contiguous keys and values to differentiate"
        )


def _rules(
    query: torch.Tensor,
    scale: Any,
    window_size: Any,
    causal: Any,
    softcap: Any,
    alibi_slopes: Any,
    sinks: Any,
) -> VarlenRules:
    """The checked score rules: scale, the window (causal folded in) and softcap/ALiBi/sinks."""
    hq = query.shape[1]
    if scale is None and query.shape[-1] == 0:
        raise ValueError("the default scale 1/sqrt(D) needs D >= 1; pass scale= explicitly")
    scale = (
        default_scale(query.shape[-1]) if scale is None else _checks.finite_float("scale", scale)
    )
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = (_window_side(f"window_size[{i}]", side) for i, side in enumerate(window_size))
    if _checks.boolean("causal", causal):
        right = 0 if right is None else min(right, 0)
    heads = (hq,)
    return VarlenRules(
        scale=scale,
        left=left,
        right=right,
        softcap=None if softcap is None else _checks.positive_float("softcap", softcap),
        alibi_slopes=None
        if alibi_slopes is None
        else _checks.head_values("alibi_slopes", alibi_slopes, query, heads, "(H_q,)"),
        sinks=None
        if sinks is None
        else _checks.head_values("sinks", sinks, query, heads, "(H_q,)"),
    )


def _window_side(name: str, value: Any) -> int | None:
    """torch's sentinel −1 (unbounded) as None, else a count of keys >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{name} must be an int >= 0, or -1 for unbounded, got {value!r}")
    return None if value == -1 else value


def _cumulative(name: str, x: Any, total: int, total_name: str) -> list[int]:
    """A cu_seq tensor (N + 1,) of int32/int64: 0 first, never decreasing, last ``total``."""
    _checks.tensor(name, x, ndims=(1,))
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {x.dtype}")
    bounds: list[int] = x.tolist()
    if not bounds or bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[:8]}")
    drops = [i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"{name} must never decrease, got {name}[{i - 1}] = {bounds[i - 1]} > "
            f"{name}[{i}] = {bounds[i]}"
        )
    if bounds[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {bounds[-1]}")
    return bounds


def _lengths(name: str, x: Any, n: int) -> list[int]:
    """An (N,) int32/int64 tensor of lengths >= 0."""
    _checks.tensor(name, x, ndims=(1,))
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {x.dtype}")
    if x.shape[0] != n:
        raise ValueError(f"{name} must have one entry per sequence, (N,) = ({n},), got {x.shape}")
    values: list[int] = x.tolist()
    if any(value < 0 for value in values):
        raise ValueError(f"{name} must be >= 0, got {values[:8]}")
    return values


def _longest(name: str, lengths: list[int], bound: Any, what: str) -> None:
    _checks.non_negative_int(name, bound)
    for i, length in enumerate(lengths):
        if length > bound:
            raise ValueError(f"{name} = {bound}, but sequence {i} has {length} {what}")


def _packing(
    query: torch.Tensor,
    key: torch.Tensor,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: Any,
    max_k: Any,
    seqused_k: Any,
    block_table: Any,
) -> Packing:
    """Where each sequence's queries and keys lie, checked against the tensors."""
    q_bounds = _cumulative("cu_seq_q", cu_seq_q, query.shape[0], "T_q (query.shape[0])")
    n = len(q_bounds) - 1
    q_lens = [b - a for a, b in itertools.pairwise(q_bounds)]
    _longest("max_q", q_lens, max_q, "queries")
    if block_table is not None:
        return _paged_packing(key, q_bounds, cu_seq_k, max_k, seqused_k, block_table)
    if cu_seq_k is None:
        raise ValueError("cu_seq_k must be given for contiguous keys (None only with block_table)")
    k_bounds = _cumulative("cu_seq_k", cu_seq_k, key.shape[0], "T_k (key.shape[0])")
    if len(k_bounds) != n + 1:
        raise ValueError(
            f"cu_seq_q and cu_seq_k must have the same length N + 1, got {n + 1} and "
            f"{len(k_bounds)}"
        )
    k_lens = [b - a for a, b in itertools.pairwise(k_bounds)]
    if seqused_k is not None:
        used = _lengths("seqused_k", seqused_k, n)
        for i, (u, length) in enumerate(zip(used, k_lens)):
            if u > length:
                raise ValueError(f"seqused_k[{i}] = {u} exceeds sequence {i}'s {length} keys")
        k_lens = used
    _longest("max_k", k_lens, max_k, "keys")
    return Packing(q_bounds[:-1], q_lens, k_bounds[:-1], k_lens, None)


def _paged_packing(
    pool: torch.Tensor,
    q_bounds: list[int],
    cu_seq_k: Any,
    max_k: Any,
    seqused_k: Any,
    block_table: Any,
) -> Packing:
    """A paged call: keys from seqused_k, each sequence's pages checked against the pool."""
    n = len(q_bounds) - 1
    _checks.tensor("block_table", block_table, ndims=(2,))
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be an int32 or int64 tensor, got {block_table.dtype}")
    if block_table.shape[0] != n:
        raise ValueError(
            f"block_table must be (N, max_pages) with N = {n}, got {block_table.shape}"
        )
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k: the keys each sequence holds in its pages")
    k_lens = _lengths("seqused_k", seqused_k, n)
    if cu_seq_k is not None:  # (the keys' lengths are seqused_k's; cu_seq_k only checked)
        _checks.tensor("cu_seq_k", cu_seq_k, ndims=(1,))
        end = int(cu_seq_k[-1]) if cu_seq_k.numel() else 0
        if len(_cumulative("cu_seq_k", cu_seq_k, end, "its end")) != n + 1:
            raise ValueError(f"cu_seq_k must have length N + 1 = {n + 1}, got {cu_seq_k.numel()}")
    _longest("max_k", k_lens, max_k, "keys")
    pages, page_size = pool.shape[0], pool.shape[1]
    if page_size == 0:
        raise ValueError(
            f"key must be a pool (P, page_size, H_kv, D) with page_size >= 1, got "
            f"{_checks.shape_str(pool.shape)}"
        )
    table = block_table.to("cpu", torch.int64)
    _check_pages(table, k_lens, pages, page_size)
    return Packing(
        q_bounds[:-1], [b - a for a, b in itertools.pairwise(q_bounds)], [0] * n, k_lens, table
    )


def _check_pages(table: torch.Tensor, k_lens: list[int], pages: int, page_size: int) -> None:
    """Every sequence holds the pages its keys need, all inside the pool (N, max_pages)."""
    held = [(length + page_size - 1) // page_size for length in k_lens]
    for i, h in enumerate(held):
        if h > table.shape[1]:
            raise ValueError(
                f"seqused_k[{i}] = {k_lens[i]} needs {h} pages of {page_size}, but "
                f"block_table holds {table.shape[1]} per sequence"
            )
    # the pages read: a few operations on the whole table (a decoding step runs them every call)
    read = table[torch.arange(table.shape[1]) < torch.tensor(held, dtype=torch.long)[:, None]]
    if read.numel() == 0 or (int(read.min()) >= 0 and int(read.max()) < pages):
        return
    for i, h in enumerate(held):
        row = table[i, :h]
        if bool(((row < 0) | (row >= pages)).any()):
            raise ValueError(
                f"block_table[{i}] points outside the pool of {pages} pages: {row.tolist()[:8]}"
            )
