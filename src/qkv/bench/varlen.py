"""``qkv bench --varlen``: a packed batch of sequences of different lengths in one
``qkv.varlen_attn`` call, against the same batch padded to the longest through ``qkv.attention``
with a padding mask.

16 sequences of lengths spread geometrically from 64 to 4,096 tokens, causal, float32. The
packed call computes each sequence's own causal triangle; the padded batch computes 16 squares
of the longest length (its padding masked out). Both outputs are compared on the real tokens.
Legend: N sequences, T packed tokens, L longest length, H heads, D features.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import torch

import qkv
from qkv.backends import dispatch
from qkv.bench.paged import varlen_out
from qkv.bench.timing import interleaved, progress
from qkv.canonical import canonical_call


def lengths(sequences: int = 16, shortest: int = 64, longest: int = 4096) -> list[int]:
    """``sequences`` lengths from ``shortest`` to ``longest``, evenly spread on a log scale."""
    if sequences == 1:
        return [longest]
    ratio = (longest / shortest) ** (1 / (sequences - 1))
    return [round(shortest * ratio**i) for i in range(sequences)]


def pad(packed: tuple[torch.Tensor, ...], cu_seq: torch.Tensor, longest: int) -> list[torch.Tensor]:
    """Each (T, H, D) tensor as (N, H, L, D): sequence i in row i, zeros after its end."""
    bounds = cu_seq.tolist()
    out = [torch.zeros(len(bounds) - 1, x.shape[1], longest, x.shape[2]) for x in packed]
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        for dense, x in zip(out, packed):
            dense[i, :, : end - start] = x[start:end].transpose(0, 1)
    return out


def varlen_benchmark(
    heads: int = 8,
    dim: int = 64,
    repeats: int = 3,
    sequences: int = 16,
    shortest: int = 64,
    longest: int = 4096,
) -> dict[str, Any]:
    """Time the packed call and the padded one (forward, float32, causal), interleaved; return
    their medians, the speed-up and the largest difference on real tokens."""
    torch.manual_seed(0)
    sizes = lengths(sequences, shortest, longest)
    total, longest = sum(sizes), max(sizes)
    q, k, v = (torch.randn(total, heads, dim) for _ in range(3))  # (T, H, D) packed
    cu_seq = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    padded = pad((q, k, v), cu_seq, longest)  # (N, H, L, D) each
    real = qkv.padding_mask(torch.tensor(sizes), longest)  # (N, 1, 1, L), True = real token
    outputs: dict[str, torch.Tensor] = {}
    spans = list(enumerate(itertools.pairwise(cu_seq.tolist())))

    def packed_call() -> None:
        outputs["packed"] = varlen_out(q, k, v, cu_seq, cu_seq, longest, longest, causal=True)

    def padded_call() -> None:
        outputs["padded"] = qkv.attention(*padded, mask=real, causal=True)

    call, _ = canonical_call(
        *padded, mask=real, causal=True, scale=None, dropout_p=0.0, return_weights=False,
        backend="auto",
    )  # fmt: skip
    progress(f"varlen: {len(sizes)} sequences of {sizes[0]}..{longest} tokens, {repeats} rounds")
    with torch.no_grad():
        packed_call()  # warm up (the first call loads the kernel)
        seconds = interleaved({"packed": packed_call, "padded": padded_call}, repeats)
    unpadded = [outputs["padded"][i, :, : b - a].transpose(0, 1) for i, (a, b) in spans]
    difference = float((outputs["packed"] - torch.cat(unpadded)).abs().max())  # real tokens
    packed_s, padded_s = (statistics.median(seconds[name]) for name in ("packed", "padded"))
    return {
        "lengths": sizes,
        "heads": heads,
        "dim": dim,
        "dtype": "float32",
        "causal": True,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "packed_seconds": packed_s,
        "padded_seconds": padded_s,
        "packed_seconds_all": seconds["packed"],
        "padded_seconds_all": seconds["padded"],
        "speedup": padded_s / packed_s,
        "padded_backend": dispatch.choose(call),  # what "auto" runs the padded batch on
        "max_abs_difference": difference,
    }


def format_varlen(result: dict[str, Any]) -> str:
    sizes = result["lengths"]
    return (
        f"varlen: {len(sizes)} sequences of {sizes[0]} to {sizes[-1]} tokens ({sum(sizes)} in "
        f"all), causal float32, H {result['heads']}, D {result['dim']}, {result['threads']} "
        f"threads, median of {result['repeats']}: packed qkv.varlen_attn "
        f"{result['packed_seconds'] * 1e3:.1f} ms, padded to {sizes[-1]} through qkv.attention "
        f"with a padding mask (backend {result.get('padded_backend', 'auto')}) "
        f"{result['padded_seconds'] * 1e3:.1f} ms: {result['speedup']:.1f}x "
        f"faster; outputs differ by at most {result['max_abs_difference']:.1e}"
    )
