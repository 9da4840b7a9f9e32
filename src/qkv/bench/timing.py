"""Timing: interleaved repetitions, the machine's matrix-multiply rate, one progress line per case.

Timings on a shared machine drift with its load. Every implementation of a case therefore runs
in turn, repetition after repetition (the order rotated each round), so that all of them see
the same load, and results are medians; only ratios inside one run are compared.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

Clock = Callable[[], float]
Product = Callable[[torch.Tensor, torch.Tensor], Any]


def seconds(function: Callable[[], Any], clock: Clock = time.perf_counter) -> float:
    """Wall-clock seconds of one call of ``function``."""
    start = clock()
    function()
    return clock() - start


def interleaved(steps: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of every step, the steps taking turns (the order rotated by
    one each round, so that none always runs first)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(repeats):
        shift = round_ % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            times[name].append(seconds(steps[name]))
    return times


def matmul_rate(
    dtype: torch.dtype,
    budget_s: float = 0.5,
    target_s: float = 0.05,
    *,
    product: Product = torch.mm,
    clock: Clock = time.perf_counter,
) -> float:
    """GFLOP/s of this machine's (n × n) @ (n × n) product in ``dtype``, measured in about
    ``budget_s`` seconds.

    The size doubles from n = 64 while one product takes less than ``target_s`` and the next
    (eight times the work) is expected to fit in what is left of the budget; then the product of
    the last size repeats while the budget lasts, and the best time counts. A dtype the CPU has
    no units for (bfloat16 on most CPUs without AVX-512 BF16 or AMX runs below 1 GFLOP/s) thus
    stops at a small n instead of running for minutes.
    """
    started = clock()
    size, best = 32, float("inf")
    while True:
        a = torch.randn(2 * size, 2 * size).to(dtype)
        took = seconds(functools.partial(product, a, a), clock)
        size, best = 2 * size, took
        left = budget_s - (clock() - started)
        if took >= target_s or size >= 4096 or 8 * took > left:
            break
    while clock() - started + best <= budget_s:
        best = min(best, seconds(functools.partial(product, a, a), clock))
    return 2 * size**3 / max(best, 1e-12) / 1e9


def progress(message: str) -> None:
    """One line on stderr, flushed at once, so that it shows in a log as the run goes on."""
    print(message, file=sys.stderr, flush=True)
