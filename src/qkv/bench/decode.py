"""Decoding: generating positions one at a time with a KV cache, against recomputing the prefix.

With a ``qkv.KVCache`` per layer, step t projects one new position, writes its keys and values
into the cache and attends one query to t + 1 keys (``qkv.SelfAttention(x, cache=...)``, which
calls ``qkv.attention_with_cache``): O(T) work per step. Without a cache, step t runs the whole
prefix of t + 1 positions through every layer again: O(T²) per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import qkv
from qkv.bench.timing import interleaved


def decoders(stack: nn.ModuleList, inputs: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The two ways to produce the outputs of ``inputs`` (1, T, E) position by position."""
    tokens = inputs.shape[1]

    def run_stack(x: torch.Tensor, caches: Sequence[qkv.KVCache] | None) -> torch.Tensor:
        for i, layer in enumerate(stack):
            x = x + layer(x, cache=None if caches is None else caches[i])  # residual stream
        return x

    def with_cache() -> torch.Tensor:
        caches = [qkv.KVCache() for _ in stack]
        return torch.cat([run_stack(inputs[:, t : t + 1], caches) for t in range(tokens)], 1)

    def recomputing() -> torch.Tensor:
        steps = [run_stack(inputs[:, : t + 1], None)[:, -1:] for t in range(tokens)]
        return torch.cat(steps, dim=1)

    return {
        "kv_cache": with_cache,
        "recompute": recomputing,
        "one_pass": lambda: run_stack(inputs, None),
    }


def decode_benchmark(
    tokens: int,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 8,
    backend: str = "auto",
    repeats: int = 3,
) -> dict[str, Any]:
    """Generate ``tokens`` positions one at a time through a stack of causal layers, (a) with a
    ``qkv.KVCache`` per layer and (b) by recomputing the whole prefix every step. Each way runs
    ``repeats`` times, the two alternating, and the medians are compared; so are the outputs,
    with each other and with one full causal pass."""
    torch.manual_seed(0)
    stack = nn.ModuleList(
        qkv.SelfAttention(d_model, heads, causal=True, backend=backend) for _ in range(layers)
    ).eval()
    ways = decoders(stack, torch.randn(1, tokens, d_model))
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[[], None]:
        return lambda: outputs.__setitem__(name, ways[name]())

    with torch.no_grad():
        seconds = interleaved({name: keep(name) for name in ("kv_cache", "recompute")}, repeats)
        full = ways["one_pass"]()
    cached, recomputed = outputs["kv_cache"], outputs["recompute"]
    cached_seconds = statistics.median(seconds["kv_cache"])
    recomputed_seconds = statistics.median(seconds["recompute"])
    return {
        "layers": layers,
        "d_model": d_model,
        "heads": heads,
        "tokens": tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "backend": backend,
        "kv_cache_seconds": cached_seconds,
        "recompute_seconds": recomputed_seconds,
        "kv_cache_seconds_all": seconds["kv_cache"],
        "recompute_seconds_all": seconds["recompute"],
        "speedup": recomputed_seconds / cached_seconds,
        "max_abs_difference": float((cached - recomputed).abs().max()),
        "max_abs_difference_vs_one_pass": float((cached - full).abs().max()),
    }


def format_decode(result: dict[str, Any]) -> str:
    return (
        f"decoding {result['tokens']} tokens, {result['layers']} causal layers (d_model "
        f"{result['d_model']}, {result['heads']} heads, {result['threads']} threads, median of "
        f"{result['repeats']}): KV cache {result['kv_cache_seconds']:.2f} s, recomputing the "
        f"prefix {result['recompute_seconds']:.2f} s: {result['speedup']:.1f}x faster; outputs "
        f"differ by at most {result['max_abs_difference']:.1e} (vs one full pass: "
        f"{result['max_abs_difference_vs_one_pass']:.1e})"
    )
