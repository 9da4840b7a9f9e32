"""Where the flash backend's time goes, next to torch's fused kernel: torch.profiler tables.

Writes benchmarks/profiles.txt: for float32 and bfloat16 forward passes at T = 2048 (B=1, H=8,
D=64, full attention) the operator table of flash's PyTorch loop (its compiled kernel switched
off) and of torch's ``scaled_dot_product_attention``, each on one thread so that the
per-operator times add up; then the time per score of each part of the loop, next to the time
per score of flash's compiled kernel and of torch's kernel (see docs/performance.md); then where
the time of one decoding step goes.

    python benchmarks/profile_flash.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
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
        flash.COMPILED_KERNEL = False
        flash_ms = operator_table(
            lambda q=q, k=k, v=v: qkv.attention(q, k, v, backend="flash"),
            f"flash's PyTorch loop {name}",
            lines,
        )
        flash.COMPILED_KERNEL = True
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
