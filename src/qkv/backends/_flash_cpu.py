"""Builds and loads flash's compiled CPU kernel (``flash_cpu.cpp``) the first time it is needed.

The kernel is compiled for the machine it runs on (``-march=native``) with torch's C++ extension
tooling (a C++ compiler and ninja) and cached by torch under ``~/.cache/torch_extensions`` (the
environment variable ``TORCH_EXTENSIONS_DIR`` moves it), so only the first use in a fresh
environment pays the ~30 s build. The cached build is named after the CPU's feature flags, so a
cache shared by different machines never hands one a build for another's instruction set. Where
it cannot be built, qkv warns once; flash then runs its PyTorch loop, which computes the same
thing more slowly, and ``"auto"`` picks torch's kernel instead. ``QKV_FLASH_KERNEL=0`` skips
the kernel without trying.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

_SOURCE = Path(__file__).with_name("flash_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_loaded: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled kernel module, or None where it is switched off or cannot be built."""
    if "kernel" not in _loaded:
        _loaded["kernel"] = _build()
    return _loaded["kernel"]


def _build() -> ModuleType | None:
    if os.environ.get("QKV_FLASH_KERNEL", "1") == "0":
        return None
    try:
        import ninja  # the build tool torch's extension builder runs
        from torch.utils import cpp_extension

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        return cpp_extension.load(
            name=f"qkv_flash_cpu_{_cpu_id()}",
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
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
