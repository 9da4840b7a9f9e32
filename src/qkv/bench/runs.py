"""The functional and module cases: one step per implementation, timed in turns.

PyTorch is ``torch.nn.functional.scaled_dot_product_attention`` at the functional level and
``torch.nn.MultiheadAttention`` (no biases) at the module level, where qkv runs
``qkv.SelfAttention``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

import qkv
from qkv.backends.base import Unsupported
from qkv.bench.cases import DTYPES, TORCH, Case, Result, Shape
from qkv.bench.memory import added_memory_mib
from qkv.bench.timing import interleaved, progress, seconds


@dataclass(frozen=True)
class Settings:
    """How each case is run."""

    repeats: int  # timed repetitions per implementation
    max_case_seconds: float  # fewer repetitions (at least 3) for cases that would take longer
    reference_max_length: int  # the reference backend holds T×T scores: skipped above this T
    memory: bool  # measure each case's added peak memory (one more run of it)


def measure(
    cases: Sequence[Case],
    backends: Sequence[str],
    shape: Shape,
    settings: Settings,
    matmul_gflops: dict[str, float],
) -> list[Result]:
    """Time every case on PyTorch and on each of ``backends``; a progress line per case."""
    results = []
    for number, case in enumerate(cases, 1):
        rows = time_case(case, [TORCH, *backends], shape, settings)
        for row in rows:
            if row.skipped is None and settings.memory:
                make = functools.partial(make_step, case, row.implementation, shape)
                row.memory_mib = added_memory_mib(make)
        compare(rows, shape, matmul_gflops[case.dtype])
        progress(f"[{number}/{len(cases)}] {case.label()}: " + summary(rows))
        results += rows
    return results


def compare(rows: Sequence[Result], shape: Shape, matmul_gflops: float) -> None:
    """Fill in each row's GFLOP/s, its ratio to PyTorch and its share of the matmul rate."""
    torch_ms = next(r.median_ms for r in rows if r.implementation == TORCH)
    for row in rows:
        if row.skipped is None:
            row.gflops = shape.flops(row.case) / (row.median_ms / 1e3) / 1e9
            row.vs_torch = torch_ms / row.median_ms
            row.percent_of_matmul = 100 * row.gflops / matmul_gflops


def summary(rows: Sequence[Result]) -> str:
    """``torch 1.20 ms, flash 0.90 ms (1.33x), ...``: the progress line's figures."""
    parts = []
    for row in rows:
        if row.skipped is not None:
            parts.append(f"{row.implementation} skipped")
        elif row.implementation == TORCH or math.isnan(row.vs_torch):
            parts.append(f"{row.implementation} {row.median_ms:.2f} ms")
        else:
            parts.append(f"{row.implementation} {row.median_ms:.2f} ms ({row.vs_torch:.2f}x)")
    return ", ".join(parts)


def time_case(
    case: Case, implementations: Sequence[str], shape: Shape, settings: Settings
) -> list[Result]:
    """Medians of interleaved repetitions of every implementation of ``case``."""
    results = {name: Result(case, name) for name in implementations}
    steps: dict[str, Callable[[], None]] = {}
    for name in implementations:
        if name == "reference" and case.length > settings.reference_max_length:
            limit = settings.reference_max_length
            results[name].skipped = f"T > --reference-max-length {limit}"
            continue
        steps[name] = make_step(case, name, shape)
    warm_up = 0.0  # first calls are not measured
    for name, step in list(steps.items()):
        try:
            warm_up += seconds(step)
        except Unsupported as refused:  # e.g. the reference's scores would not fit in memory
            results[name].skipped = str(refused)
            del steps[name]
    # Long cases get fewer repetitions (but at least 3, for a median) to bound the run time.
    repeats = min(settings.repeats, max(3, int(settings.max_case_seconds / max(warm_up, 1e-9))))
    for name, times in interleaved(steps, repeats).items():
        results[name].seconds = times
    return list(results.values())


def make_step(case: Case, implementation: str, shape: Shape) -> Callable[[], None]:
    """A function that runs the case once with ``implementation`` on fixed random inputs."""
    dtype = DTYPES[case.dtype]
    generator = torch.Generator().manual_seed(0)
    backward = case.pass_ == "forward+backward"
    b, h, t, d = shape.batch, shape.heads, case.length, shape.dim
    if case.level == "functional":
        q, k, v, grad = (torch.randn(b, h, t, d, generator=generator).to(dtype) for _ in range(4))
        inputs: tuple[torch.Tensor, ...] = (q, k, v)
        forward = functional_forward(case, implementation, q, k, v)
    else:
        x, grad = (torch.randn(b, t, shape.d_model, generator=generator).to(dtype) for _ in "xg")
        inputs = (x,)
        forward = module_forward(case, implementation, shape, x)
    for tensor in inputs:
        tensor.requires_grad_(backward)

    def step() -> None:
        if not backward:
            with torch.no_grad():
                forward()
            return
        for tensor in inputs:
            tensor.grad = None
        torch.autograd.backward(forward(), grad)

    return step


def functional_forward(
    case: Case, implementation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """Attention alone: ``qkv.attention`` or torch's ``scaled_dot_product_attention``."""
    if implementation == TORCH:
        return lambda: nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return lambda: qkv.attention(q, k, v, causal=case.causal, backend=implementation)


def module_forward(
    case: Case, implementation: str, shape: Shape, x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """A layer with its projections: ``qkv.SelfAttention`` or ``torch.nn.MultiheadAttention``."""
    dtype = DTYPES[case.dtype]
    torch.manual_seed(0)
    if implementation != TORCH:
        module = qkv.SelfAttention(
            shape.d_model, shape.heads, causal=case.causal, backend=implementation
        ).to(dtype)
        return lambda: module(x)
    layer = nn.MultiheadAttention(shape.d_model, shape.heads, bias=False, batch_first=True)
    layer = layer.to(dtype).eval()
    # torch's attn_mask convention: True = blocked (the opposite of qkv's)
    blocked = ~qkv.causal_mask(case.length) if case.causal else None

    def forward() -> torch.Tensor:
        out, _ = layer(x, x, x, attn_mask=blocked, need_weights=False, is_causal=case.causal)
        assert isinstance(out, torch.Tensor)
        return out

    return forward
