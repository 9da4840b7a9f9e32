"""The ``qkv build`` command: build flash's compiled CPU kernel ahead of time.

    qkv build               # for QKV_FLASH_ISA (by default native: everything this CPU has)
    qkv build --isa avx2    # the build a CPU with AVX2 and nothing newer runs

Otherwise the first call that needs the kernel builds it (about a minute); building it once
where the environment is made (a Docker image, a CI cache step) spares every later call that
wait. Prints what was built and where; exits with 1, saying why, where it cannot be built.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from qkv.backends.flash import kernel


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``qkv build``'s arguments to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument(
        "--isa",
        choices=kernel.ISAS,
        default=kernel.ISA,
        help=f"the instruction set to build for (default: QKV_FLASH_ISA, here {kernel.ISA})",
    )


def run(args: argparse.Namespace) -> int:
    """Build (or load the cached build of) the kernel for ``args.isa`` and say what it is."""
    if args.isa != kernel.ISA:  # a process runs one ISA's build (QKV_FLASH_ISA): start one
        command = [sys.executable, "-m", "qkv", "build", "--isa", args.isa]
        environment = {**os.environ, "QKV_FLASH_ISA": args.isa}
        return subprocess.run(command, env=environment, check=False).returncode
    if not kernel.ENABLED:
        print("qkv build: QKV_FLASH_KERNEL=0 switches the kernel off here", file=sys.stderr)
        return 1
    try:
        kernel.build(args.isa)
    except Exception as error:  # the reason, not a traceback: this is the command's answer
        reason = f"{type(error).__name__}: {error}"
        print(f"qkv build: flash's CPU kernel cannot be built here ({reason})", file=sys.stderr)
        return 1
    print(f"flash's CPU kernel, built in {kernel.build_folder(args.isa)}:")
    for key, value in kernel.build_info().items():
        print(f"  {key}: {value}")
    return 0
