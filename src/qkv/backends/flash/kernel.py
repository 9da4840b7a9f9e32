"""flash's compiled CPU kernel (``flash_cpu.cpp``): how it is built and loaded, the calls it runs.

The kernel runs the forward recurrence of ``loop.py`` for calls without a mask (a causal rule,
a window and packed sequences given as each query row's range of keys), one query block
of one head at a time in cache-sized buffers, with one fused exp/sum pass per key block. Calls
with fewer than ``DECODE_QUERIES`` queries (decoding) take its other path: one query row at a
time, K/V read where they lie, so a KV cache's buffer is never copied.

The kernel is compiled the first time it is needed, for the machine it runs on
(``-march=native``), with torch's C++ extension tooling (a C++ compiler and ninja), and cached by
torch under ``~/.cache/torch_extensions`` (``TORCH_EXTENSIONS_DIR`` moves it), so only the first
use in a fresh environment pays the ~30 s build. The cached build is named after the CPU's
feature flags and the source's hash, so a cache shared by different machines or different
versions of qkv never hands one a build for another's instruction set or another's source.
Where it cannot be built, qkv warns once; flash then runs its PyTorch loop, which computes the
same thing more slowly, and ``"auto"`` picks torch's kernel instead.
``QKV_FLASH_KERNEL=0`` (or ``ENABLED = False``) skips the kernel without trying.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

from qkv.backends.flash.loop import flat_heads

# Run the calls the kernel supports on it (False: always the PyTorch loop).
ENABLED = os.environ.get("QKV_FLASH_KERNEL", "1") != "0"
# Calls with fewer queries than this (decoding) run on the kernel's one-row-at-a-time path,
# which reads K/V where they lie (a KV cache's buffer) instead of rearranging them into blocks.
DECODE_QUERIES = 16

_SOURCE = Path(__file__).with_name("flash_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_loaded: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled kernel module, or None where it is switched off or cannot be built."""
    if not ENABLED:
        return None
    if "kernel" not in _loaded:
        _loaded["kernel"] = _build()
    return _loaded["kernel"]


def _build() -> ModuleType | None:
    try:
        import ninja  # the build tool torch's extension builder runs
        from torch.utils import cpp_extension

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        module: ModuleType = cpp_extension.load(
            name=f"qkv_flash_cpu_{_cpu_id()}_{_source_id()}",
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
        return module
    except Exception as error:  # no compiler, no ninja, a failed build: the loop still works
        warnings.warn(
            f"qkv: flash's compiled CPU kernel is unavailable ({type(error).__name__}: {error}); "
            'backend="flash" runs its PyTorch loop instead (same results, slower), and '
            'backend="auto" uses torch\'s kernel where it would have used this one. '
            "Set QKV_FLASH_KERNEL=0 to skip the kernel without this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def _source_id() -> str:
    """A short hash of the kernel's source: builds of different versions (another checkout of
    qkv sharing the cache) never take each other's place, so none loads a stale build."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def _cpu_id() -> str:
    """A short hash of this CPU's model and feature flags (what ``-march=native`` compiles for)."""
    description = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            description += "".join(
                line for line in cpuinfo if line.startswith(("flags", "model name"))
            )
    except OSError:  # not Linux: the platform's own description
        description += platform.processor()
    return hashlib.sha256(description.encode()).hexdigest()[:12]


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs these inputs (given no mask): it is
    switched on, the tensors are on the CPU in float32, float16 or bfloat16 and nothing is
    empty, and the kernel is built (the first call that asks builds it)."""
    return (
        ENABLED  # the cheapest tests first: auto asks on every call
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q.device.type == "cpu"
        and 0 not in (q.numel(), k.numel(), v.numel())
        and load() is not None
    )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    ranges: tuple[torch.Tensor, int] | None = None,
    softcap: float | None = None,
    slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``loop.forward`` (without a mask) on the compiled kernel: (out, lse) in float32, or None
    where it does not apply (``takes``). ``ranges``: (the keys [lo, hi) each query row may see,
    (R, Lq, 2) int64, and how many consecutive heads of q share one of the R), for a window or
    packed sequences (``rules.kernel_ranges``); the causal rule is then part of them.
    ``softcap``, and ALiBi ``slopes`` (one float32 per query head of the flattened (*B, Hq)),
    change each score before its exponential."""
    if not takes(q, k, v):
        return None
    kernel = load()  # built and cached by takes
    assert kernel is not None
    causal = causal_offset is not None
    bounds, heads_per_range = (torch.empty(0, dtype=torch.long), 1) if ranges is None else ranges
    rules = (softcap or 0.0, torch.empty(0) if slopes is None else slopes)
    if q.shape[-2] < DECODE_QUERIES:  # one row at a time, K/V read where they lie
        if q.dtype != torch.float16 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
            out, lse = kernel.decode(
                q, k, v, scale, causal, causal_offset or 0, bounds, heads_per_range, *rules
            )
            return out, lse  # the common case: (*B, Hq, Lq, Dv), (*B, Hq, Lq) as they come
        dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
        q_flat, k_flat, v_flat, batch = flat_heads(q, k, v, dtype)  # batch dims broadcast
        out, lse = kernel.decode(
            q_flat.flatten(0, 1),
            k_flat,
            v_flat,
            scale,
            causal,
            causal_offset or 0,
            bounds,
            heads_per_range,
            *rules,
        )
    else:
        low = q.dtype == torch.bfloat16 and kernel.bfloat16_products()
        dtype = torch.bfloat16 if low else torch.float32
        q_flat, k_flat, v_flat, batch = flat_heads(q, k, v, dtype)
        out, lse = kernel.forward(
            q_flat.flatten(0, 1).contiguous(),  # (N·g, Lq, Dk)
            k_flat.contiguous(),
            v_flat.contiguous(),
            scale,
            causal,
            causal_offset or 0,
            bounds,
            heads_per_range,
            *rules,
        )
    hq = q.shape[-3]
    return out.view(*batch, hq, *out.shape[1:]), lse.view(*batch, hq, lse.shape[-1])


def decode_step_takes(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Whether ``decode_step`` runs these inputs: few enough queries for the decoding path, one
    batch shape, not float16 (which that path takes only widened), and what ``takes`` asks."""
    return (
        q.shape[-2] < DECODE_QUERIES
        and q.dtype != torch.float16
        and q.dim() == k_new.dim() == 4
        and q.shape[0] == k_new.shape[0]
        and takes(q, k_new, v_new)
    )


def decode_step(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float,
    causal_offset: int | None,
) -> torch.Tensor:
    """Write k_new (B, Hkv, L, Dk) and v_new (B, Hkv, L, Dv) into a KV cache's buffers ``keys``
    and ``values`` (B, Hkv, capacity, ·) at ``start`` and attend q (B, Hq, L, Dk) to the first
    ``start + L`` positions, in one call (where ``decode_step_takes``). Returns (B, Hq, L, Dv)
    in q's dtype."""
    kernel = load()
    assert kernel is not None  # decode_step_takes said so
    causal = causal_offset is not None
    out: torch.Tensor = kernel.decode_step(
        q, k_new, v_new, keys, values, start, scale, causal, causal_offset or 0
    )
    return out
