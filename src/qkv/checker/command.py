"""The ``qkv check FILE.py:NAME`` command line: exit 0 when no check fails, 1 when one does, 2
when the implementation could not be run (with what to pass), never a traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qkv.checker.report import Report, render
from qkv.checker.run import check, load
from qkv.checker.target import CheckError, error_text, parse_options


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Grade a self-attention implementation: NAME in FILE.py is an nn.Module subclass\n"
        "(self-attention over x (B, L, E)) or a function f(q, k, v, ...). Twelve checks:\n"
        "shapes, weights, oracle, scale, causal, padding, fully-masked, batch, dropout,\n"
        "empty, dtypes, gradients. Each passes, fails with what is wrong and the numbers\n"
        "that show it, or is skipped with the reason.\n\n"
        "--flash grades a flash attention instead: a function or torch.autograd.Function\n"
        "f(q, k, v[, causal]) returning out or (out, lse): oracle, lse, backward, causal,\n"
        "alignment, odd-lengths, fully-masked, dtypes, determinism, memory, work (which\n"
        "warns, never fails)."
    )
    parser.epilog = (
        "examples:\n"
        "  qkv check my_attention.py:SelfAttention\n"
        "  qkv check my_attention.py:MultiHead --init d_model=64,n_heads=4 --json report.json\n"
        "  qkv check kernels.py:my_attention --forward scale=None\n"
        "  qkv check flash.py:FlashAttention --flash\n"
        "  qkv check --examples\n"
        "\nexit status: 0 no check failed, 1 a check failed, 2 it could not be run"
    )
    parser.add_argument("spec", metavar="FILE.py:NAME", nargs="?", help="what to check")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON (- = stdout)")
    parser.add_argument(
        "--init", metavar="K=V,...", help="constructor arguments, e.g. d_model=64,n_heads=4"
    )
    parser.add_argument(
        "--forward", metavar="K=V,...", help="keyword arguments for every call, e.g. scale=None"
    )
    parser.add_argument("--heads", type=int, help="the head count, when it cannot be read")
    parser.add_argument(
        "--device",
        help="where to run it, e.g. cuda (default: cpu); outputs are compared on the CPU",
    )
    parser.add_argument(
        "--flash",
        action="store_true",
        help="grade a flash attention: f(q, k, v[, causal]) or an autograd.Function returning "
        "out or (out, lse)",
    )
    parser.add_argument(
        "--examples",
        action="store_true",
        help="check each tutorial's implementation (examples/tutorials) and show what is found",
    )


def _console(stderr: bool = False) -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False, stderr=stderr)


def _say_error(message: str) -> int:
    console = _console(stderr=True)
    if console is None:
        print(f"error: {message}", file=sys.stderr)
    else:
        from rich.markup import escape

        console.print(f"[bold red]error:[/] {escape(message)}")
    return 2


def _show(report: Report, to_stdout: bool) -> None:
    """The card on the terminal (rich if installed, else plain text); on stderr when the JSON
    goes to stdout."""
    console = _console(stderr=to_stdout)
    if console is None:
        print(report.text(), file=sys.stderr if to_stdout else sys.stdout)
    else:
        render(report, console)


def run(args: argparse.Namespace) -> int:
    if args.examples:
        from qkv.checker.tutorials import run_examples

        return run_examples(_console())
    if not args.spec:
        return _say_error("give FILE.py:NAME to check (or --examples); see qkv check --help")
    try:
        obj = load(args.spec)
        report = check(
            obj,
            init=parse_options(args.init, "--init"),
            forward=parse_options(args.forward, "--forward"),
            heads=args.heads,
            name=args.spec,
            device=args.device,
            flash=args.flash,
        )
    except CheckError as error:
        return _say_error(str(error))
    except Exception as error:  # never a traceback: whatever stopped it, said in one line
        return _say_error(f"qkv check could not run {args.spec}: {error_text(error)}")
    _show(report, to_stdout=args.json == "-")
    if args.json:
        try:
            _write(report, args.json)
        except OSError as error:
            return _say_error(f"cannot write the JSON report to {args.json}: {error}")
    return 0 if report.ok else 1


def _write(report: Report, path: str) -> None:
    if path == "-":
        print(report.to_json())
    else:
        Path(path).write_text(report.to_json() + "\n", encoding="utf-8")
