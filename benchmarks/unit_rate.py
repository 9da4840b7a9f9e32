"""How the bfloat16 margin over torch moves with this machine's matrix unit, one CPU at a time.

Writes benchmarks/unit_rate.txt. On each CPU in turn (one thread, the process pinned to it), it
repeats: the matrix unit's own rate (AMX tile products per nanosecond, operands held in tile
registers, 0.1 s), then flash's and torch's bfloat16 forward at T = 4096 (B=1, H=8, D=64, full
attention) twice each, alternating, then the unit's rate again and a 2048 × 2048 bfloat16 matrix
multiply. The table gives each sample; the summary compares the samples taken while the unit ran
fastest with those taken while it ran slowest (the top and bottom thirds by its rate).

    python benchmarks/unit_rate.py [samples per CPU, default 25]

It needs a CPU with AMX bfloat16 and a C++ compiler (as flash's compiled kernel does); elsewhere
it says so and writes nothing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv

OUT = Path(__file__).resolve().parent / "unit_rate.txt"
T, HEADS, DIM = 4096, 8, 64

# Four independent accumulator tiles, each a chain of 16 × 16 × 32 bfloat16 tile products.
_PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <stdexcept>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

double tile_products_per_ns(double seconds) {
  constexpr long kRequestTileData = 0x1023, kTileData = 18;  // Linux: allow AMX state
  if (syscall(SYS_arch_prctl, kRequestTileData, kTileData) != 0)
    throw std::runtime_error("the kernel refused this process the AMX tile state");
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.bytes_per_row[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);
  alignas(64) static uint16_t a[512], b[512];
  _tile_loadd(0, a, 64);
  _tile_loadd(1, b, 64);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  const auto start = std::chrono::steady_clock::now();
  long products = 0;
  double elapsed = 0.0;
  do {
    for (int i = 0; i < 1000; ++i) {
      _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 1);
      _tile_dpbf16ps(6, 0, 1); _tile_dpbf16ps(7, 0, 1);
    }
    products += 4000;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  _tile_release();
  return products / elapsed / 1e9;
}
"""


def has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags and " amx_tile" in flags


def load_probe():
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        "qkv_unit_rate_probe",
        cpp_sources=_PROBE,
        functions=["tile_products_per_ns"],
        extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16"],
    )


def seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def samples_on(cpu: int, count: int, probe) -> list[dict[str, float]]:
    """``count`` samples on ``cpu``: the unit's rate around two alternating pairs of calls."""
    os.sched_setaffinity(0, {cpu})
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, T, DIM).bfloat16() for _ in range(3))
    a = torch.randn(2048, 2048).bfloat16()

    def flash() -> None:
        qkv.attention(q, k, v, backend="flash")

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v)

    def matmul() -> None:
        torch.mm(a, a)

    for function in (flash, sdpa, matmul):
        function()
    rows = []
    for _ in range(count):
        before = probe.tile_products_per_ns(0.1)
        flash_s = seconds(flash)
        sdpa_s = seconds(sdpa)
        flash_s += seconds(flash)
        sdpa_s += seconds(sdpa)
        after = probe.tile_products_per_ns(0.1)
        mm_s = min(seconds(matmul), seconds(matmul))
        rows.append(
            dict(
                cpu=cpu,
                unit=(before + after) / 2,
                flash_ms=flash_s / 2 * 1e3,
                torch_ms=sdpa_s / 2 * 1e3,
                ratio=sdpa_s / flash_s,
                mm=2 * 2048**3 / mm_s / 1e9,
            )
        )
    return rows


def summary(rows: list[dict[str, float]], label: str) -> str:
    median = {
        key: statistics.median(row[key] for row in rows)
        for key in ("unit", "mm", "flash_ms", "torch_ms", "ratio")
    }
    below = sum(row["ratio"] < 1.5 for row in rows)
    return (
        f"{label:22} {len(rows):3} samples: unit {median['unit']:.3f}/ns, mm "
        f"{median['mm']:5.0f} GFLOP/s, flash {median['flash_ms']:6.1f} ms, torch "
        f"{median['torch_ms']:6.1f} ms, ratio median {median['ratio']:.2f} "
        f"({min(row['ratio'] for row in rows):.2f}–{max(row['ratio'] for row in rows):.2f}; "
        f"{below} below 1.5)"
    )


def main() -> None:
    if not has_amx():
        print("this CPU has no AMX bfloat16 unit: nothing to measure")
        return
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    probe = load_probe()
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    rows = []
    try:
        for cpu in cpus:
            rows += samples_on(cpu, count, probe)
    finally:
        os.sched_setaffinity(0, cpus)
    by_rate = sorted(rows, key=lambda row: row["unit"])
    third = max(1, len(rows) // 3)
    lines = [
        f"bfloat16 forward, B=1 H={HEADS} T={T} D={DIM}, full attention, one thread pinned to "
        f"each CPU in turn; torch {torch.__version__}",
        "unit: AMX tile products per ns (16 x 16 x 32 bfloat16 each), the mean of the probes "
        "before and after; ms: mean of two calls; ratio: torch's time / flash's; mm: 2048^3 "
        "bfloat16 GFLOP/s",
        "",
        f"{'cpu':>3} {'unit':>6} {'flash ms':>9} {'torch ms':>9} {'ratio':>6} {'mm':>6}",
        *(
            f"{row['cpu']:3d} {row['unit']:6.3f} {row['flash_ms']:9.1f} {row['torch_ms']:9.1f} "
            f"{row['ratio']:6.2f} {row['mm']:6.0f}"
            for row in rows
        ),
        "",
        summary(rows, "all"),
        summary(by_rate[-third:], "unit fastest third"),
        summary(by_rate[:third], "unit slowest third"),
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
