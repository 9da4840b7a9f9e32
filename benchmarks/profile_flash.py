"""Where the flash backend's time goes, next to torch's fused kernel: torch.profiler tables.

Writes benchmarks/profiles.txt: for float32 and bfloat16 forward passes at T = 2048 (B=1, H=8,
D=64, full attention) the operator table of flash's PyTorch loop (its compiled kernel switched
off) and of torch's ``scaled_dot_product_attention``, each on one thread so that the
per-operator times add up; then the time per score of each part of the loop, next to the time
per score of flash's compiled kernel and of torch's kernel (see docs/performance.md); then where
the bfloat16 time of flash's compiled kernel and of torch's kernel goes at T = 4096 (``perf``
samples by module, where ``perf`` is installed: both spend it in the same oneDNN matrix products
and in their own code, next to this machine's matrix-multiply rate measured in the same minutes);
then where the time of one decoding step goes.

    python benchmarks/profile_flash.py
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import qkv
from qkv.backends import flash

OUT = Path(__file__).resolve().parent / "profiles.txt"
T, HEADS, DIM = 2048, 8, 64


def operator_table(function, title: str, lines: list[str]) -> dict[str, float]:
    """Profile one call (after a warm-up); append its table; return self CPU ms per operator."""
    function()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function()
    averages = prof.key_averages()
    lines += [f"== {title}", averages.table(sort_by="self_cpu_time_total", row_limit=12), ""]
    return {event.key: event.self_cpu_time_total / 1e3 for event in averages}


def main() -> None:
    torch.set_num_threads(1)
    lines = [
        f"flash vs torch's fused kernel, one thread, B=1 H={HEADS} T={T} D={DIM}, full attention",
        f"torch {torch.__version__}; {T * T * HEADS / 1e6:.1f} M scores per call",
        "",
    ]
    scores = T * T * HEADS
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, HEADS, T, DIM).to(dtype) for _ in range(3))
        name = str(dtype).removeprefix("torch.")
        flash.kernel.ENABLED = False
        flash_ms = operator_table(
            lambda q=q, k=k, v=v: qkv.attention(q, k, v, backend="flash"),
            f"flash's PyTorch loop {name}",
            lines,
        )
        flash.kernel.ENABLED = True
        kernel_ms = median_ms(lambda q=q, k=k, v=v: qkv.attention(q, k, v, backend="flash"))
        torch_ms = operator_table(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
            f"torch.nn.functional.scaled_dot_product_attention {name}",
            lines,
        )
        products = sum(ms for op, ms in flash_ms.items() if op in ("aten::bmm", "aten::baddbmm_"))
        passes = sum(
            ms
            for op, ms in flash_ms.items()
            if op in ("aten::amax", "aten::sub_", "aten::exp2_", "aten::sum", "aten::masked_fill_")
        )
        total_flash = sum(flash_ms.values())
        other = total_flash - products - passes
        parts = {"flash": total_flash, "products": products, "passes": passes, "other": other}
        parts["torch"] = sum(torch_ms.values())
        per_score = {label: ms * 1e6 / scores for label, ms in parts.items()}
        lines += [
            f"-- {name}, ns per score: flash's loop {per_score['flash']:.2f} (matrix products "
            f"{per_score['products']:.2f}, max/subtract/exp2/sum passes {per_score['passes']:.2f},"
            f" other {per_score['other']:.2f}); torch's kernel in all {per_score['torch']:.2f};"
            f" flash's compiled kernel in all {kernel_ms * 1e6 / scores:.2f}",
            "",
        ]
    lines += kernel_profile()
    lines += decode_profile()
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


def median_ms(function) -> float:
    """Median of 5 timed calls after a warm-up, in milliseconds."""
    function()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[2]


KERNEL_T = 4096

# Run under `perf record`, sampling only during the attention calls; between them the same
# process times torch's bfloat16 matrix multiply, so that the two rates come from the same minutes.
_SAMPLED_CALLS = """
import json, statistics, sys, time, torch, qkv
torch.set_num_threads(1)
q, k, v = (torch.randn(1, {heads}, {length}, {dim}).bfloat16() for _ in range(3))
a = torch.randn(2048, 2048).bfloat16()
product = torch.empty_like(a)
call = {call}
for _ in range(3):
    call()
    torch.mm(a, a, out=product)
attention, mm = [], []
with open(sys.argv[1], "w") as control, open(sys.argv[2]) as ack:
    for _ in range({calls}):
        control.write("enable\\n"); control.flush(); ack.readline()
        start = time.perf_counter()
        call()
        attention.append(time.perf_counter() - start)
        control.write("disable\\n"); control.flush(); ack.readline()
        start = time.perf_counter()
        torch.mm(a, a, out=product)
        mm.append(time.perf_counter() - start)
print(json.dumps(dict(attention=statistics.median(attention), mm=statistics.median(mm))))
"""

_CALLS = {
    "flash's kernel": 'lambda: qkv.attention(q, k, v, backend="flash")',
    "torch's kernel": "lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)",
}

# perf's module names, shortened; [JIT] is oneDNN's generated code: the matrix products.
_MODULES = {"[JIT]": "products", "qkv_flash_cpu": "qkv_flash_cpu", "libtorch_cpu": "libtorch"}


def kernel_profile(calls: int = 20) -> list[str]:
    """Where the bfloat16 forward's time goes at T = 4096 on one thread, in flash's compiled
    kernel and in torch's: the share of `perf` samples in each module, and from it the time and
    rate of the matrix products (oneDNN's generated code in both), next to this machine's
    bfloat16 matrix-multiply rate timed between the sampled calls."""
    scores = KERNEL_T * KERNEL_T * HEADS
    flop = 4 * scores * DIM  # q·kᵀ and p·v
    lines = [
        f"== bfloat16 forward, T={KERNEL_T}, full attention, one thread: perf samples by module "
        f"during {calls} calls",
        f"{'':15} {'ms/call':>8} {'mm GFLOP/s':>10} "
        + " ".join(f"{name:>13}" for name in [*_MODULES.values(), "other"])
        + f" {'products ms':>11} {'GFLOP/s':>8} {'% of mm':>7} {'rest ms':>7}",
    ]
    for label, call in _CALLS.items():
        sampled = perf_shares(call, calls)
        if sampled is None:
            lines.append(f"{label:15} (perf is not installed or cannot sample here)")
            continue
        shares, seconds = sampled
        mm_rate = 2 * 2048**3 / seconds["mm"] / 1e9
        products = seconds["attention"] * shares.get("products", 0.0)
        rate = flop / products / 1e9 if products > 0 else float("nan")
        lines.append(
            f"{label:15} {seconds['attention'] * 1e3:8.1f} {mm_rate:10.0f} "
            + " ".join(
                f"{100 * shares.get(name, 0.0):12.1f}%" for name in [*_MODULES.values(), "other"]
            )
            + f" {products * 1e3:11.1f} {rate:8.0f} {100 * rate / mm_rate:6.0f}% "
            f"{(seconds['attention'] - products) * 1e3:7.1f}"
        )
    return [*lines, ""]


def perf_shares(call: str, calls: int) -> tuple[dict[str, float], dict[str, float]] | None:
    """Share of `perf record` samples per module during ``calls`` runs of ``call`` (source of
    a lambda over q, k, v) in a child process, and that process's median seconds per call and
    per matrix multiply; None where perf is missing or cannot sample."""
    if shutil.which("perf") is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        control, ack, data = (os.path.join(folder, name) for name in ("ctl", "ack", "perf.data"))
        os.mkfifo(control)
        os.mkfifo(ack)
        script = os.path.join(folder, "calls.py")
        with open(script, "w") as file:
            file.write(
                _SAMPLED_CALLS.format(heads=HEADS, length=KERNEL_T, dim=DIM, call=call, calls=calls)
            )
        record = subprocess.run(
            [
                "perf",
                "record",
                "-q",
                "-o",
                data,
                "-D",
                "-1",
                f"--control=fifo:{control},{ack}",
                "--",
                sys.executable,
                script,
                control,
                ack,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if record.returncode != 0:
            return None
        report = subprocess.run(
            ["perf", "report", "-i", data, "--stdio", "-q", "--sort", "dso"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    shares: dict[str, float] = {}
    for line in report.stdout.splitlines():
        fields = line.split(None, 1)
        if len(fields) != 2 or not fields[0].endswith("%"):
            continue
        share = float(fields[0].rstrip("%")) / 100
        label = next((name for key, name in _MODULES.items() if key in fields[1]), "other")
        shares[label] = shares.get(label, 0.0) + share
    if not shares:
        return None
    return shares, json.loads(record.stdout.strip().splitlines()[-1])


def decode_profile() -> list[str]:
    """Share of one decoding run (512 tokens, 4 causal layers, d_model 256, 8 heads, a KV cache
    per layer) spent in each part of the call stack, by cProfile's cumulative times."""
    torch.manual_seed(0)
    stack = nn.ModuleList(qkv.SelfAttention(256, 8, causal=True) for _ in range(4)).eval()
    inputs = torch.randn(1, 512, 256)

    def decode() -> None:
        caches = [qkv.KVCache() for _ in stack]
        for t in range(512):
            x = inputs[:, t : t + 1]
            for layer, cache in zip(stack, caches):
                x = x + layer(x, cache=cache)

    with torch.no_grad():
        decode()
        start = time.thread_time()
        decode()
        seconds = time.thread_time() - start
        profiler = cProfile.Profile()
        profiler.enable()
        decode()
        profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    parts = {
        ("qkv/modules.py", "forward"): "SelfAttention.forward (everything)",
        ("qkv/modules.py", "_check_inputs"): "  checking x",
        ("qkv/modules.py", "_steps_on_kernel"): "  deciding on the kernel's decoding step",
        ("torch/nn/modules/linear.py", "forward"): "  the two linear layers (qkv_proj, out_proj)",
        ("qkv/backends/flash.py", "decode_step"): "  flash.decode_step (cache writes, attention)",
        ("qkv/modules.py", "_project"): "  first token: projection and KVCache.append",
        ("qkv/functional.py", "attention_of_projections"): "  first token: qkv's attention call",
    }
    total = stats.total_tt
    lines = [
        "== decoding 512 tokens one at a time through 4 causal SelfAttention layers "
        "(d_model 256, 8 heads, KV cache), one thread",
        f"{seconds:.2f} s of CPU time = {seconds / 2048 * 1e6:.0f} us per layer and token",
        "share of the profiled time (cProfile, cumulative):",
    ]
    for (path, function), label in parts.items():
        cumulative = sum(
            entry[3]
            for (filename, _, name), entry in stats.stats.items()  # type: ignore[attr-defined]
            if name == function and filename.endswith(path)
        )
        lines.append(f"  {label:<44} {100 * cumulative / total:5.1f}%")
    return lines


if __name__ == "__main__":
    main()
