"""Ring attention over N processes, checked against single-process ``qkv.attention``.

Launch with torchrun (gloo on CPU, NCCL on GPUs; the code is the same):

    torchrun --nproc-per-node 4 examples/ring_attention.py --length 16384 --causal --layout zigzag
    torchrun --nproc-per-node 8 examples/ring_attention.py --device cuda --dtype bfloat16

Every rank makes the same random whole sequence (seeded), keeps only its shard, and runs
``qkv.distributed.ring_attention`` forward and backward on it. Then the shards of the output and
of the q/k/v gradients are gathered and rank 0 compares them with ``qkv.attention`` run on the
whole sequence in one process (``--no-check`` skips that; then no rank ever holds the whole
sequence after its shard is cut). Exits with status 1 if they differ.

Legend: B batch, H query heads, Hkv key/value heads, T whole length, P processes, D features.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import qkv
from qkv.distributed import ring_attention, ring_work, shard, unshard

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}  # max abs error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192, help="whole sequence length T")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--dim", type=int, default=64, help="features per head D")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer")
    parser.add_argument("--no-check", action="store_true", help="skip the single-process check")
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]

    # The same whole inputs on every rank (a fixed seed); each keeps only its shard.
    generator = torch.Generator().manual_seed(0)
    shape_q = (args.batch, args.heads, args.length, args.dim)
    shape_kv = (args.batch, args.kv_heads, args.length, args.dim)
    whole = [torch.randn(s, generator=generator) for s in (shape_q, shape_kv, shape_kv)]
    grad_out = torch.randn(shape_q, generator=generator)
    local = [
        shard(x, rank, world_size, layout=args.layout).to(device, dtype).requires_grad_()
        for x in whole
    ]
    local_grad_out = shard(grad_out, rank, world_size, layout=args.layout).to(device, dtype)
    if args.no_check:
        del whole, grad_out

    dist.barrier()
    start = time.perf_counter()
    out = ring_attention(*local, causal=args.causal, layout=args.layout, timeout=args.timeout)
    forward_s = time.perf_counter() - start
    out.backward(local_grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total_s = time.perf_counter() - start
    times = torch.tensor([forward_s, total_s], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    work = ring_work(world_size, layout=args.layout, causal=args.causal)
    if rank == 0:
        print(
            f"{world_size} ranks, {backend}, T={args.length} "
            f"({args.length // world_size} per rank), B={args.batch} H={args.heads} "
            f"Hkv={args.kv_heads} D={args.dim}, {args.dtype}, "
            f"causal={args.causal}, layout={args.layout}"
        )
        print(
            f"forward {times[0]:.3f} s, forward+backward {times[1]:.3f} s (slowest rank); "
            f"work per rank {work.tiles} tiles, imbalance {work.imbalance:.2f}"
        )

    status = 0
    if not args.no_check:
        gathered = [
            unshard(x.detach(), layout=args.layout)
            for x in (out, *(t.grad for t in local))  # type: ignore[misc]
        ]
        if rank == 0:
            # The float64 oracle of the very inputs the ring saw (rounded to --dtype).
            reference = [x.to(dtype).double().requires_grad_() for x in whole]
            expected = qkv.attention(*reference, causal=args.causal, backend="flash")
            expected.backward(grad_out.to(dtype).double())
            wants = [expected.detach()] + [x.grad for x in reference]
            errors = {
                name: (got.cpu().double() - want).abs().max().item()
                for name, got, want in zip(("out", "dq", "dk", "dv"), gathered, wants)
            }
            tolerance = TOLERANCE[dtype]
            ok = all(error <= tolerance for error in errors.values())
            report = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
            print(f"max |ring - single process|: {report} -> {'OK' if ok else 'MISMATCH'}")
            status = 0 if ok else 1
    flags = torch.tensor([status], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return int(flags.item())


if __name__ == "__main__":
    sys.exit(main())
