"""What ``backend="auto"`` picks: every backend timed on the calls that decide the rule.

``qkv.backends.dispatch.preference`` sends a call to flash or to sdpa by its shape, mask and
dtype; each scenario below sits on one side of one of its thresholds. The table gives every
backend's median, the fastest, the backend auto picks, and the ratio of auto's time to the
fastest's (1.00: auto picked the fastest). This table is the evidence for the rule.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import qkv
from qkv.backends import dispatch
from qkv.backends.base import Call
from qkv.bench.timing import interleaved, progress, seconds
from qkv.canonical import canonical_call

BACKENDS = ("reference", "sdpa", "flash")


@dataclass(frozen=True)
class Scenario:
    """One call of ``qkv.attention``: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D)."""

    batch: int
    q_heads: int
    kv_heads: int
    queries: int
    keys: int
    dtype: str = "float32"
    causal: bool = False
    padding: float | None = None  # a padding mask keeping this fraction of the keys
    backward: bool = False
    dim: int = 64


SCENARIOS = {
    "decode: 1 query, 1024 keys, causal": Scenario(1, 8, 8, 1, 1024, causal=True),
    "decode: 1 query, 4096 keys, causal": Scenario(1, 8, 8, 1, 4096, causal=True),
    "decode, 8 sequences, grouped heads 32/8": Scenario(8, 32, 8, 1, 1024, causal=True),
    "decode: 1 query, 1024 keys, no mask": Scenario(1, 8, 8, 1, 1024),
    "chunk: 16 queries, 1024 keys, causal": Scenario(1, 8, 8, 16, 1024, causal=True),
    "chunk: 64 queries, 1024 keys, causal": Scenario(1, 8, 8, 64, 1024, causal=True),
    "T=64 causal": Scenario(1, 8, 8, 64, 64, causal=True),
    "T=64 full": Scenario(1, 8, 8, 64, 64),
    "T=64 full float16, B=4, 16 heads": Scenario(4, 16, 16, 64, 64, "float16"),
    "T=128 full bfloat16": Scenario(1, 8, 8, 128, 128, "bfloat16"),
    "T=512 full bfloat16": Scenario(1, 8, 8, 512, 512, "bfloat16"),
    "32 queries, 4096 keys, bfloat16": Scenario(1, 8, 8, 32, 4096, "bfloat16"),
    "T=256 causal": Scenario(1, 8, 8, 256, 256, causal=True),
    "T=1024 full": Scenario(1, 8, 8, 1024, 1024),
    "T=1024 causal bfloat16": Scenario(1, 8, 8, 1024, 1024, "bfloat16", causal=True),
    "T=1024 causal float16": Scenario(1, 8, 8, 1024, 1024, "float16", causal=True),
    "T=1024 causal float64": Scenario(1, 8, 8, 1024, 1024, "float64", causal=True),
    "T=1024 B=4 padding mask": Scenario(4, 8, 8, 1024, 1024, padding=0.7),
    "T=1024 grouped heads 32/8 causal": Scenario(1, 32, 8, 1024, 1024, causal=True),
    "256 queries, 2048 keys, causal": Scenario(1, 8, 8, 256, 2048, causal=True),
    "512 queries, 1024 keys, causal": Scenario(1, 8, 8, 512, 1024, causal=True),
    "T=1024 causal, forward+backward": Scenario(1, 8, 8, 1024, 1024, causal=True, backward=True),
    "T=2048 full, forward+backward": Scenario(1, 8, 8, 2048, 2048, backward=True),
}


def inputs(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """q, k, v and the keyword arguments of ``qkv.attention`` for ``scenario``."""
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, scenario.dtype)
    b, lk = scenario.batch, scenario.keys
    shapes = (
        (scenario.q_heads, scenario.queries),
        (scenario.kv_heads, lk),
        (scenario.kv_heads, lk),
    )
    q, k, v = (
        torch.randn(b, heads, length, scenario.dim, generator=generator)
        .to(dtype)
        .requires_grad_(scenario.backward)
        for heads, length in shapes
    )
    kwargs: dict[str, Any] = {"causal": scenario.causal}
    if scenario.padding is not None:
        lengths = torch.full((b,), int(scenario.padding * lk))  # the real keys of each sequence
        kwargs["mask"] = qkv.padding_mask(lengths, lk)
    return q, k, v, kwargs


def run_once(name: str, scenario: Scenario, tensors: tuple[Any, ...]) -> None:
    """One call on backend ``name`` (and its backward pass, where the scenario has one)."""
    q, k, v, kwargs = tensors
    with torch.set_grad_enabled(scenario.backward):
        out = qkv.attention(q, k, v, backend=name, **kwargs)
        if scenario.backward:
            torch.autograd.backward(out.sum())


def auto_benchmark(
    repeats: int, scenarios: dict[str, Scenario] | None = None
) -> list[dict[str, Any]]:
    """Median time of each backend on each scenario (interleaved), the fastest, and what
    ``qkv.backends.dispatch.choose`` picks for it; a progress line per scenario."""
    rows = []
    chosen = scenarios or SCENARIOS
    for number, (title, scenario) in enumerate(chosen.items(), 1):
        tensors = inputs(scenario)
        steps = {name: functools.partial(run_once, name, scenario, tensors) for name in BACKENDS}
        warm_up = max(seconds(step) for step in steps.values())
        # short calls are noisy: repeat them for about half a second per backend
        count = min(200, max(repeats, int(0.5 / max(warm_up, 1e-6))))
        times = interleaved(steps, count)
        medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        fastest = min(medians, key=medians.__getitem__)
        auto = dispatch.choose(call_of(*tensors))
        row: dict[str, Any] = {"scenario": title, "ms": medians, "fastest": fastest}
        row.update(auto=auto, auto_vs_fastest=medians[auto] / medians[fastest])
        rows.append(row)
        progress(f"[{number}/{len(chosen)}] {format_row(row)}")
    return rows


def call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]) -> Call:
    """The call ``qkv.attention(q, k, v, **kwargs)`` hands its backend (4-dim inputs)."""
    call, _ = canonical_call(
        q,
        k,
        v,
        mask=kwargs.get("mask"),
        causal=kwargs.get("causal", False),
        scale=None,
        dropout_p=0.0,
        return_weights=False,
        backend="auto",
    )
    return call


HEADER = (
    f"{'scenario':<42} {'reference':>10} {'sdpa':>10} {'flash':>10}  {'fastest':<10}"
    f"{'auto':<10}{'auto/fastest':>12}"
)


def format_row(row: dict[str, Any]) -> str:
    ms = row["ms"]
    times = " ".join(f"{ms[name]:>10.3f}" for name in BACKENDS)
    ratio = f"{row['auto_vs_fastest']:.2f}x"
    return f"{row['scenario']:<42} {times}  {row['fastest']:<10}{row['auto']:<10}{ratio:>12}"


def format_auto(rows: Sequence[dict[str, Any]]) -> str:
    """Median ms per backend, the fastest, auto's pick and its time over the fastest's."""
    lines = ["median ms per call; auto = qkv.backends.dispatch.choose", HEADER, "-" * len(HEADER)]
    return "\n".join(lines + [format_row(row) for row in rows])
