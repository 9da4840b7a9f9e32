"""Memory per rank of ring attention, for P = 1, 2 and 4 processes on this machine.

For each P, P gloo processes on localhost run ``qkv.distributed.ring_attention`` forward and
backward (causal, contiguous layout) and record, per rank, the peak resident memory above the
rank's idle baseline. Two measurements:

1. A fixed long sequence T: the peak per rank should fall about as 1/P, since a rank holds its
   T/P shard with its output and gradients, and one travelling key/value block of T/P.
2. The longest T that fits a per-rank memory budget: fitted from two sizes, then confirmed by
   measurement (the longest multiple of the step that fits; the next one up does not).

How memory is measured: each rank resets its peak resident set size (``/proc/self/clear_refs``,
Linux), notes its resident size, makes its shard (q, k, v and the output gradient) and runs the
step; the peak minus that baseline is what the shard and the attention took. The figure reported
for a P is the largest over its ranks.

    python benchmarks/ring_memory.py                 # writes benchmarks/ring_memory.json
    python benchmarks/ring_memory.py --length 8192 --budget-mib 64 --out /tmp/ring.json

Legend: T whole sequence length, P processes, H heads, D features per head.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed import LAYOUTS, ring_attention, ring_work

HERE = Path(__file__).resolve().parent
MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mib(length: int, config: dict[str, Any]) -> tuple[float, float]:
    """(peak MiB above baseline over all ranks, seconds of the slowest rank) for one step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = length // world_size
    heads, dim, dtype = config["heads"], config["dim"], getattr(torch, config["dtype"])
    generator = torch.Generator().manual_seed(rank)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident size (VmHWM) restarts from the current size
    baseline = _status_kib("VmRSS")
    q, k, v, grad_out = (
        torch.randn(1, heads, local, dim, generator=generator, dtype=dtype) for _ in range(4)
    )
    for x in (q, k, v):
        x.requires_grad_()
    start = time.perf_counter()
    out = ring_attention(q, k, v, causal=True, timeout=600.0)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    peak = (_status_kib("VmHWM") - baseline) / 1024
    del q, k, v, grad_out, out
    result = torch.tensor([peak, seconds], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result[0]), float(result[1])


def longest_fitting(
    config: dict[str, Any], world_size: int, measured: dict[int, float]
) -> dict[str, Any]:
    """The longest T (a multiple of P·step) whose peak per rank fits the budget: a line through
    two measured sizes gives a first guess, then measured steps up or down confirm it.
    ``measured`` ({T: peak MiB}) holds sizes measured already and gets the new ones."""
    step, budget = config["step"] * world_size, config["budget_mib"]

    def fits(length: int) -> bool:
        if length not in measured:
            measured[length] = peak_mib(length, config)[0]
        return measured[length] <= budget

    large = config["length"]
    small = max(step, large // 4 // step * step)
    fits(small), fits(large)
    per_position = (measured[large] - measured[small]) / (large - small)
    guess = small + (budget - measured[small]) / max(per_position, 1e-9)
    length = max(step, int(guess) // step * step)
    while not fits(length) and length > step:
        length -= step
    while fits(length + step):
        length += step
    return {
        "world_size": world_size,
        "longest_length": length,
        "per_rank_length": length // world_size,
        "peak_mib": round(measured[length], 1),
        "next_length": length + step,
        "next_peak_mib": round(measured[length + step], 1),
        "measured": {str(t): round(m, 1) for t, m in sorted(measured.items())},
    }


def _rank_main(rank: int, world_size: int, store: str, config: dict[str, Any], results: Any):
    torch.set_num_threads(config["threads"])
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=900),
        )
        peak_mib(2 * config["step"] * world_size, config)  # warm-up: first-call costs
        fixed, seconds = peak_mib(config["length"], config)
        budget = longest_fitting(config, world_size, {config["length"]: fixed})
        if rank == 0:
            results.put((world_size, fixed, seconds, budget))
        dist.destroy_process_group()
    except BaseException:
        results.put((world_size, None, None, traceback.format_exc()))
        raise


def run_group(world_size: int, config: dict[str, Any], store: str) -> dict[str, Any]:
    # glibc keeps freed blocks for reuse and raises its mmap threshold as large blocks are freed,
    # so freed tensors would stay resident and hide the next step's peak. A fixed threshold
    # gives every tensor over 128 KiB its own mapping, returned to the system when freed, so
    # resident memory follows the tensors alive.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, store, config, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    _, fixed, seconds, budget = results.get(timeout=3600)
    for process in processes:
        process.join()
    if fixed is None:
        raise RuntimeError(f"a rank of the {world_size}-process group failed:\n{budget}")
    return {"fixed": fixed, "seconds": seconds, "budget": budget}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=32768, help="the fixed long T")
    parser.add_argument("--budget-mib", type=float, default=128.0, help="memory budget per rank")
    parser.add_argument("--step", type=int, default=512, help="T granularity per rank")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=HERE / "ring_memory.json")
    args = parser.parse_args()
    config = {
        "length": args.length,
        "budget_mib": args.budget_mib,
        "step": args.step,
        "heads": args.heads,
        "dim": args.dim,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    store_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    rows = []
    for world_size in args.ranks:
        store = store_dir / f"qkv_ring_memory_{os.getpid()}_{world_size}"
        store.unlink(missing_ok=True)
        result = run_group(world_size, config, str(store))
        store.unlink(missing_ok=True)
        rows.append({"world_size": world_size, **result})
        budget = result["budget"]
        print(
            f"P={world_size}: T={args.length}: peak {result['fixed']:7.1f} MiB per rank "
            f"({result['seconds']:.1f} s fwd+bwd); longest T within {args.budget_mib:g} MiB: "
            f"{budget['longest_length']} ({budget['peak_mib']} MiB; "
            f"T={budget['next_length']} needs {budget['next_peak_mib']} MiB)",
            flush=True,
        )

    first = rows[0]["fixed"]
    report = {
        "what": "peak resident memory per rank (max over ranks) above the rank's idle baseline, "
        "ring_attention forward+backward, causal, contiguous layout, B=1",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "config": config,
        "fixed_length": [
            {
                "world_size": row["world_size"],
                "length": args.length,
                "per_rank_length": args.length // row["world_size"],
                "peak_mib": round(row["fixed"], 1),
                "ratio_to_first": round(row["fixed"] / first, 3),
                "seconds": round(row["seconds"], 2),
            }
            for row in rows
        ],
        "budget": [row["budget"] for row in rows],
        "causal_work": {
            layout: {
                str(p): {"tiles": list(w.tiles), "imbalance": round(w.imbalance, 3)}
                for p in (2, 4, 8)
                for w in [ring_work(p, layout=layout)]
            }
            for layout in LAYOUTS
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
