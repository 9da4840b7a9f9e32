"""Reporting: the machine a run came from, the table, the JSON record and the plot.

"vs torch" is PyTorch's median time divided by qkv's (above 1: qkv is faster). "% mm" compares
a case's GFLOP/s with this machine's matrix-multiply rate in the same dtype, measured at the
start of the run. "MiB" is the peak resident memory the case added to the process.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import qkv
from qkv.backends.flash import kernel
from qkv.bench.cases import TORCH, Result

# The CPU features that decide how fast attention's products can run.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict[str, Any]:
    """The CPU (model name and its vector/matrix flags), threads and versions of a run."""
    return {
        "processor": cpu_name(),
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in kernel.cpu_flags()],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "qkv": qkv.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def cpu_name() -> str:
    return kernel.cpu_info().get("model name") or platform.processor() or platform.machine()


def heading(report: dict[str, Any]) -> str:
    """The table's first line: shape, CPU, threads, torch and the matrix-multiply rates."""
    rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in report["matmul_gflops"].items())
    info, shape = report["machine"], report["shape"]
    flags = "/".join(info["cpu_flags"]) or "no AVX2"
    return (
        f"qkv bench: B={shape['batch']} H={shape['heads']} D={shape['dim']}; {info['processor']}"
        f" ({flags}), {info['torch_threads']} threads, torch {info['torch']}; matrix multiply: "
        f"{rates}"
    )


def format_table(results: Sequence[Result], report: dict[str, Any]) -> str:
    """The results as a fixed-width text table (one row per case and implementation)."""
    header = (
        f"{'level':<10} {'pass':<16} {'dtype':<8} {'mask':<6} {'T':>6} {'impl':<9} "
        f"{'ms':>9} {'GFLOP/s':>8} {'vs torch':>8} {'% mm':>5} {'MiB':>7}"
    )
    lines = [heading(report), "", header, "-" * len(header)]
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
        memory = "n/a" if math.isnan(r.memory_mib) else f"{r.memory_mib:.0f}"
        lines.append(
            row + f"{r.median_ms:>9.2f} {r.gflops:>8.1f} {vs:>8} {r.percent_of_matmul:>5.1f} "
            f"{memory:>7}"
        )
    return "\n".join(lines)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` into the JSON file at ``path``, keeping the other benchmarks' entries
    (``decode``, ``auto``, ``memory_check``, ``arguments``) of a file already there. The file's
    ``machine``, ``shape`` and ``build`` describe its main table (``results``): a run of another
    benchmark into a file that has them leaves them as they are and puts its own machine and build
    into each of its entries instead (those that are tables of their own), so that an entry
    recorded on another machine, or with another build, says which."""
    previous = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    if "results" not in report and "machine" in previous:
        mine = {"machine": report["machine"], "build": report["build"]}
        report = {
            name: {**entry, **mine} if isinstance(entry, dict) else entry
            for name, entry in report.items()
            if name not in ("machine", "shape", "build")
        }
    with open(path, "w") as out:
        json.dump({**previous, **report}, out, indent=1)
        out.write("\n")


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
