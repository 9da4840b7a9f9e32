"""The ``qkv explain TEXT`` command line: arguments, loading the model, printing, pictures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qkv.explain.models import (
    INSTALL_EXPLAIN,
    MAX_TOKENS,
    MINILM,
    ExplainError,
    ModelRun,
    load_minilm,
    run_minilm,
    run_random,
)
from qkv.explain.render import markup_escape, render, write_pictures
from qkv.explain.walkthrough import walkthrough


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Walk through one attention computation on TEXT with the model's true numbers:\n"
        "tokens, X, Q, K, V, the scores q·k, the scale 1/√d_k, the mask, the softmax\n"
        "weights and the output as a weighted sum of V; then what every head attends to.\n"
        "Writes a heatmap PNG of the head, a PNG of all heads of the layer and an HTML\n"
        "viewer of every layer and head (no network needed to open it)."
    )
    parser.epilog = (
        "examples:\n"
        '  qkv explain "The cat sat on the mat."\n'
        '  qkv explain "The cat sat on the mat." --layer 2 --head 5 --token cat\n'
        '  qkv explain "The cat sat on the mat." --model random --causal\n'
        f"\nTexts longer than {MAX_TOKENS} tokens are truncated to their first {MAX_TOKENS}."
    )
    parser.add_argument("text", metavar="TEXT", help="the text to run through the model")
    parser.add_argument(
        "--model",
        choices=("minilm", "random"),
        default="minilm",
        help=f"minilm: the real {MINILM} (default); random: a small randomly "
        "initialised qkv.SelfAttention with a toy tokenizer (nothing to install)",
    )
    parser.add_argument("--layer", type=int, help="layer to explain (default: 0; -1 = last)")
    parser.add_argument("--head", type=int, help="head to explain (default: 0)")
    parser.add_argument(
        "--token",
        help="focus token: an index (0 = first, -1 = last) or the token's text "
        "(default: the last word)",
    )
    parser.add_argument(
        "--causal",
        action="store_true",
        help="--model random only: a causal mask (each token sees only itself and earlier ones)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("."), help="folder for the pictures (default: here)"
    )
    parser.add_argument("--svg", action="store_true", help="also write the heatmaps as SVG")
    parser.add_argument(
        "--seed", type=int, default=0, help="--model random only: weights' random seed"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
    except ImportError:
        print(f"error: qkv explain needs rich and matplotlib: {INSTALL_EXPLAIN}")
        return 1
    console = Console(highlight=False)
    errors = Console(stderr=True, highlight=False)
    try:
        if args.causal and args.model != "random":
            raise ExplainError(
                f"--causal needs --model random: {MINILM} is an encoder whose tokens all see "
                "each other (try: qkv explain TEXT --model random --causal)"
            )
        run_ = load(args, console)
        walk = walkthrough(run_, layer=args.layer, head=args.head, token=args.token)
    except ExplainError as error:
        errors.print(f"[bold red]error:[/] {markup_escape(str(error))}")
        return 2
    for warning in run_.warnings:
        console.print(f"[yellow]warning:[/] {markup_escape(warning)}")
    render(walk, run_, console)
    try:
        files = write_pictures(walk, run_, args.out, svg=args.svg)
    except ImportError:
        errors.print(f"[bold red]error:[/] the pictures need matplotlib: {INSTALL_EXPLAIN}")
        return 1
    except OSError as error:
        errors.print(f"[bold red]error:[/] cannot write the pictures to {args.out}: {error}")
        return 1
    console.print()
    console.rule("[bold]Pictures")
    for path, what in files:  # one line each, never wrapped: easy to copy
        console.print(f"  {markup_escape(str(path))}  [dim]{what}[/]", soft_wrap=True)
    return 0


def load(args: argparse.Namespace, console: Any) -> ModelRun:
    text = args.text
    if not text.strip():
        raise ExplainError('TEXT is empty; give a sentence, e.g. qkv explain "The cat sat."')
    if args.model == "random":
        return run_random(text, causal=args.causal, seed=args.seed)
    with console.status(f"Loading {MINILM} (checking its sha256, reading its weights)…"):
        tokenizer, model = load_minilm()
    with console.status("Running it through qkv…"):
        return run_minilm(text, tokenizer, model)
