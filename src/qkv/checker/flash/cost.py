"""The ``--flash`` checks of cost: memory (linear in length, not quadratic) and work (causal
skips the tiles above the diagonal).

Memory is counted by ``PeakMemory``, a ``TorchDispatchMode`` that sees every tensor a torch
operation creates, adds its storage's size while the storage lives and keeps the largest total:
the same number on every machine and every run, unlike the process's resident memory. (Buffers
a compiled kernel allocates outside torch are not seen; they are small in a tiled kernel.)
Legend: L length, D features.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qkv.checker.flash.context import FlashContext
from qkv.checker.flash.target import Case, FlashTarget, split_result
from qkv.checker.report import Result

MEMORY_LENGTHS = (512, 2048)  # L and 4L, past the tile sizes that grow with L up to a cap
MEMORY_HEAD = 16  # small D, so that an (L, L) matrix dominates wherever one is made
QUADRATIC = 8.0  # between 4× (linear) and 16× (an (L, L) matrix) for 4× the length
WORK_LENGTH, WORK_HEAD = 4096, 64
HALF_WORK = 0.8  # causal skips about half the tiles: clearly less than a full call
SLOW_CALL = 0.5  # seconds: a call this slow is timed once (its noise is small next to it)


class PeakMemory(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The most bytes of tensor storage alive at once among those made while it is active
    (storages of ``ignore``, the inputs, are not counted)."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._ignored = {t.untyped_storage().data_ptr() for t in ignore}
        self._alive: dict[int, weakref.finalize[[int, int], torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for item in tree_leaves(result):
            if isinstance(item, torch.Tensor):
                self._track(item.untyped_storage())
        return result

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive or key in self._ignored:
            return  # a view, an in-place result or an input: nothing new was allocated
        self.live += size
        self.peak = max(self.peak, self.live)
        self._alive[key] = weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._alive.pop(key, None)

    def __exit__(self, *args: Any) -> None:
        for finalizer in self._alive.values():  # storages still alive stay uncounted
            finalizer.detach()
        super().__exit__(*args)  # type: ignore[no-untyped-call]


def peaks(target: FlashTarget, length: int) -> tuple[int, int]:
    """Peak bytes of the forward alone and of the forward and backward at this length."""
    case = Case(length, length, dk=MEMORY_HEAD, dv=MEMORY_HEAD, batch=1, heads=1)
    q, k, v = (t.to(target.device).requires_grad_() for t in target.tensors(case))
    dout = torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(v.device)
    with PeakMemory(ignore=(q, k, v, dout)) as counter:
        out = split_result(target.call(q, k, v, causal=False), q.shape[:-1])[0]
        forward = counter.peak
        if out.requires_grad:  # (a forward-only kernel: its backward check says so)
            torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
        del out
    return forward, counter.peak


def _mb(size: int) -> str:
    return f"{size / 2**20:.2f} MB"


def memory(ctx: FlashContext) -> Result:
    short, long = (peaks(ctx.target, length) for length in MEMORY_LENGTHS)
    growth = long[1] / max(short[1], 1)
    forward_growth = long[0] / max(short[0], 1)
    low, high = MEMORY_LENGTHS
    said = (
        f"peak memory of a forward and backward (D = {MEMORY_HEAD}): {_mb(short[1])} at "
        f"L = {low:,}, {_mb(long[1])} at L = {high:,}: {growth:.1f}× for {high // low}× the "
        f"length (the forward alone: {_mb(short[0])} → {_mb(long[0])}, {forward_growth:.1f}×)"
    )
    if growth <= QUADRATIC:
        return Result("memory", "pass", f"{said}: linear in length")
    where = (
        "the forward holds an (Lq, Lk) matrix (scores or weights) at once"
        if forward_growth > QUADRATIC
        else "the forward is linear, so the backward holds an (Lq, Lk) matrix: recompute p "
        "one tile at a time from the saved lse, as the forward made it"
    )
    return Result("memory", "fail", f"{said}: quadratic, about 16× for 4× the length; {where}")


def _seconds(call: Callable[[], Any], device: torch.device) -> float:
    """One call's wall-clock time (waiting for a GPU to finish)."""
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _fastest(calls: dict[str, Callable[[], Any]], device: torch.device) -> dict[str, float]:
    """Each call's fastest time over three rounds after one to warm up (that one alone when a
    call is slow); the calls take turns, so that a change in the machine's load touches each."""
    best = {name: _seconds(call, device) for name, call in calls.items()}
    if max(best.values()) > SLOW_CALL:
        return best
    best = dict.fromkeys(calls, math.inf)
    for _ in range(3):
        for name, call in calls.items():
            best[name] = min(best[name], _seconds(call, device))
    return best


def work(ctx: FlashContext) -> Result:
    if not ctx.has_causal:
        return Result("work", "skip", "no causal parameter (causal / is_causal)")
    target = ctx.target
    case = Case(WORK_LENGTH, WORK_LENGTH, dk=WORK_HEAD, dv=WORK_HEAD, batch=1, heads=1)
    q, k, v = (t.to(target.device) for t in target.tensors(case))
    with torch.no_grad():
        times = _fastest(
            {
                "full": lambda: target.call(q, k, v, causal=False),
                "causal": lambda: target.call(q, k, v, causal=True),
            },
            target.device,
        )
    full, causal = times["full"], times["causal"]
    ratio = causal / full
    said = (
        f"forward at L = {WORK_LENGTH:,} (D = {WORK_HEAD}): causal {causal * 1000:.1f} ms, "
        f"full {full * 1000:.1f} ms: {ratio:.2f}× the time"
    )
    if ratio <= HALF_WORK:
        return Result("work", "pass", f"{said}: the key tiles above the diagonal are skipped")
    return Result(
        "work",
        "warn",
        f"{said}; about half is expected: the tiles above the diagonal are computed and then "
        "masked. Skip the key tiles that start after a query tile's last query (half the work)",
    )
