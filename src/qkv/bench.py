"""``qkv bench``: qkv's attention backends against PyTorch's, measured in one run.

For every case (functional or module level; forward or forward+backward; float32 or bfloat16;
causal or not; sequence length T) each implementation runs in turn, repetition after repetition,
so that all of them see the same machine load; the table gives medians. "vs torch" is PyTorch's
median time divided by qkv's (above 1: qkv is faster). PyTorch is
``torch.nn.functional.scaled_dot_product_attention`` at the functional level and
``torch.nn.MultiheadAttention`` at the module level. "% mm" compares the case's GFLOP/s with
this machine's matrix-multiply rate in the same dtype, measured at the start of the run.
"MiB" is the peak resident memory the case added to the process (inputs, outputs, gradients and
work space), measured in a separate pass.

    qkv bench                                   # everything: T = 256 ... 16384
    qkv bench --lengths 1024,4096 --dtypes float32 --passes forward --levels functional
    qkv bench --quick                           # a small subset in about a minute
    qkv bench --json out.json --plot out.png    # record the results
    qkv bench --decode                          # KV-cache decoding vs recomputing the prefix
    qkv bench --memory-check                    # peak memory of a T = 32768 causal step
    qkv bench --auto                            # the calls that decide what "auto" picks

Legend: B batch, H heads, T sequence length (queries = keys), D features per head, E = H·D.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import qkv
from qkv.backends.base import Call
from qkv.canonical import canonical_call

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PASSES = ("forward", "forward+backward")
LEVELS = ("functional", "module")
IMPLEMENTATIONS = ("flash", "reference", "sdpa", "auto")
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
TORCH = "torch"  # the name of PyTorch's own implementation in results
MIB = 2**20


@dataclass(frozen=True)
class Case:
    """One configuration to measure."""

    level: str  # "functional" (attention only) or "module" (with the projections)
    pass_: str  # "forward" or "forward+backward"
    dtype: str
    causal: bool
    length: int  # T: queries = keys

    def label(self) -> str:
        return (
            f"{self.level} {self.pass_} {self.dtype} {'causal' if self.causal else 'full'} "
            f"T={self.length}"
        )


@dataclass
class Shape:
    batch: int
    heads: int
    dim: int

    @property
    def d_model(self) -> int:
        return self.heads * self.dim

    def flops(self, case: Case) -> float:
        """Floating-point operations of a case, counting the pairs of positions that may attend.

        Forward attention is two products of 2·pairs·D operations per head (Q Kᵀ and P V); the
        backward pass is 2.5 times the forward (five such products). The module level adds the
        four E×E projections of every position (forward), times three with the backward pass.
        """
        t = case.length
        pairs = t * (t + 1) / 2 if case.causal else t * t
        attention = 4 * self.batch * self.heads * pairs * self.dim
        projections = 4 * 2 * self.batch * t * self.d_model**2 if case.level == "module" else 0
        factor = 1.0 if case.pass_ == "forward" else 3.5
        return factor * attention + (1 if case.pass_ == "forward" else 3) * projections


@dataclass
class Result:
    case: Case
    implementation: str  # a qkv backend, or "torch"
    seconds: list[float] = field(default_factory=list)
    gflops: float = math.nan
    vs_torch: float = math.nan  # torch's median time / this one's
    percent_of_matmul: float = math.nan
    memory_mib: float = math.nan  # peak resident memory the case added
    skipped: str | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3 if self.seconds else math.nan

    def as_json(self) -> dict[str, Any]:
        data = {**asdict(self.case), "implementation": self.implementation}
        data["pass"] = data.pop("pass_")
        data.update(
            median_ms=_finite(self.median_ms),
            all_ms=[s * 1e3 for s in self.seconds],
            gflops=_finite(self.gflops),
            vs_torch=_finite(self.vs_torch),
            percent_of_matmul=_finite(self.percent_of_matmul),
            memory_mib=_finite(self.memory_mib),
            skipped=self.skipped,
        )
        return data


# --- command line --------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "Ratios are medians of interleaved repetitions in one run; run on an otherwise idle "
        "machine for stable numbers."
    )
    parser.add_argument(
        "--lengths",
        type=_int_list,
        default=DEFAULT_LENGTHS,
        help="sequence lengths T, comma-separated (default: 256,512,...,16384)",
    )
    parser.add_argument(
        "--dtypes", type=_choices(DTYPES), default=tuple(DTYPES), help="float32,bfloat16 (both)"
    )
    parser.add_argument(
        "--passes", type=_choices(PASSES), default=PASSES, help="forward,forward+backward (both)"
    )
    parser.add_argument(
        "--levels",
        type=_choices(LEVELS),
        default=LEVELS,
        help="functional (attention vs SDPA), module (SelfAttention vs MultiheadAttention)",
    )
    parser.add_argument(
        "--causal",
        choices=("both", "yes", "no"),
        default="both",
        help="causal cases (default both)",
    )
    parser.add_argument(
        "--backends",
        type=_choices(IMPLEMENTATIONS),
        default=("flash", "reference"),
        help="qkv backends to measure, comma-separated (default: flash,reference)",
    )
    parser.add_argument("--batch", type=_positive, default=1, help="B (default 1)")
    parser.add_argument("--heads", type=_positive, default=8, help="H (default 8)")
    parser.add_argument("--dim", type=_positive, default=64, help="D per head (default 64)")
    parser.add_argument("--repeats", type=_positive, default=5, help="timed repetitions (5)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--reference-max-length",
        type=int,
        default=4096,
        help="skip the reference backend above this T: it holds T×T scores (default 4096)",
    )
    parser.add_argument(
        "--max-case-seconds",
        type=float,
        default=60.0,
        help="fewer repetitions (at least 3) for cases that would take longer (default 60)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="T = 256 and 2048, 3 repetitions, no memory pass: a quick look",
    )
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: time and memory vs T")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="only: decode token by token with a KV cache vs recomputing the prefix each step",
    )
    parser.add_argument("--decode-tokens", type=int, default=512, help="tokens to decode")
    parser.add_argument(
        "--auto",
        action="store_true",
        help='only: time every backend on the calls that decide what backend="auto" picks',
    )
    parser.add_argument(
        "--memory-check",
        type=int,
        nargs="?",
        const=32768,
        default=None,
        metavar="T",
        help="only: peak memory of a fresh process running one causal float32 forward+backward "
        "of backend flash at length T (default 32768)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = Shape(args.batch, args.heads, args.dim)
    if args.worker is not None:
        print(json.dumps(_peak_memory_worker(json.loads(args.worker))))
        return 0
    report: dict[str, Any] = {"machine": machine(), "shape": asdict(shape)}
    if args.memory_check is not None:
        report["memory_check"] = memory_check(args.memory_check, shape, args.threads)
        _print_memory_check(report["memory_check"])
    elif args.decode:
        report["decode"] = decode_benchmark(args.decode_tokens, repeats=args.repeats)
        _print_decode(report["decode"])
    elif args.auto:
        report["auto"] = auto_benchmark(args.repeats)
        print(_format_auto(report["auto"]))
    else:
        if args.quick:
            args.lengths, args.repeats, args.no_memory = (256, 2048), 3, True
        cases = make_cases(args)
        report["matmul_gflops"] = matmul_rates(args.dtypes)
        results = measure(cases, args.backends, shape, args, report["matmul_gflops"])
        report["results"] = [r.as_json() for r in results]
        print(format_table(results, report))
        if args.plot:
            plot(results, args.plot)
    if args.json:
        previous = {}
        if os.path.exists(args.json):
            with open(args.json) as existing:
                previous = json.load(existing)
        with open(args.json, "w") as out:
            json.dump({**previous, **report}, out, indent=1)
            out.write("\n")
    return 0


def make_cases(args: argparse.Namespace) -> list[Case]:
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [
        Case(level, pass_, dtype, is_causal, length)
        for level in args.levels
        for pass_ in args.passes
        for dtype in args.dtypes
        for is_causal in causal
        for length in args.lengths
    ]


# --- measuring -----------------------------------------------------------------------------------


def measure(
    cases: Sequence[Case],
    backends: Sequence[str],
    shape: Shape,
    args: argparse.Namespace,
    matmul: dict[str, float],
) -> list[Result]:
    """Time every case (and measure its memory unless args.no_memory)."""
    implementations = [TORCH, *backends]
    results = []
    steps = len(cases) * (1 if args.no_memory else 2)
    with _progress(steps) as advance:
        for case in cases:
            advance(f"timing {case.label()}")
            results += _time_case(case, implementations, shape, args)
        if not args.no_memory:
            for case in cases:
                advance(f"memory {case.label()}")
                for result in results:
                    if result.case == case and result.skipped is None:
                        result.memory_mib = _added_memory_mib(case, result.implementation, shape)
    for result in results:
        if result.skipped is not None:
            continue
        torch_result = next(
            r for r in results if r.case == result.case and r.implementation == TORCH
        )
        seconds = result.median_ms / 1e3
        result.gflops = shape.flops(result.case) / seconds / 1e9
        result.vs_torch = torch_result.median_ms / result.median_ms
        result.percent_of_matmul = 100 * result.gflops / matmul[result.case.dtype]
    return results


def _time_case(
    case: Case, implementations: Sequence[str], shape: Shape, args: argparse.Namespace
) -> list[Result]:
    results = {name: Result(case, name) for name in implementations}
    steps: dict[str, Callable[[], None]] = {}
    for name in implementations:
        if name == "reference" and case.length > args.reference_max_length:
            results[name].skipped = f"T > --reference-max-length {args.reference_max_length}"
            continue
        steps[name] = make_step(case, name, shape)
    warm_up = sum(_seconds(step) for step in steps.values())  # first calls are not measured
    # Long cases get fewer repetitions (but at least 3, for a median) to bound the run time.
    repeats = min(args.repeats, max(3, int(args.max_case_seconds / max(warm_up, 1e-9))))
    for round_ in range(repeats):
        names = list(steps)
        names = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate the order
        for name in names:
            start = time.perf_counter()
            steps[name]()
            results[name].seconds.append(time.perf_counter() - start)
    return list(results.values())


def make_step(case: Case, implementation: str, shape: Shape) -> Callable[[], None]:
    """A function that runs the case once with ``implementation`` on fixed random inputs."""
    dtype = DTYPES[case.dtype]
    generator = torch.Generator().manual_seed(0)
    backward = case.pass_ == "forward+backward"
    b, h, t, d = shape.batch, shape.heads, case.length, shape.dim
    if case.level == "functional":
        q, k, v = (torch.randn(b, h, t, d, generator=generator).to(dtype) for _ in range(3))
        grad = torch.randn(b, h, t, d, generator=generator).to(dtype)
        for x in (q, k, v):
            x.requires_grad_(backward)

        def forward() -> torch.Tensor:
            if implementation == TORCH:
                return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
            return qkv.attention(q, k, v, causal=case.causal, backend=implementation)

        inputs: tuple[torch.Tensor, ...] = (q, k, v)
    else:
        x = torch.randn(b, t, shape.d_model, generator=generator).to(dtype).requires_grad_(backward)
        grad = torch.randn(b, t, shape.d_model, generator=generator).to(dtype)
        forward = _module_forward(case, implementation, shape, x)
        inputs = (x,)

    def step() -> None:
        if not backward:
            with torch.no_grad():
                forward()
            return
        for x in inputs:
            x.grad = None
        torch.autograd.backward(forward(), grad)

    return step


def _module_forward(
    case: Case, implementation: str, shape: Shape, x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    dtype = DTYPES[case.dtype]
    torch.manual_seed(0)
    if implementation == TORCH:
        layer = nn.MultiheadAttention(shape.d_model, shape.heads, bias=False, batch_first=True)
        layer = layer.to(dtype).eval()
        # torch's attn_mask convention: True = blocked (the opposite of qkv's)
        blocked = ~qkv.causal_mask(case.length) if case.causal else None

        def forward() -> torch.Tensor:
            out, _ = layer(x, x, x, attn_mask=blocked, need_weights=False, is_causal=case.causal)
            assert isinstance(out, torch.Tensor)
            return out

        return forward
    module = qkv.SelfAttention(
        shape.d_model, shape.heads, causal=case.causal, backend=implementation
    ).to(dtype)
    return lambda: module(x)


# --- memory --------------------------------------------------------------------------------------


def _added_memory_mib(case: Case, implementation: str, shape: Shape) -> float:
    """Peak resident memory (MiB) that making the inputs and running the case once added to
    this process; NaN where the peak cannot be reset (Linux only)."""
    _release_free_memory()
    if not _reset_peak_rss():
        return math.nan
    before = _status_kib("VmRSS")
    step = make_step(case, implementation, shape)
    step()
    peak = _status_kib("VmHWM")
    return (peak - before) / 1024


def _release_free_memory() -> None:
    """Give freed heap memory back to the system, so that the next case's allocations show."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    """Restart the process's peak resident size from its current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def memory_check(length: int, shape: Shape, threads: int | None) -> dict[str, Any]:
    """Peak memory of a fresh process that runs one causal float32 forward+backward with
    backend="flash" at length T (the whole process: Python, torch, inputs, gradients)."""
    spec = {"length": length, **asdict(shape)}
    command = [sys.executable, "-m", "qkv", "bench", "--worker", json.dumps(spec)]
    if threads is not None:
        command += ["--threads", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def _peak_memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import resource

    b, h, t, d = spec["batch"], spec["heads"], spec["length"], spec["dim"]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q, k, v, grad = (torch.randn(b, h, t, d) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    start = time.perf_counter()
    torch.autograd.backward(qkv.attention(q, k, v, causal=True, backend="flash"), grad)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    tensors = 8 * q.numel() * q.element_size() / MIB  # q, k, v, grad, out, dq, dk, dv
    return {
        "length": t,
        "shape": f"B={b} H={h} T={t} D={d}",
        "dtype": "float32",
        "pass": "forward+backward",
        "causal": True,
        "backend": "flash",
        "peak_process_mib": peak,
        "baseline_process_mib": baseline,
        "tensors_mib": tensors,
        "naive_scores_mib": b * h * t * t * 4 / MIB,
        "seconds": seconds,
    }


def _print_memory_check(check: dict[str, Any]) -> None:
    print(
        f"memory check: flash causal float32 forward+backward, {check['shape']}: peak "
        f"{check['peak_process_mib']:.0f} MiB for the whole process (Python and torch alone: "
        f"{check['baseline_process_mib']:.0f} MiB; the (B, H, T, T) float32 scores alone would "
        f"take {check['naive_scores_mib']:.0f} MiB); {check['seconds']:.1f} s"
    )


# --- decoding ------------------------------------------------------------------------------------


def decode_benchmark(
    tokens: int,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 8,
    backend: str = "auto",
    repeats: int = 3,
) -> dict[str, Any]:
    """Generate ``tokens`` positions one at a time through a stack of causal layers, (a) with a
    ``qkv.KVCache`` per layer (each step attends one new query to the cache) and (b) by
    recomputing the whole prefix every step. Each way runs ``repeats`` times, the two
    alternating, and the medians are compared; so are the outputs."""
    torch.manual_seed(0)
    stack = nn.ModuleList(
        qkv.SelfAttention(d_model, heads, causal=True, backend=backend) for _ in range(layers)
    ).eval()
    inputs = torch.randn(1, tokens, d_model)

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

    seconds: dict[str, list[float]] = {"kv_cache": [], "recompute": []}
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(repeats):
            for name, decode in (("kv_cache", with_cache), ("recompute", recomputing)):
                start = time.perf_counter()
                outputs[name] = decode()
                seconds[name].append(time.perf_counter() - start)
        full = run_stack(inputs, None)
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
        "kv_cache_seconds": cached_seconds,
        "recompute_seconds": recomputed_seconds,
        "kv_cache_seconds_all": seconds["kv_cache"],
        "recompute_seconds_all": seconds["recompute"],
        "speedup": recomputed_seconds / cached_seconds,
        "max_abs_difference": float((cached - recomputed).abs().max()),
        "max_abs_difference_vs_one_pass": float((cached - full).abs().max()),
        "backend": backend,
    }


def _print_decode(result: dict[str, Any]) -> None:
    print(
        f"decoding {result['tokens']} tokens, {result['layers']} causal layers (d_model "
        f"{result['d_model']}, {result['heads']} heads, {result['threads']} threads, median of "
        f"{result['repeats']}): KV cache {result['kv_cache_seconds']:.2f} s, recomputing the "
        f"prefix {result['recompute_seconds']:.2f} s: "
        f"{result['speedup']:.1f}x faster; outputs differ by at most "
        f"{result['max_abs_difference']:.1e} (vs one full pass: "
        f"{result['max_abs_difference_vs_one_pass']:.1e})"
    )


# --- what "auto" picks ---------------------------------------------------------------------------

# name -> (B, Hq, Hkv, Lq, Lk, D, dtype, keyword arguments of qkv.attention, with backward)
AUTO_SCENARIOS: dict[str, tuple[int, int, int, int, int, int, str, dict[str, Any], bool]] = {
    "decode: 1 query, 1024 keys, causal": (
        1,
        8,
        8,
        1,
        1024,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "decode: 1 query, 4096 keys, causal": (
        1,
        8,
        8,
        1,
        4096,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "decode, 8 sequences, grouped heads 32/8": (
        8,
        32,
        8,
        1,
        1024,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "decode: 1 query, 1024 keys, no mask": (1, 8, 8, 1, 1024, 64, "float32", {}, False),
    "chunk: 16 queries, 1024 keys, causal": (
        1,
        8,
        8,
        16,
        1024,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "chunk: 64 queries, 1024 keys, causal": (
        1,
        8,
        8,
        64,
        1024,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "T=64 causal": (1, 8, 8, 64, 64, 64, "float32", {"causal": True}, False),
    "T=64 full": (1, 8, 8, 64, 64, 64, "float32", {}, False),
    "T=64 full float16, B=4, 16 heads": (4, 16, 16, 64, 64, 64, "float16", {}, False),
    "T=128 full bfloat16": (1, 8, 8, 128, 128, 64, "bfloat16", {}, False),
    "T=512 full bfloat16": (1, 8, 8, 512, 512, 64, "bfloat16", {}, False),
    "32 queries, 4096 keys, bfloat16": (1, 8, 8, 32, 4096, 64, "bfloat16", {}, False),
    "T=256 causal": (1, 8, 8, 256, 256, 64, "float32", {"causal": True}, False),
    "T=1024 full": (1, 8, 8, 1024, 1024, 64, "float32", {}, False),
    "T=1024 causal bfloat16": (1, 8, 8, 1024, 1024, 64, "bfloat16", {"causal": True}, False),
    "T=1024 causal float16": (1, 8, 8, 1024, 1024, 64, "float16", {"causal": True}, False),
    "T=1024 causal float64": (1, 8, 8, 1024, 1024, 64, "float64", {"causal": True}, False),
    "T=1024 B=4 padding mask": (4, 8, 8, 1024, 1024, 64, "float32", {"padding": 0.7}, False),
    "T=1024 grouped heads 32/8 causal": (
        1,
        32,
        8,
        1024,
        1024,
        64,
        "float32",
        {"causal": True},
        False,
    ),
    "256 queries, 2048 keys, causal": (1, 8, 8, 256, 2048, 64, "float32", {"causal": True}, False),
    "512 queries, 1024 keys, causal": (1, 8, 8, 512, 1024, 64, "float32", {"causal": True}, False),
    "T=1024 causal, forward+backward": (1, 8, 8, 1024, 1024, 64, "float32", {"causal": True}, True),
    "T=2048 full, forward+backward": (1, 8, 8, 2048, 2048, 64, "float32", {}, True),
}


def auto_benchmark(repeats: int, scenarios: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Median time of each backend on each scenario (interleaved), the fastest, and what
    ``qkv.backends.dispatch.choose`` picks for it."""
    rows = []
    names = ("reference", "sdpa", "flash")
    for title, scenario in _progress_items(scenarios or AUTO_SCENARIOS):
        b, hq, hkv, lq, lk, d, dtype_name, kwargs, backward = scenario
        generator = torch.Generator().manual_seed(0)
        dtype = getattr(torch, dtype_name)
        q = torch.randn(b, hq, lq, d, generator=generator).to(dtype).requires_grad_(backward)
        k = torch.randn(b, hkv, lk, d, generator=generator).to(dtype).requires_grad_(backward)
        v = torch.randn(b, hkv, lk, d, generator=generator).to(dtype).requires_grad_(backward)
        kwargs = dict(kwargs)
        if "padding" in kwargs:
            lengths = torch.full((b,), int(kwargs.pop("padding") * lk))  # a fraction are real
            kwargs["mask"] = qkv.padding_mask(lengths, lk)

        def step(
            name: str,
            q: torch.Tensor = q,
            k: torch.Tensor = k,
            v: torch.Tensor = v,
            kwargs: dict[str, Any] = kwargs,
            backward: bool = backward,
        ) -> None:
            with torch.set_grad_enabled(backward):
                out = qkv.attention(q, k, v, backend=name, **kwargs)
                if backward:
                    torch.autograd.backward(out.sum())

        times: dict[str, list[float]] = {name: [] for name in names}
        warm_up = max(_seconds(functools.partial(step, name)) for name in names)
        # short calls are noisy: repeat them for about half a second per backend
        for _ in range(min(200, max(repeats, int(0.5 / max(warm_up, 1e-6))))):
            for name in names:
                times[name].append(_seconds(functools.partial(step, name)))
        medians = {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}
        call = _call_of(q, k, v, kwargs)
        rows.append(
            {
                "scenario": title,
                "ms": medians,
                "fastest": min(medians.items(), key=lambda item: item[1])[0],
                "auto": qkv.backends.dispatch.choose(call),
            }
        )
    return rows


def _call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]) -> Call:
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


def _format_auto(rows: Sequence[dict[str, Any]]) -> str:
    header = f"{'scenario':<42} {'reference':>10} {'sdpa':>10} {'flash':>10}  fastest    auto"
    lines = ["median ms per call; auto = qkv.backends.dispatch.choose", header, "-" * len(header)]
    for row in rows:
        ms = row["ms"]
        lines.append(
            f"{row['scenario']:<42} {ms['reference']:>10.3f} {ms['sdpa']:>10.3f} "
            f"{ms['flash']:>10.3f}  {row['fastest']:<10} {row['auto']}"
        )
    return "\n".join(lines)


# --- reporting -----------------------------------------------------------------------------------


def matmul_rates(dtypes: Sequence[str], size: int = 2048, repeats: int = 10) -> dict[str, float]:
    """GFLOP/s of this machine's best (size × size) @ (size × size) product, per dtype."""
    rates = {}
    for name in dtypes:
        a = torch.randn(size, size).to(DTYPES[name])
        out = torch.empty_like(a)
        torch.mm(a, a, out=out)
        best = min(_seconds(functools.partial(torch.mm, a, a, out=out)) for _ in range(repeats))
        rates[name] = 2 * size**3 / best / 1e9
    return rates


def machine() -> dict[str, Any]:
    return {
        "processor": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "qkv": qkv.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def format_table(results: Sequence[Result], report: dict[str, Any]) -> str:
    """The results as a fixed-width text table (one row per case and implementation)."""
    rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in report["matmul_gflops"].items())
    info = report["machine"]
    shape = report["shape"]
    lines = [
        f"qkv bench: B={shape['batch']} H={shape['heads']} D={shape['dim']}; {info['processor']},"
        f" {info['torch_threads']} threads, torch {info['torch']}; matrix multiply: {rates}",
        "",
    ]
    header = (
        f"{'level':<10} {'pass':<16} {'dtype':<8} {'mask':<6} {'T':>6} {'impl':<9} "
        f"{'ms':>9} {'GFLOP/s':>8} {'vs torch':>8} {'% mm':>5} {'MiB':>7}"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        c = r.case
        row = (
            f"{c.level:<10} {c.pass_:<16} {c.dtype:<8} {'causal' if c.causal else 'full':<6} "
            f"{c.length:>6} {r.implementation:<9} "
        )
        if r.skipped is not None:
            lines.append(row + f"skipped: {r.skipped}")
            continue
        vs = "" if r.implementation == TORCH else f"{r.vs_torch:.2f}x"
        lines.append(
            row + f"{r.median_ms:>9.2f} {r.gflops:>8.1f} {vs:>8} {r.percent_of_matmul:>5.1f} "
            f"{_number(r.memory_mib):>7}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str) -> None:
    """Time and memory vs T (log-log), one panel per level and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.case.level, r.case.pass_) for r in results})
    figure, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 8), squeeze=False)
    colors = {TORCH: "black", "flash": "tab:red", "reference": "tab:blue", "sdpa": "tab:green"}
    colors["auto"] = "tab:purple"
    for column, (level, pass_) in enumerate(groups):
        series: dict[tuple[str, str, bool], list[Result]] = {}
        for r in results:
            if (r.case.level, r.case.pass_) == (level, pass_) and r.skipped is None:
                series.setdefault((r.implementation, r.case.dtype, r.case.causal), []).append(r)
        for (name, dtype, causal), points in sorted(series.items()):
            points.sort(key=lambda r: r.case.length)
            lengths = [r.case.length for r in points]
            style = {
                "color": colors.get(name, "gray"),
                "linestyle": "-" if dtype == "float32" else "--",
                "marker": "o" if causal else "s",
                "label": f"{'PyTorch' if name == TORCH else name} {dtype}"
                f" {'causal' if causal else 'full'}",
            }
            axes[0][column].plot(lengths, [r.median_ms for r in points], **style)
            axes[1][column].plot(lengths, [r.memory_mib for r in points], **style)
        for row, ylabel in enumerate(("median time (ms)", "peak added memory (MiB)")):
            ax = axes[row][column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][column].set_title(f"{level} {pass_}")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- helpers -------------------------------------------------------------------------------------


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr; yields ``advance(description)`` to call before each step."""
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        done = [0]

        def advance_plain(description: str) -> None:
            done[0] += 1
            bar = "#" * (30 * done[0] // max(total, 1))
            print(f"\r[{bar:<30}] {done[0]}/{total} {description:<60}", end="", file=sys.stderr)

        yield advance_plain
        print(file=sys.stderr)
        return
    from rich.console import Console

    columns = (
        TextColumn("{task.description:<58}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("", total=total)
        started = [False]

        def advance(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

        yield advance
        progress.advance(task)


def _progress_items(items: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    with _progress(len(items)) as advance:
        for title, item in items.items():
            advance(title)
            yield title, item


def _seconds(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    (value,) = _int_list(text)
    return value


def _choices(options: Sequence[str] | dict[str, Any]) -> Callable[[str], tuple[str, ...]]:
    allowed = tuple(options)

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(","))
        for value in values:
            if value not in allowed:
                raise argparse.ArgumentTypeError(
                    f"expected a comma-separated subset of {','.join(allowed)}, got {value!r}"
                )
        return values

    return parse


def _number(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0f}"


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value
