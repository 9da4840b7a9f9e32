"""``qkv bench --decode``'s first part: one decoding step against the memory wall.

A decoding step reads each sequence's whole KV cache once and does about one multiply-add per
byte, so it can run no faster than memory reads the cache. This benchmark times one query token
per sequence against a cache of B sequences × L keys for every case of ``CASES``:
``qkv.attention`` on contiguous (B, H_kv, L, D) caches, the same keys in a paged pool
(``qkv.varlen_attn`` with ``block_table``, pages of 16 filled a page per sequence in turn, so each
sequence's pages lie interleaved), and torch's SDPA on the contiguous inputs; and with each case
the machine's read bandwidth (``torch.sum`` over 2 GiB of float32), all taking turns in the same
rounds, so that each case is set against the bandwidth of its own minutes (on a shared machine
the reading moves by half within the hour). Each case prints the bytes of K and V read per
second, the bandwidth, their ratio, the paged / contiguous time and SDPA's time over qkv's.
Legend: B sequences, L cached keys, H_q / H_kv heads, D features.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F

import qkv
from qkv.bench.paged import paged_cache, varlen_out
from qkv.bench.timing import interleaved, progress

# (B, L), (H_q, H_kv), D, dtype: one decoding step per combination
SHAPES = ((1, 32768), (16, 4096), (64, 1024))
HEADS = ((32, 8), (8, 8))
DIMS = (64, 128)
DTYPES = (torch.float32, torch.bfloat16)
PAGE_SIZE = 16
BANDWIDTH_BYTES = 2 << 30
# the fewest rounds a case takes: its median is set against the bandwidth read in its own rounds
ROUNDS = 9


def decode_case(
    batch: int,
    length: int,
    heads: tuple[int, int],
    dim: int,
    dtype: torch.dtype,
    repeats: int,
    probe: torch.Tensor,
) -> dict[str, Any]:
    """One case's medians: contiguous, paged and SDPA seconds, and the bytes per second
    ``probe.sum()`` reads in the same rounds, with the outputs' difference."""
    hq, hkv = heads
    keys, values = (torch.randn(batch, hkv, length, dim, dtype=dtype) for _ in range(2))
    query = torch.randn(batch, hq, 1, dim, dtype=dtype)
    cache = paged_cache(keys, values, PAGE_SIZE)
    seqs = list(range(batch))
    pages = {"seqused_k": cache.lengths(seqs), "block_table": cache.block_table(seqs)}
    cu_seq_q = torch.arange(batch + 1, dtype=torch.int32)
    paged_args = (query.squeeze(2), cache.keys, cache.values, cu_seq_q, None, 1, length)
    outputs: dict[str, torch.Tensor] = {}
    steps = {
        "contiguous": lambda: qkv.attention(query, keys, values, causal=True),
        "paged": lambda: varlen_out(*paged_args, causal=True, enable_gqa=True, **pages),
        "sdpa": lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True),
        "bandwidth": lambda: probe.sum(),
    }

    def keep(name: str) -> Any:
        return lambda: outputs.__setitem__(name, steps[name]())

    with torch.no_grad():
        for name in steps:
            keep(name)()  # warm up
        seconds = interleaved({name: keep(name) for name in steps}, repeats)
    median = {name: statistics.median(times) for name, times in seconds.items()}
    probe_seconds = median.pop("bandwidth")
    contiguous = outputs["contiguous"].float()
    difference = max(
        float((outputs["paged"].float() - contiguous.squeeze(2)).abs().max()),
        float((outputs["sdpa"].float() - contiguous).abs().max()),
    )
    return {
        "batch": batch,
        "length": length,
        "heads": hq,
        "kv_heads": hkv,
        "dim": dim,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes": 2 * keys.numel() * keys.element_size(),
        **{f"{name}_seconds": value for name, value in median.items()},
        "bandwidth_bytes_per_second": probe.numel() * probe.element_size() / probe_seconds,
        "max_abs_difference": difference,
    }


def wall_benchmark(repeats: int = ROUNDS) -> dict[str, Any]:
    """Every case of SHAPES × HEADS × DIMS × DTYPES, each against the read bandwidth measured
    in its rounds; the median of those readings."""
    torch.manual_seed(0)
    probe = torch.ones(BANDWIDTH_BYTES // 4)
    probe.sum()  # (first touch)
    rows = []
    for dtype in DTYPES:
        for batch, length in SHAPES:
            for heads in HEADS:
                for dim in DIMS:
                    progress(f"decode: B {batch} × L {length}, heads {heads}, D {dim}, {dtype}")
                    row = decode_case(batch, length, heads, dim, dtype, repeats, probe)
                    rate = row["kv_bytes"] / row["contiguous_seconds"]
                    row["percent_of_bandwidth"] = 100 * rate / row["bandwidth_bytes_per_second"]
                    row["paged_over_contiguous"] = row["paged_seconds"] / row["contiguous_seconds"]
                    row["speedup_vs_sdpa"] = row["sdpa_seconds"] / row["contiguous_seconds"]
                    rows.append(row)
    lowest = {
        name: min(r["percent_of_bandwidth"] for r in rows if r["dtype"] == name)
        for name in ("float32", "bfloat16")
    }
    return {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "page_size": PAGE_SIZE,
        "bandwidth_bytes_per_second": statistics.median(
            r["bandwidth_bytes_per_second"] for r in rows
        ),
        "cases": rows,
        "lowest_percent_of_bandwidth": lowest,
        "highest_paged_over_contiguous": max(r["paged_over_contiguous"] for r in rows),
    }


def format_wall(result: dict[str, Any]) -> str:
    lines = [
        f"decoding, one query token per sequence ({result['threads']} threads, median of "
        f"{result['repeats']}); read bandwidth (torch.sum over 2 GiB, in each case's rounds): "
        f"median {result['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s",
        "  dtype     B × L        H_q/H_kv  D    K+V GB/s   bw GB/s  of bw  paged/contig  vs sdpa",
    ]
    for r in result["cases"]:
        rate = r["kv_bytes"] / r["contiguous_seconds"] / 1e9
        shape = f"{r['batch']} × {r['length']}"
        lines.append(
            f"  {r['dtype']:<9} {shape:<12} {r['heads']:>3}/{r['kv_heads']:<5} {r['dim']:<4} "
            f"{rate:8.1f}  {r['bandwidth_bytes_per_second'] / 1e9:8.1f}  "
            f"{r['percent_of_bandwidth']:4.0f} %  {r['paged_over_contiguous']:11.2f}x"
            f"  {r['speedup_vs_sdpa']:6.2f}x"
        )
    low = result["lowest_percent_of_bandwidth"]
    lines.append(
        f"lowest share of the bandwidth: float32 {low['float32']:.0f} %, bfloat16 "
        f"{low['bfloat16']:.0f} %; paged at most {result['highest_paged_over_contiguous']:.2f}x "
        "the contiguous time"
    )
    return "\n".join(lines)
