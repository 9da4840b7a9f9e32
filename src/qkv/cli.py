"""The ``qkv`` command: ``qkv explain TEXT`` (the main job), ``qkv bench``, ``qkv check`` and
``qkv build``.

Each subcommand lives in its own module, which provides ``configure(parser)`` and ``run(args)``;
they are imported only when used, so ``qkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "explain": (
        "qkv.explain.command",
        "walk through one attention computation step by step, with pictures",
    ),
    "bench": ("qkv.bench.command", "measure qkv's backends against PyTorch"),
    "check": (
        "qkv.checker.command",
        "grade a self-attention implementation (FILE.py:NAME) and say what is wrong",
    ),
    "build": (
        "qkv.backends.flash.build_command",
        "build flash's compiled CPU kernel now, not on first use",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention (Q/K/V) from scratch in PyTorch, done right."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # only the chosen subcommand's module is imported
            importlib.import_module(module_name).configure(sub)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
