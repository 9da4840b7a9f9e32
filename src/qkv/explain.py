"""``qkv explain TEXT``: one real attention computation, step by step, with pictures.

The model (by default the real all-MiniLM-L6-v2, running its attention through ``qkv.attention``)
reads TEXT inside ``qkv.trace()``. From the recorded call of the chosen layer, head and focus
token it prints the whole computation with its true numbers:

    X -> Q, K, V -> scores q·k -> × 1/√d_k -> mask -> softmax -> weighted sum of V

then one line per head saying what that head attends to, and writes pictures next to the user:
a heatmap of the chosen head, a grid of the layer's heads (PNG, SVG on request) and a
self-contained HTML viewer of every layer and head.

Texts longer than the model reads (512 tokens) are truncated to their first 512 tokens, with a
warning saying how many were dropped.
Legend: L tokens, E model width, H heads, D head size (d_k).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import qkv
from qkv.trace import AttentionRecord, Trace

MAX_TOKENS = 512  # all-MiniLM-L6-v2's position embeddings; the toy model keeps the same limit
MINILM = "all-MiniLM-L6-v2"
INSTALL_EXPLAIN = 'pip install "qkv[explain]"'
ALL_ROWS = 40  # score tables longer than this show only the most attended keys
SHOWN_ROWS = 24


class ExplainError(Exception):
    """Bad input for ``qkv explain``: the message says what was wrong and what to do."""


# --- the command line ----------------------------------------------------------------------------


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
        run_ = _load(args, console)
        walk = walkthrough(run_, layer=args.layer, head=args.head, token=args.token)
    except ExplainError as error:
        errors.print(f"[bold red]error:[/] {_markup_escape(str(error))}")
        return 2
    for warning in run_.warnings:
        console.print(f"[yellow]warning:[/] {_markup_escape(warning)}")
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
        console.print(f"  {_markup_escape(str(path))}  [dim]{what}[/]", soft_wrap=True)
    return 0


# --- running a model under qkv.trace() ------------------------------------------------------


@dataclass
class ModelRun:
    """What ``qkv explain`` needs from a model: its tokens and the trace of one forward pass."""

    model_name: str
    tokens: list[str]  # L
    special: list[bool]  # L: True for tokens the model adds ([CLS], [SEP])
    trace: Trace
    layers: int
    heads: int
    text: str
    model: Any = None
    inputs: Any = None
    warnings: tuple[str, ...] = ()


def _load(args: argparse.Namespace, console: Any) -> ModelRun:
    text = args.text
    if not text.strip():
        raise ExplainError('TEXT is empty; give a sentence, e.g. qkv explain "The cat sat."')
    if args.model == "random":
        return run_random(text, causal=args.causal, seed=args.seed)
    with console.status(f"Loading {MINILM} (checking its sha256, reading its weights)…"):
        tokenizer, model = load_minilm()
    with console.status("Running it through qkv…"):
        return run_minilm(text, tokenizer, model)


def load_minilm() -> tuple[Any, Any]:
    """``(tokenizer, model)`` of all-MiniLM-L6-v2 on qkv, or ``ExplainError`` naming the
    install command when a package is missing."""
    from qkv import pretrained

    try:
        pretrained.minilm_dir()  # the weights' package
        import transformers

        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        return pretrained.load_minilm(attn_implementation="qkv")
    except ImportError as error:
        raise ExplainError(
            f"the default model needs packages that are not installed ({error}). Install them "
            f"with: {INSTALL_EXPLAIN}   — or run the toy model, which needs nothing more: "
            "qkv explain TEXT --model random"
        ) from None
    except (OSError, ValueError) as error:  # damaged install or weights failing their sha256
        raise ExplainError(f"cannot load {MINILM}: {error}") from None


def run_minilm(text: str, tokenizer: Any, model: Any) -> ModelRun:
    """Tokenise ``text`` (truncating past 512 tokens, with a warning) and trace the model."""
    warnings = []
    ids = tokenizer(text, truncation=False, verbose=False)["input_ids"]
    limit = min(MAX_TOKENS, int(model.config.max_position_embeddings))
    if len(ids) > limit:
        warnings.append(
            f"TEXT has {len(ids)} tokens but {MINILM} reads at most {limit}: keeping the first "
            f"{limit} (the last {len(ids) - limit} are dropped)"
        )
    inputs = tokenizer(text, truncation=True, max_length=limit, return_tensors="pt")
    ids = inputs["input_ids"][0]
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    special = [i in set(tokenizer.all_special_ids) for i in ids.tolist()]
    if all(special):
        raise ExplainError(f"TEXT {text!r} has no tokens the model knows; give words")
    with torch.no_grad(), qkv.trace(model) as trace:
        model(**inputs)
    trace.tokens = tokens
    return ModelRun(
        model_name=MINILM,
        tokens=tokens,
        special=special,
        trace=trace,
        layers=int(model.config.num_hidden_layers),
        heads=int(model.config.num_attention_heads),
        text=text,
        model=model,
        inputs=inputs,
        warnings=tuple(warnings),
    )


# the toy model: a word-level tokenizer and one randomly initialised qkv.SelfAttention

TOY_WIDTH, TOY_HEADS = 16, 2


def toy_tokens(text: str) -> list[str]:
    """Words and punctuation marks: "The cat sat." -> ["The", "cat", "sat", "."]."""
    return re.findall(r"\w+|[^\w\s]", text)


def toy_embeddings(tokens: Sequence[str], width: int = TOY_WIDTH) -> torch.Tensor:
    """(L, E) inputs X: a fixed random vector per distinct token (seeded by its text) plus
    sinusoidal position codes, so that equal words at different places differ."""
    rows = []
    for token in tokens:
        seed = int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "little")
        rows.append(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    x = torch.stack(rows) if rows else torch.empty(0, width)
    position = torch.arange(len(tokens), dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(10000.0) * torch.arange(0, width, 2) / width)
    x[:, 0::2] += torch.sin(position * frequency)
    x[:, 1::2] += torch.cos(position * frequency)
    return x


def toy_model(*, causal: bool = False, seed: int = 0) -> qkv.SelfAttention:
    """A randomly initialised ``qkv.SelfAttention(16, heads=2, bias=True)`` (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return qkv.SelfAttention(TOY_WIDTH, TOY_HEADS, bias=True, causal=causal).eval()


def run_random(text: str, *, causal: bool = False, seed: int = 0) -> ModelRun:
    """Trace the toy model on ``text`` (truncated to 512 tokens, with a warning)."""
    tokens = toy_tokens(text)
    if not tokens:
        raise ExplainError(f"TEXT {text!r} has no words or punctuation to attend between")
    warnings = []
    if len(tokens) > MAX_TOKENS:
        warnings.append(
            f"TEXT has {len(tokens)} tokens but the toy model reads at most {MAX_TOKENS}: "
            f"keeping the first {MAX_TOKENS} (the last {len(tokens) - MAX_TOKENS} are dropped)"
        )
        tokens = tokens[:MAX_TOKENS]
    model = toy_model(causal=causal, seed=seed)
    x = toy_embeddings(tokens)[None]  # (1, L, E)
    with torch.no_grad(), qkv.trace(model) as trace:
        model(x)
    trace.tokens = tokens
    name = f"random qkv.SelfAttention({TOY_WIDTH}, heads={TOY_HEADS}, causal={causal})"
    return ModelRun(
        model_name=name,
        tokens=tokens,
        special=[False] * len(tokens),
        trace=trace,
        layers=1,
        heads=TOY_HEADS,
        text=text,
        model=model,
        inputs=x,
        warnings=tuple(warnings),
    )


# --- the walkthrough: every number shown, computed from the trace -----------------------------


@dataclass
class Walkthrough:
    """The numbers ``qkv explain`` prints for one layer, head and focus token i."""

    layer: int
    head: int
    token: int  # i, the focus (query) position
    x: torch.Tensor  # (L, E) the layer's input, one row per token
    q_all: torch.Tensor  # (L, H·D) queries of every head (Q = X W_Q + b_Q)
    k_all: torch.Tensor  # (L, Hkv·D)
    v_all: torch.Tensor  # (L, Hkv·Dv)
    q: torch.Tensor  # (L, D) this head's queries
    k: torch.Tensor  # (L, D) this head's keys
    v: torch.Tensor  # (L, Dv) this head's values
    dots: torch.Tensor  # (L,) q_i · k_j for every key j
    scale: float  # 1/√d_k unless the model says otherwise
    scores: torch.Tensor  # (L,) q_i · k_j × scale (+ a float mask's value)
    keep: torch.Tensor  # (L,) bool, True = query i may attend key j
    weights: torch.Tensor  # (L,) softmax of the scores over the keys it may attend
    out: torch.Tensor  # (Dv,) the head's output for token i: Σ_j weights_j v_j
    head_weights: torch.Tensor  # (H, L, L) every head of the layer, for the summaries

    @property
    def d_k(self) -> int:
        return int(self.q.shape[-1])


def walkthrough(
    run: ModelRun, *, layer: int | None = None, head: int | None = None, token: Any = None
) -> Walkthrough:
    """The walkthrough of ``layer``/``head`` (ints, negative counts from the end) for the focus
    ``token`` (an index, its text, or None: the last word) from the trace of ``run``."""
    layer = _index("--layer", 0 if layer is None else layer, run.layers, "layers")
    head = _index("--head", 0 if head is None else head, run.heads, "heads")
    i = focus_index(run.tokens, run.special, token)
    record = _record(run.trace, layer)
    for name in ("x", "q", "k", "v", "weights", "out"):
        if getattr(record, name) is None:
            raise ExplainError(f"the trace of layer {layer} kept no {name}")
    assert record.x is not None and record.q is not None and record.k is not None
    assert record.v is not None and record.weights is not None and record.out is not None
    kv_head = head // record.groups
    length = len(run.tokens)
    q = record.q.reshape(-1, *record.q.shape[-3:])[0]  # (H, L, D)
    k = record.k.reshape(-1, *record.k.shape[-3:])[0]  # (Hkv, L, D)
    v = record.v.reshape(-1, *record.v.shape[-3:])[0]  # (Hkv, L, Dv)
    scores = record.scores.reshape(-1, *record.shape[-3:])[0]  # (H, L, L)
    weights = record.weights.reshape(-1, *record.shape[-3:])[0]  # (H, L, L)
    keep = record.mask
    keep_row = (
        torch.ones(length, dtype=torch.bool)
        if keep is None
        else keep.expand(record.shape).reshape(-1, *record.shape[-3:])[0, head, i].cpu()
    )
    return Walkthrough(
        layer=layer,
        head=head,
        token=i,
        x=record.x.reshape(-1, *record.x.shape[-2:])[0].float(),
        q_all=q.transpose(0, 1).reshape(length, -1).float(),
        k_all=k.transpose(0, 1).reshape(length, -1).float(),
        v_all=v.transpose(0, 1).reshape(length, -1).float(),
        q=q[head].float(),
        k=k[kv_head].float(),
        v=v[kv_head].float(),
        dots=(q[head, i].double() @ k[kv_head].double().T).float(),
        scale=record.scale,
        scores=scores[head, i].float(),
        keep=keep_row,
        weights=weights[head, i].float(),
        out=record.out.reshape(-1, *record.out.shape[-3:])[0, head, i].float(),
        head_weights=weights.float(),
    )


def focus_index(tokens: Sequence[str], special: Sequence[bool], token: Any) -> int:
    """The focus position: ``token`` as an index or a token's text; None: the last word."""
    if token is None:
        words = [i for i, t in enumerate(tokens) if not special[i] and any(c.isalnum() for c in t)]
        plain = [i for i, s in enumerate(special) if not s]
        return (words or plain or [len(tokens) - 1])[-1]
    text = str(token).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return _index("--token", int(text), len(tokens), "tokens")
    wanted = text.lower()
    for candidate in (wanted, wanted.removeprefix("##")):
        for i, t in enumerate(tokens):
            if t.lower() == candidate or t.lower().removeprefix("##") == candidate:
                return i
    listing = " ".join(f"{i}:{t}" for i, t in enumerate(tokens[:60]))
    more = " …" if len(tokens) > 60 else ""
    raise ExplainError(
        f"--token {text!r} is not one of the tokens; give its text or index. "
        f"Tokens: {listing}{more}"
    )


def _index(option: str, value: int, count: int, what: str) -> int:
    if not -count <= value < count:
        raise ExplainError(
            f"{option} {value} is out of range: there are {count} {what} "
            f"(0 to {count - 1}, or -1 for the last)"
        )
    return value % count


def _record(trace: Trace, layer: int) -> AttentionRecord:
    try:
        return trace.layer(layer)
    except ValueError:
        raise ExplainError(f"no attention call of layer {layer} was recorded") from None


# --- what each head attends to --------------------------------------------------------------


def head_summary(weights: torch.Tensor, tokens: Sequence[str], special: Sequence[bool]) -> str:
    """What one head's (L, L) weights mostly go to, averaged over the queries: the previous or
    next token, the token itself, a special token ([CLS], [SEP]), or nothing in particular."""
    length = weights.shape[-1]
    if length == 0:
        return "nothing to attend to"
    positions = torch.arange(length)
    patterns: dict[str, float] = {"itself": float(weights[positions, positions].mean())}
    if length > 1:
        patterns["the previous token"] = float(weights[positions[1:], positions[:-1]].mean())
        patterns["the next token"] = float(weights[positions[:-1], positions[1:]].mean())
    for j in sorted({0, length - 1}):
        if special[j]:
            patterns[tokens[j]] = float(weights[:, j].mean())
    name, share = max(patterns.items(), key=lambda item: item[1])
    if share >= 0.5:
        return f"mostly {name} ({share:.0%})"
    if share >= 0.3:
        return f"{name} ({share:.0%}), the rest spread out"
    return f"spread out; at most {share:.0%} on {name}"


# --- printing -------------------------------------------------------------------------------


def render(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """Print the walkthrough with rich (fits 80 columns)."""
    from rich import box
    from rich.table import Table

    tokens, i, h = run.tokens, walk.token, walk.head
    length, width = walk.x.shape
    heads, d_k = run.heads, walk.d_k
    focus = _quoted(tokens[i])
    console.print()
    console.rule(f"[bold]qkv explain[/] · {_markup_escape(run.model_name)}")
    console.print(
        f"Layer [bold]{walk.layer}[/] (of {run.layers}), head [bold]{h}[/] (of {heads}), "
        f"focus token [bold]{i}[/] {focus} "
        "[dim](pick others with --layer, --head, --token)[/]"
    )

    _step(console, 1, "Tokens", f"the text as the model reads it: {length} positions")
    listed = " ".join(f"[dim]{j}:[/]{_markup_escape(t)}" for j, t in enumerate(tokens[:200]))
    console.print("  " + listed + (f" [dim]… ({length - 200} more)[/]" if length > 200 else ""))

    _step(console, 2, "X", f"the layer's input, one row of {width} numbers per token")
    console.print(f"  X {_shape(walk.x)}   x_{i} {_vector(walk.x[i])}  {focus}")

    _step(console, 3, "Q, K, V", "learned projections of X: Q = X·W_Q + b_Q, K and V alike")
    console.print(
        f"  Q {_shape(walk.q_all)}, K {_shape(walk.k_all)}, V {_shape(walk.v_all)}, split "
        f"into {heads} heads of d_k = {d_k}"
    )
    console.print(f"  head {h}: Q_{h}, K_{h}, V_{h} {_shape(walk.q)}; the rows of token {i}:")
    console.print(f"  q_{i} {_vector(walk.q[i])}  what {focus} looks for")
    console.print(f"  k_{i} {_vector(walk.k[i])}  what {focus} offers")
    console.print(f"  v_{i} {_vector(walk.v[i])}  what {focus} passes on")

    _step(console, 4, "Scores", f"q_{i}·k_j, how well {focus} matches each token j (table)")
    scale_is_default = math.isclose(walk.scale, 1 / math.sqrt(d_k), rel_tol=1e-6)
    _step(
        console,
        5,
        "Scale",
        f"× 1/√d_k = 1/√{d_k} = {walk.scale:.4f}"
        if scale_is_default
        else f"× {walk.scale:.4f}, this model's own scale (1/√d_k = {1 / math.sqrt(d_k):.4f})",
    )
    console.print(
        f"  [dim]Why: q·k adds up d_k = {d_k} products, so its spread grows like √d_k. "
        "Unscaled, the scores of big heads are huge, the softmax turns almost one-hot and "
        f"its gradients vanish. d_k is the head size ({d_k}), not the model width "
        f"({width}).[/]"
    )
    blocked = int((~walk.keep).sum())
    mask_text = f"{focus} may attend all {length} tokens (True = may attend)"
    if blocked:
        mask_text = (
            f"{focus} may attend {length - blocked} of {length} tokens (✓); the {blocked} "
            "blocked ones (✗) get score -inf, and exp(-inf) = 0 weight"
        )
    _step(console, 6, "Mask", mask_text)
    total = float(walk.weights.sum())
    _step(console, 7, "Softmax", f"weight_j = exp(score_j) / Σ_k exp(score_k), sum {total:.6f}")

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("j", justify="right")
    table.add_column("token j", no_wrap=True, overflow="ellipsis", max_width=14)
    table.add_column(f"q_{i}·k_j", justify="right")
    table.add_column("×1/√d_k" if scale_is_default else "×scale", justify="right")
    table.add_column("mask", justify="center")
    table.add_column("weight", justify="right")
    table.add_column("", no_wrap=True)
    rows = list(range(length))
    if length > ALL_ROWS:
        rows = sorted(torch.argsort(walk.weights, descending=True)[:SHOWN_ROWS].tolist())
    top_weight = float(walk.weights.max()) if length else 1.0
    for j in rows:
        allowed = bool(walk.keep[j])
        weight = float(walk.weights[j])
        bar = "█" * round(12 * weight / top_weight) if top_weight > 0 else ""
        table.add_row(
            str(j),
            _markup_escape(tokens[j]),
            f"{float(walk.dots[j]):.4f}",
            f"{float(walk.scores[j]):.4f}" if allowed else "-inf",
            "✓" if allowed else "✗",
            f"{weight:.4f}",
            f"[blue]{bar}[/]",
            style="bold" if j == i else None,
        )
    console.print(table)
    if len(rows) < length:
        rest = 1.0 - float(walk.weights[rows].sum())
        console.print(
            f"  [dim]… the {len(rows)} most attended of {length} keys; the other "
            f"{length - len(rows)} share {rest:.4f} of the weight (see the HTML viewer)[/]"
        )
    order = torch.argsort(walk.weights, descending=True)[:3].tolist()
    most = ", ".join(f"{_quoted(tokens[j])} ({j}) {float(walk.weights[j]):.4f}" for j in order)
    console.print(f"  Most attended by {focus}: {most}")

    _step(console, 8, "Output", f"Σ_j weight_j·v_j, a blend of the values: out_{i} =")
    terms = " + ".join(f"{float(walk.weights[j]):.3f}·v_{j}" for j in order)
    more = " + …" if length > len(order) else ""
    console.print(f"  {terms}{more}")
    console.print(f"  = {_vector(walk.out)}")
    recomputed = walk.weights.double() @ walk.v.double()
    difference = float((recomputed - walk.out.double()).abs().max()) if length else 0.0
    console.print(
        f"  [dim]Σ weight·v recomputed from the numbers above matches qkv's output "
        f"(max difference {difference:.1e}). The {heads} heads' outputs are concatenated, "
        f"({length}, {heads * walk.out.shape[-1]}), and mixed by the output projection W_O.[/]"
    )

    console.print()
    console.rule(f"[bold]What each head of layer {walk.layer} attends to")
    summary = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    summary.add_column("head", justify="right")
    summary.add_column("on average (over every token)")
    summary.add_column(f"top word for {focus}", no_wrap=True, overflow="ellipsis")
    words = torch.tensor([not s for s in run.special]) if any(not s for s in run.special) else None
    strongest = (0.0, 0, 0)  # (weight, head, key): the focus token's strongest link to a word
    for head in range(heads):
        row = walk.head_weights[head, i]
        shown = row if words is None else row.masked_fill(~words, -1.0)  # skip [CLS]/[SEP]
        j = int(shown.argmax()) if length else 0
        if length and j != i and float(row[j]) > strongest[0]:
            strongest = (float(row[j]), head, j)
        summary.add_row(
            f"▶ {head}" if head == h else str(head),
            _markup_escape(head_summary(walk.head_weights[head], tokens, run.special)),
            f"{_quoted(tokens[j])} {float(row[j]):.2f}" if length else "",
            style="bold" if head == h else None,
        )
    console.print(summary)
    weight, head, j = strongest
    if weight > 0:
        console.print(
            f"  Strongest link from {focus} to another word in this layer: head {head} → "
            f"{_quoted(tokens[j])} ({weight:.2f}); see it with --head {head}"
        )


def _step(console: Any, number: int, title: str, text: str) -> None:
    console.print()
    console.print(f"[bold cyan]{number}. {title}[/]  {text}")


def _vector(x: torch.Tensor, shown: int = 4) -> str:
    values = [f"{float(v):+.4f}" for v in x[:shown]]
    if x.shape[-1] > shown:
        values.append(f"… ({x.shape[-1]} numbers)")
    return "[" + ", ".join(values) + "]"


def _shape(x: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def _quoted(token: str) -> str:
    return "“" + _markup_escape(token) + "”"


def _markup_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --- pictures -------------------------------------------------------------------------------


def write_pictures(
    walk: Walkthrough, run: ModelRun, out: Path, *, svg: bool = False
) -> list[tuple[Path, str]]:
    """Write the heatmaps and the HTML viewer into ``out``; returns (path, description)."""
    from qkv import viz

    out.mkdir(parents=True, exist_ok=True)
    layer, head = walk.layer, walk.head
    stem = out / f"qkv-explain-layer{layer}-head{head}"
    grid_stem = out / f"qkv-explain-layer{layer}-heads"
    files = []
    suffixes = (".png", ".svg") if svg else (".png",)
    for suffix in suffixes:
        figure = viz.heatmap(
            run.trace,
            layer=layer,
            head=head,
            title=f"{run.model_name}\nlayer {layer}, head {head}",
        )
        files.append((viz.save(figure, stem.with_suffix(suffix)), f"heatmap of head {head}"))
        figure = viz.head_grid(run.trace, layer=layer, title=f"layer {layer}: every head")
        files.append(
            (viz.save(figure, grid_stem.with_suffix(suffix)), f"all heads of layer {layer}")
        )
    page = viz.view(
        run.trace,
        layer=layer,
        head=head,
        token=walk.token,
        title=f"{run.model_name} · “{_clip(run.text, 80)}”",
        subtitle=f"{len(run.tokens)} tokens: " + _clip(" ".join(run.tokens), 300),
    )
    html_path = page.save(out / "qkv-explain.html")
    files.append((html_path, "viewer of every layer and head"))
    return files


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
