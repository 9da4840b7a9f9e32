"""Memory: the peak resident memory a case adds, and one long causal step in a fresh process.

flash's work space is linear in T: its tiles of scores never exceed a block of queries by a
block of keys. The worker process shows that for the whole process, where a T×T score matrix
would not fit: for the plain causal call, and for a window of T/8 keys and 64 packed documents
(``window`` and ``segments`` are computed per tile, never as a (T, T) mask).
"""

from __future__ import annotations

import ctypes
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch

import qkv
from qkv.bench.cases import Shape

MIB = 2**20

# The calls memory_check measures: (T) -> the keyword arguments added to a causal call.
VARIANTS: dict[str, Callable[[int], dict[str, Any]]] = {
    "causal": lambda t: {},
    "window=T/8": lambda t: {"window": max(1, t // 8)},
    "64 packed documents": lambda t: {"segments": torch.arange(t) * 64 // t},
}


def added_memory_mib(make_step: Callable[[], Callable[[], None]]) -> float:
    """Peak resident memory (MiB) that ``make_step()`` (making the inputs) and one run of the
    step it returns added to this process; NaN where the peak cannot be reset (Linux only)."""
    release_free_memory()
    if not reset_peak_rss():
        return math.nan
    before = status_kib("VmRSS")
    make_step()()
    return (status_kib("VmHWM") - before) / 1024


def release_free_memory() -> None:
    """Give freed heap memory back to the system, so that the next case's allocations show."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Restart the process's peak resident size from its current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def process_peak_mib() -> float:
    """This process's peak resident memory so far, MiB: /proc's VmHWM, its own since it started
    (Linux); elsewhere ru_maxrss, which on Linux a process inherits from the one that started it
    where that one was larger (so a bench's worker would report its parent's size)."""
    try:
        return status_kib("VmHWM") / 1024
    except (OSError, RuntimeError):
        import resource  # Unix only

        unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / MIB


def status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS: now, VmHWM: the peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def memory_check(
    length: int, shape: Shape, threads: int | None, variant: str = "causal"
) -> dict[str, Any]:
    """Peak memory of a fresh process that runs one causal float32 forward+backward with
    backend="flash" at length T (the whole process: Python, torch, inputs, gradients), with the
    arguments of ``VARIANTS[variant]``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    spec: dict[str, Any] = {"length": length, "batch": shape.batch, "heads": shape.heads}
    spec.update(dim=shape.dim, variant=variant)
    command = [sys.executable, "-m", "qkv", "bench", "--worker", json.dumps(spec)]
    if threads is not None:
        command += ["--threads", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def peak_memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker's side of ``memory_check``: run the step, report the process's peak."""
    b, h, t, d = spec["batch"], spec["heads"], spec["length"], spec["dim"]
    variant = spec.get("variant", "causal")
    baseline = process_peak_mib()
    q, k, v, grad = (torch.randn(b, h, t, d) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    extra = VARIANTS[variant](t)
    start = time.perf_counter()
    out = qkv.attention(q, k, v, causal=True, backend="flash", **extra)
    torch.autograd.backward(out, grad)
    seconds = time.perf_counter() - start
    peak = process_peak_mib()
    tensors = 8 * q.numel() * q.element_size() / MIB  # q, k, v, grad, out, dq, dk, dv
    return {
        "length": t,
        "shape": f"B={b} H={h} T={t} D={d}",
        "dtype": "float32",
        "pass": "forward+backward",
        "causal": True,
        "variant": variant,
        "backend": "flash",
        "peak_process_mib": peak,
        "baseline_process_mib": baseline,
        "tensors_mib": tensors,
        "naive_scores_mib": b * h * t * t * 4 / MIB,
        "seconds": seconds,
    }


def format_memory_check(check: dict[str, Any]) -> str:
    variant = check.get("variant", "causal")
    called = "causal" if variant == "causal" else f"causal, {variant}"
    return (
        f"memory check: flash {called} float32 forward+backward, {check['shape']}: peak "
        f"{check['peak_process_mib']:.0f} MiB for the whole process (Python and torch alone: "
        f"{check['baseline_process_mib']:.0f} MiB; the (B, H, T, T) float32 scores alone would "
        f"take {check['naive_scores_mib']:.0f} MiB); {check['seconds']:.1f} s"
    )
