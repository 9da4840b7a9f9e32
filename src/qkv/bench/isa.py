"""``qkv bench --isa``: measuring a build of flash's kernel for another instruction set.

``--isa avx2`` runs the whole benchmark in a fresh process as a CPU with AVX2 and nothing newer
would: flash's kernel built for AVX2 (``QKV_FLASH_ISA``), and torch held to the same instructions,
so that the ratios compare like with like: its own CPU kernels (``ATEN_CPU_CAPABILITY``), oneDNN
(``ONEDNN_MAX_CPU_ISA``) and MKL (``MKL_ENABLE_INSTRUCTIONS``). ``--isa avx512`` does the same for
AVX-512 without the newer extensions (no bfloat16 or matrix units); ``--isa native`` (the
default) runs everything as built for this CPU. A variable already set in the environment is
kept (``ONEDNN_MAX_CPU_ISA=ALL qkv bench --isa avx2`` lets torch's oneDNN use everything). The
libraries read these variables once, when first used, hence the fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from qkv.backends.flash import kernel

# What each ISA holds torch's libraries to.
LIMITS = {
    "native": {},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
# Set in the fresh process: the ISA it was started for.
_MARKER = "QKV_BENCH_ISA"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--isa``, and the hidden ``--settings`` that hands a run to its fresh process."""
    parser.add_argument(
        "--isa",
        choices=kernel.ISAS,
        default=None,
        help="the build of flash's kernel to measure, in a fresh process with torch held to the "
        "same instructions: native (this CPU's, the default), avx512 or avx2",
    )
    parser.add_argument("--settings", help=argparse.SUPPRESS)


def environment(isa: str) -> dict[str, str]:
    """The environment of a process that runs as a CPU with ``isa`` would."""
    env = {**os.environ, "QKV_FLASH_ISA": isa, _MARKER: isa}
    for name, value in LIMITS[isa].items():
        env.setdefault(name, value)
    return env


def needs_fresh_process(isa: str | None) -> bool:
    """Whether ``--isa isa`` asks for another process than this one (None: no --isa)."""
    if isa is None or os.environ.get(_MARKER) == isa:
        return False
    return not (isa == "native" and kernel.ISA == "native")  # native here: this process


def rerun(args: argparse.Namespace) -> int:
    """Run this ``qkv bench`` (the settings in ``args``) again in a fresh process for
    ``args.isa``; its output is this command's output."""
    settings = json.dumps(vars(args))
    command = [sys.executable, "-m", "qkv", "bench", "--settings", settings]
    return subprocess.run(command, env=environment(args.isa), check=False).returncode


def settings(text: str) -> argparse.Namespace:
    """The settings a parent process passed (``rerun``)."""
    return argparse.Namespace(**json.loads(text))


def describe(info: dict[str, object]) -> str:
    """One line naming the build: flash's kernel (ISA, vector width, product paths) and the
    instruction set torch's own CPU kernels run."""
    if not info.get("built"):
        kernel_line = f"flash kernel ({info.get('isa')}): not built, flash runs its PyTorch loop"
    else:
        kernel_line = (
            f"flash kernel: --isa {info['isa']} ({info['capability']}, {info['vector_bits']}-bit "
            f"vectors), float32 products: {info['float32_products']}, "
            f"bfloat16 products: {info['bfloat16_products']}"
        )
    return f"{kernel_line}; torch's CPU kernels: {info.get('torch_capability')}"
