"""Ring attention (qkv.distributed) against single-process qkv.attention.

Groups of 2 and 4 gloo processes on localhost run many cases each (process start-up is the
expensive part): every rank builds the same whole inputs, runs its shard through
``ring_attention`` and compares its shard of the output and of the q/k/v gradients with
``qkv.attention`` on the whole sequence. Processes come from a forkserver that has torch imported
already, so starting a group costs a fork, not an import.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.distributed import (
    LAYOUTS,
    merge_,
    ring_attention,
    ring_work,
    shard,
    unshard,
)
from qkv.distributed import ring as ring_module

# --- running a function on a group of processes ---------------------------------------------

_CONTEXT = multiprocessing.get_context("forkserver")
# torch.broadcast_shapes imports sympy on first use (a second or more): do it once, here.
_CONTEXT.set_forkserver_preload(
    ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "qkv.distributed"]
)


def _worker(
    rank: int, world_size: int, store: str, target: Callable[..., Any], results: Any
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        results.put((rank, target(rank, world_size)))
    except BaseException:
        results.put((rank, {"crash": traceback.format_exc()}))
    finally:
        # Exit at once, without tearing the process group down: after a fault test it is broken.
        results.close()
        results.join_thread()
        os._exit(0)


def _launch(
    world_size: int,
    target: Callable[..., Any],
    tmp_path: Path,
    *,
    wait: float = 60.0,
    expect: int | None = None,
) -> dict[int, Any]:
    """Run ``target(rank, world_size)`` on ``world_size`` gloo processes; {rank: its result}.

    Waits for ``expect`` results (default: all) at most ``wait`` seconds, then ends the processes.
    """
    results = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_worker,
            args=(rank, world_size, str(tmp_path / "store"), target, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + wait
    try:
        while len(collected) < (world_size if expect is None else expect):
            rank, result = results.get(timeout=max(deadline - time.monotonic(), 0.01))
            collected[rank] = result
    except queue.Empty:
        pass
    finally:
        for rank, process in enumerate(processes):
            process.join(timeout=10 if rank in collected else 0)
            if process.is_alive():
                process.kill()
                process.join()
    for rank, result in collected.items():
        assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
    return collected


# --- the cases: each compares ring_attention with qkv.attention on the whole sequence --------


def _case(
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
    causal: Any = False,
    layout: str = "contiguous",
    heads: tuple[int, int] | None = (2, 2),
    length: tuple[int, int] = (8, 8),
    padding: bool = False,
    batch: int = 2,
    seed: int = 0,
) -> dict[str, float]:
    """Errors of this rank's output and q/k/v gradient shards against the float64 oracle, in
    units of the dtype's tolerance (<= 1 passes), and how many values are NaN.

    ``heads`` = (Hq, Hkv), or None for inputs without a head dim ((L, D), batch ignored);
    ``length`` = whole (query, key) lengths; ``padding`` masks the last keys of batch 0 and every
    key of batch 1 (rows with no key at all). The ring runs over ``group`` (default: all ranks).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(seed)
    lq, lk = length
    lead_q = () if heads is None else (batch, heads[0])
    lead_k = () if heads is None else (batch, heads[1])

    def make(*shape: int) -> torch.Tensor:
        # Values that ``dtype`` holds exactly, so that only the computation's error is measured.
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).double()

    q, k, v = make(*lead_q, lq, 4), make(*lead_k, lk, 4), make(*lead_k, lk, 3)
    grad_out = make(*lead_q, lq, 3)
    keep = None
    if padding:
        keep = torch.ones(batch, lk, dtype=torch.bool)
        keep[0, lk - 3 :] = False
        keep[1] = False
        keep = keep[:, None, None, :]  # (B, 1, 1, Lk)

    # The whole-sequence oracle, in float64.
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = qkv.attention(*whole, mask=keep, causal=causal, backend="reference")
    expected.backward(grad_out)

    # This rank's shard through the ring, in ``dtype``.
    local = [
        shard(x, rank, world_size, layout=layout).to(dtype).requires_grad_() for x in (q, k, v)
    ]
    local_keep = None if keep is None else shard(keep, rank, world_size, layout=layout, dim=-1)
    out = ring_attention(
        *local, causal=causal, layout=layout, padding_mask=local_keep, timeout=30.0, group=group
    )
    out.backward(shard(grad_out, rank, world_size, layout=layout).to(dtype))

    # Error in units of the tolerance: |got - want| / (atol + rtol·|want|), <= 1 passes.
    atol, rtol = _TOLERANCE[dtype]
    errors = {"nan": 0.0}
    pairs = [("out", out, expected)] + [
        (f"d{name}", x.grad, w.grad) for name, x, w in zip("qkv", local, whole)
    ]
    for name, got, want in pairs:
        want_shard = shard(want.detach(), rank, world_size, layout=layout)
        error = (got.double() - want_shard).abs() / (atol + rtol * want_shard.abs())
        errors[name] = error.max().item()
        errors["nan"] += got.isnan().sum().item()
    # Gathering the output shards gives the whole output on every rank.
    gathered = unshard(out.detach().double(), layout=layout, group=group)
    error = (gathered - expected.detach()).abs() / (atol + rtol * expected.detach().abs())
    errors["unshard"] = error.max().item()
    return errors


# (atol, rtol) against the float64 oracle. bfloat16 keeps 8 significant bits, and the flash
# kernel multiplies bfloat16 matrices (with float32 sums), as fast bfloat16 hardware does.
_TOLERANCE = {
    torch.float64: (1e-10, 0.0),
    torch.float32: (1e-5, 0.0),
    torch.bfloat16: (2e-2, 2e-2),
}

# name -> (keyword arguments of _case); each runs on 2 and on 4 ranks.
CASES: dict[str, dict[str, Any]] = {
    "full f64": {},
    "causal f64": {"causal": True},
    "causal zigzag f64": {"causal": True, "layout": "zigzag"},
    "gqa causal padding f64": {"causal": True, "heads": (4, 2), "padding": True},
    "gqa causal padding zigzag f64": {
        "causal": True,
        "heads": (6, 2),
        "padding": True,
        "layout": "zigzag",
        "length": (16, 16),
    },
    "mqa full padding zigzag f32": {
        "dtype": torch.float32,
        "heads": (4, 1),
        "padding": True,
        "layout": "zigzag",
    },
    "gqa causal f32": {"dtype": torch.float32, "causal": True, "heads": (4, 2), "length": (16, 16)},
    "causal zigzag padding f32": {
        "dtype": torch.float32,
        "causal": True,
        "layout": "zigzag",
        "padding": True,
    },
    "no head dim causal zigzag f64": {"causal": True, "heads": None, "layout": "zigzag"},
    "bottom-right Lq<Lk f64": {"causal": True, "length": (8, 16), "padding": True},
    "bottom-right Lq>Lk zigzag f64": {"causal": True, "length": (16, 8), "layout": "zigzag"},
    "top-left Lq<Lk zigzag f64": {"causal": "top-left", "length": (8, 16), "layout": "zigzag"},
    "causal bf16": {"dtype": torch.bfloat16, "causal": True, "heads": (4, 2)},
}


# Cases also run on the group of even and the group of odd ranks, side by side.
SUBGROUP_CASES = ("gqa causal padding zigzag f64", "causal zigzag padding f32")
# Cases also run with the kernels called on pieces of at most 3 positions (uneven, some of them
# entirely in the future and skipped) instead of whole blocks.
PIECE_CASES = (
    "causal f64",
    "gqa causal padding zigzag f64",
    "bottom-right Lq<Lk f64",
    "bottom-right Lq>Lk zigzag f64",
    "top-left Lq<Lk zigzag f64",
)


def _count_work(rank: int, world_size: int) -> dict[str, float]:
    """Query×key pairs this rank hands to the attention kernel, per layout (causal forward),
    counted by wrapping the kernel; in units of one chunk × one chunk of 2P chunks."""
    from qkv.backends import flash

    kernel = flash.forward
    counted = {"pairs": 0}

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        counted["pairs"] += q.shape[-2] * k.shape[-2]
        return kernel(q, k, v, **kwargs)

    flash.forward = counting
    work = {}
    chunk = 3
    x = torch.randn(1, 2, 2 * world_size * chunk, 4, generator=torch.Generator().manual_seed(1))
    for layout in LAYOUTS:
        counted["pairs"] = 0
        local = shard(x, rank, world_size, layout=layout)
        ring_attention(local, local, local, causal=True, layout=layout)
        work[layout] = counted["pairs"] / chunk**2
    flash.forward = kernel
    return work


def _suite(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # Two process groups of the even and of the odd ranks, each running its own ring.
    parity, _ = dist.new_subgroups_by_enumeration(
        [list(range(start, world_size, 2)) for start in (0, 1)]
    )
    runs = [(name, name, None, None) for name in CASES]
    runs += [(f"{name} on a subgroup", name, parity, None) for name in SUBGROUP_CASES]
    runs += [(f"{name} in pieces", name, None, 3) for name in PIECE_CASES]
    whole = ring_module._PIECE
    for label, name, group, piece in runs:
        ring_module._PIECE = whole if piece is None else piece
        try:
            results[label] = _case(**CASES[name], group=group)
        except Exception:
            results[label] = {"error": traceback.format_exc()}
    ring_module._PIECE = whole
    results["work"] = _count_work(rank, world_size)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_attention_on_the_whole_sequence(
    world_size: int, tmp_path: Path
) -> None:
    results = _launch(world_size, _suite, tmp_path, wait=80)
    assert sorted(results) == list(range(world_size)), "some ranks gave no result"
    failures = []
    labels = [
        *CASES,
        *(f"{name} on a subgroup" for name in SUBGROUP_CASES),
        *(f"{name} in pieces" for name in PIECE_CASES),
    ]
    for label in labels:
        for rank in range(world_size):
            errors = results[rank][label]
            if "error" in errors:
                failures.append(f"{label}, rank {rank}:\n{errors['error']}")
                continue
            worst = max(errors[key] for key in ("out", "dq", "dk", "dv", "unshard"))
            if errors["nan"] or not worst <= 1.0:
                failures.append(f"{label}, rank {rank}: errors {errors} (units of the tolerance)")
    assert not failures, "\n".join(failures)

    # Blocks in the future are skipped: contiguous rank r computes r+1 blocks of 2×2 tiles (one
    # chunk of 2P each way), zigzag gives every rank 2P+1 tiles; as ring_work reports.
    expected = {
        "contiguous": tuple(4 * (rank + 1) for rank in range(world_size)),
        "zigzag": (2 * world_size + 1,) * world_size,
    }
    for layout in LAYOUTS:
        measured = tuple(results[rank]["work"][layout] for rank in range(world_size))
        assert measured == expected[layout] == ring_work(world_size, layout=layout).tiles


def test_zigzag_balances_causal_work() -> None:
    # In units of (T/2P)² tiles: rank r of the contiguous layout computes r+1 blocks of 2×2
    # tiles; zigzag gives each rank 2P+1 tiles.
    assert ring_work(2).tiles == (4, 8)
    assert ring_work(4).tiles == (4, 8, 12, 16)
    assert ring_work(2).imbalance == pytest.approx(8 / 6)
    assert ring_work(4).imbalance == pytest.approx(1.6)
    for world_size in (2, 4, 8):
        zigzag = ring_work(world_size, layout="zigzag")
        assert zigzag.tiles == (2 * world_size + 1,) * world_size
        assert zigzag.imbalance == 1.0
        # The same total work, but for the contiguous layout's P diagonal blocks, which hand the
        # kernel one tile above the diagonal each; without causality nothing is skipped.
        assert sum(zigzag.tiles) + world_size == sum(ring_work(world_size).tiles)
        assert ring_work(world_size, causal=False).imbalance == 1.0
        assert sum(ring_work(world_size, causal=False).tiles) == (2 * world_size) ** 2


# --- faults: a dead or hung rank makes the others fail, in bounded time ----------------------

_FAULT_TIMEOUT = 3.0


def _fault(rank: int, world_size: int) -> dict[str, Any]:
    """The last rank dies (world size 2) or hangs (world size 3); the others call the ring."""
    last = world_size - 1
    # The fault comes once the group is up: a rank that dies while the others are still
    # connecting fails their init_process_group instead of the ring.
    dist.barrier()
    if rank == last:
        if world_size == 2:
            os._exit(1)
        time.sleep(60)
    x = torch.randn(1, 1, 64, 8)
    start = time.monotonic()
    try:
        ring_attention(x, x, x, causal=True, timeout=_FAULT_TIMEOUT)
    except Exception as error:
        return {
            "error": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("world_size", [2, 3], ids=["killed", "hung"])
def test_dead_or_hung_rank_makes_the_others_fail_in_time(world_size: int, tmp_path: Path) -> None:
    start = time.monotonic()
    results = _launch(world_size, _fault, tmp_path, wait=30, expect=world_size - 1)
    assert time.monotonic() - start < 30
    assert sorted(results) == list(range(world_size - 1))
    for result in results.values():
        assert result["error"] in ("TimeoutError", "RuntimeError"), result
        # Each rank fails within its timeout of one transfer per step, plus slack.
        assert result["seconds"] < _FAULT_TIMEOUT * world_size + 5, result
    # The rank waiting for the faulty rank's block names it.
    assert f"rank {world_size - 1}" in results[0]["message"], results[0]
    if world_size == 3:
        assert results[0]["error"] == "TimeoutError" or results[1]["error"] == "TimeoutError"


# --- in this process: one rank, argument checks, merging, shard/unshard ---------------------


@pytest.fixture
def one_process_group(tmp_path: Path) -> Any:
    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        pytest.skip("a torch.distributed process group is already initialised here")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_ring_attention_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a torch.distributed process group is already initialised here")
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)


@pytest.mark.parametrize("piece", [None, 2])
@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_one_rank_equals_attention(
    one_process_group: None, causal: Any, piece: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if piece is not None:  # the kernels called on pieces of 2 positions, not the whole shard
        monkeypatch.setattr(ring_module, "_PIECE", piece)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    v = torch.randn(2, 2, 7, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    keep = torch.rand(2, 1, 1, 7, generator=generator) > 0.3
    grad_out = torch.randn(2, 4, 5, 6, dtype=torch.float64, generator=generator)
    got = torch.autograd.grad(
        ring_attention(q, k, v, causal=causal, padding_mask=keep, scale=0.3), (q, k, v), grad_out
    )
    out = qkv.attention(q, k, v, causal=causal, mask=keep, scale=0.3)
    want = torch.autograd.grad(out, (q, k, v), grad_out)
    assert torch.allclose(
        ring_attention(q, k, v, causal=causal, padding_mask=keep, scale=0.3),
        out,
        atol=1e-12,
        rtol=0,
    )
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12, rtol=0)


def test_empty_sequences(one_process_group: None) -> None:
    q = torch.randn(2, 0, 4, requires_grad=True)
    k = torch.randn(2, 3, 4, requires_grad=True)
    out = ring_attention(q, k, k)
    assert out.shape == (2, 0, 4)
    no_keys = ring_attention(k, q, q, causal=True)  # no keys: zeros, not NaN
    assert torch.equal(no_keys, torch.zeros(2, 3, 4))
    no_keys.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"q": "not a tensor"}, TypeError, "q must be a torch.Tensor"),
        ({"k": torch.randn(2, 8, 5)}, ValueError, "q and k must have the same feature size"),
        ({"causal": "yes"}, ValueError, "causal must be one of"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"layout": "spiral"}, ValueError, "layout must be one of"),
        ({"layout": "zigzag", "q": torch.randn(2, 7, 4)}, ValueError, "q must have an even"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"timeout": "soon"}, TypeError, "timeout must be a float"),
        ({"group": "world"}, TypeError, "group must be a torch.distributed.ProcessGroup"),
        ({"padding_mask": torch.ones(2, 8)}, TypeError, "padding_mask must be bool"),
        ({"padding_mask": torch.ones(2, 8, 8, dtype=torch.bool)}, ValueError, "dim -2 must be 1"),
        (
            {"padding_mask": torch.ones(3, 1, 8, dtype=torch.bool)},
            ValueError,
            r"padding_mask of shape \(3, 1, 8\) is not broadcastable to \(\*batch, Hq, 1, S\)",
        ),
    ],
)
def test_bad_arguments_name_the_argument(
    one_process_group: None, kwargs: dict[str, Any], error: type, message: str
) -> None:
    arguments = {"q": torch.randn(2, 8, 4), "k": torch.randn(2, 8, 4), "v": torch.randn(2, 8, 4)}
    arguments.update(kwargs)
    q, k, v = arguments.pop("q"), arguments.pop("k"), arguments.pop("v")
    with pytest.raises(error, match=message):
        ring_attention(q, k, v, **arguments)


def test_shard_and_unshard(one_process_group: None) -> None:
    x = torch.arange(24.0).reshape(2, 12)
    assert shard(x, 1, 3, dim=-1).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    # zigzag over 3 ranks: 6 chunks of 2; rank 1 holds chunks 1 and 4.
    assert shard(x, 1, 3, layout="zigzag", dim=-1)[0].tolist() == [2, 3, 8, 9]
    assert torch.equal(unshard(shard(x, 0, 1, layout="zigzag", dim=1), layout="zigzag", dim=1), x)
    pieces = [shard(x, r, 3, layout="zigzag", dim=-1) for r in range(3)]
    assert sorted(torch.cat(pieces, dim=-1)[0].tolist()) == list(range(12))
    with pytest.raises(ValueError, match="divisible by 6"):
        shard(x, 0, 3, layout="zigzag", dim=0)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        shard(x, 3, 3)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention of q over the keys kept, -inf and 0 for rows with none."""
    scores = (q @ k.transpose(-2, -1)).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    return weights @ v, lse


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 9), max_size=4),
    seed=st.integers(0, 2**16),
    blocked=st.floats(0.0, 1.0),
)
def test_merging_blocks_equals_attention_over_all_keys(
    cuts: list[int], seed: int, blocked: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 5, 4, dtype=torch.float64, generator=generator)
    k = torch.randn(3, 9, 4, dtype=torch.float64, generator=generator)
    v = torch.randn(3, 9, 2, dtype=torch.float64, generator=generator)
    keep = torch.rand(3, 5, 9, generator=generator) >= blocked  # some rows may keep no key
    out = torch.zeros(3, 5, 2, dtype=torch.float64)
    lse = torch.full((3, 5), -math.inf, dtype=torch.float64)
    edges = [0, *sorted(cuts), 9]
    for start, end in itertools.pairwise(edges):  # blocks of keys, some possibly empty
        merge_(out, lse, *_partial(q, k[:, start:end], v[:, start:end], keep[..., start:end]))
    want_out, want_lse = _partial(q, k, v, keep)
    assert not out.isnan().any()
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.equal(lse == -math.inf, want_lse == -math.inf)
    assert torch.allclose(lse[lse > -math.inf], want_lse[want_lse > -math.inf], atol=1e-12)
    assert torch.equal(out[lse == -math.inf], torch.zeros_like(out[lse == -math.inf]))
