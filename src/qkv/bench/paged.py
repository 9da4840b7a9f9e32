"""``qkv bench --paged``: one decoding step against a paged KV cache, against the same step
against a contiguous cache.

64 sequences of 1,024 cached tokens, pages of 16 tokens, H_q = 32 query heads sharing H_kv = 8
key/value heads of D = 128 features, float32. The paged pool is filled a page at a time in turn
(sequence 0's first page, sequence 1's first page, …), so every sequence's pages lie scattered
through the pool as a server's would. The contiguous step is ``qkv.attention`` on (B, H_kv, S,
D) caches; the paged one ``qkv.varlen_attn`` with ``block_table``, reading pages in place.
Legend: B sequences, S cached tokens, H heads, D features.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

import qkv
from qkv.bench.timing import interleaved, progress


def paged_cache(keys: torch.Tensor, values: torch.Tensor, page_size: int) -> qkv.PagedKVCache:
    """keys, values (B, H_kv, S, D) written into a pool page by page, the sequences in turn."""
    batch, kv_heads, length, dim = keys.shape
    pages = batch * -(-length // page_size)
    cache = qkv.PagedKVCache(pages, page_size, kv_heads, dim, keys.dtype)
    for start in range(0, length, page_size):
        for b in range(batch):
            chunk = slice(start, start + page_size)
            cache.append(b, keys[b, :, chunk].transpose(0, 1), values[b, :, chunk].transpose(0, 1))
    return cache


def varlen_out(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``qkv.varlen_attn``'s output (it returns only that without ``return_aux``)."""
    out = qkv.varlen_attn(*args, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out


def paged_benchmark(
    sequences: int = 64,
    length: int = 1024,
    page_size: int = 16,
    heads: int = 32,
    kv_heads: int = 8,
    dim: int = 128,
    repeats: int = 7,
) -> dict[str, Any]:
    """Time one decoding step (one query per sequence, causal) on both caches, interleaved;
    return the medians, their ratio and the largest difference between the outputs."""
    torch.manual_seed(0)
    keys, values = (torch.randn(sequences, kv_heads, length, dim) for _ in range(2))
    query = torch.randn(sequences, heads, 1, dim)  # (B, H_q, 1, D)
    cache = paged_cache(keys, values, page_size)
    seqs = list(range(sequences))
    table, used = cache.block_table(seqs), cache.lengths(seqs)
    cu_seq_q = torch.arange(sequences + 1, dtype=torch.int32)
    packed_query = query.squeeze(2)  # (B, H_q, D): one token per sequence
    outputs: dict[str, torch.Tensor] = {}

    def contiguous() -> None:
        outputs["contiguous"] = qkv.attention(query, keys, values, causal=True)

    def paged() -> None:
        outputs["paged"] = varlen_out(
            packed_query, cache.keys, cache.values, cu_seq_q, None, 1, length, causal=True,
            enable_gqa=True, seqused_k=used, block_table=table,
        )  # fmt: skip

    progress(f"paged: {sequences} sequences of {length} tokens, pages of {page_size}")
    with torch.no_grad():
        contiguous()  # warm up
        paged()
        seconds = interleaved({"contiguous": contiguous, "paged": paged}, repeats)
    difference = float((outputs["paged"] - outputs["contiguous"].squeeze(2)).abs().max())
    contiguous_s, paged_s = (statistics.median(seconds[n]) for n in ("contiguous", "paged"))
    return {
        "sequences": sequences,
        "length": length,
        "page_size": page_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "dim": dim,
        "dtype": "float32",
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "contiguous_seconds": contiguous_s,
        "paged_seconds": paged_s,
        "contiguous_seconds_all": seconds["contiguous"],
        "paged_seconds_all": seconds["paged"],
        "paged_over_contiguous": paged_s / contiguous_s,
        "max_abs_difference": difference,
    }


def format_paged(result: dict[str, Any]) -> str:
    return (
        f"paged decoding: {result['sequences']} sequences of {result['length']} tokens, pages of "
        f"{result['page_size']}, H_q {result['heads']}, H_kv {result['kv_heads']}, D "
        f"{result['dim']}, float32, {result['threads']} threads, median of {result['repeats']}: "
        f"contiguous cache {result['contiguous_seconds'] * 1e3:.2f} ms, paged cache "
        f"{result['paged_seconds'] * 1e3:.2f} ms ({result['paged_over_contiguous']:.2f}x the "
        f"contiguous time); outputs differ by at most {result['max_abs_difference']:.1e}"
    )
