"""Printing the walkthrough (rich, 80 columns) and writing its pictures (``qkv.viz``).

The printed steps follow the formula:

    X -> Q, K, V -> scores q·k -> × 1/√d_k -> mask -> softmax -> weighted sum of V

then one line per head saying what that head attends to.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from qkv.explain.models import ModelRun
from qkv.explain.walkthrough import Walkthrough, head_summary

ALL_ROWS = 40  # score tables longer than this show only the most attended keys
SHOWN_ROWS = 24


def render(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """Print the walkthrough with rich (fits 80 columns)."""
    tokens, i = run.tokens, walk.token
    console.print()
    console.rule(f"[bold]qkv explain[/] · {markup_escape(run.model_name)}")
    console.print(
        f"Layer [bold]{walk.layer}[/] (of {run.layers}), head [bold]{walk.head}[/] (of "
        f"{run.heads}), focus token [bold]{i}[/] {_quoted(tokens[i])} "
        "[dim](pick others with --layer, --head, --token)[/]"
    )
    _inputs(walk, run, console)
    _scores(walk, run, console)
    _output(walk, run, console)
    _heads(walk, run, console)


def _inputs(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """Steps 1 to 3: the tokens, X and the projections Q, K, V."""
    tokens, i, h = run.tokens, walk.token, walk.head
    length, width = walk.x.shape
    focus = _quoted(tokens[i])
    _step(console, 1, "Tokens", f"the text as the model reads it: {length} positions")
    listed = " ".join(f"[dim]{j}:[/]{markup_escape(t)}" for j, t in enumerate(tokens[:200]))
    console.print("  " + listed + (f" [dim]… ({length - 200} more)[/]" if length > 200 else ""))

    _step(console, 2, "X", f"the layer's input, one row of {width} numbers per token")
    console.print(f"  X {_shape(walk.x)}   x_{i} {_vector(walk.x[i])}  {focus}")

    _step(console, 3, "Q, K, V", "learned projections of X: Q = X·W_Q + b_Q, K and V alike")
    console.print(
        f"  Q {_shape(walk.q_all)}, K {_shape(walk.k_all)}, V {_shape(walk.v_all)}, split "
        f"into {run.heads} heads of d_k = {walk.d_k}"
    )
    console.print(f"  head {h}: Q_{h}, K_{h}, V_{h} {_shape(walk.q)}; the rows of token {i}:")
    console.print(f"  q_{i} {_vector(walk.q[i])}  what {focus} looks for")
    console.print(f"  k_{i} {_vector(walk.k[i])}  what {focus} offers")
    console.print(f"  v_{i} {_vector(walk.v[i])}  what {focus} passes on")


def _scale_is_default(walk: Walkthrough) -> bool:
    return math.isclose(walk.scale, 1 / math.sqrt(walk.d_k), rel_tol=1e-6)


def _scores(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """Steps 4 to 7: the scores, the scale (and why), the mask and the softmax, with the table."""
    focus, d_k = _quoted(run.tokens[walk.token]), walk.d_k
    length, width = walk.x.shape
    _step(
        console, 4, "Scores", f"q_{walk.token}·k_j, how well {focus} matches each token j (table)"
    )
    _step(
        console,
        5,
        "Scale",
        f"× 1/√d_k = 1/√{d_k} = {walk.scale:.4f}"
        if _scale_is_default(walk)
        else f"× {walk.scale:.4f}, this model's own scale (1/√d_k = {1 / math.sqrt(d_k):.4f})",
    )
    console.print(
        f"  [dim]Why: q·k adds up d_k = {d_k} products, so its spread grows like √d_k. "
        "Unscaled, the scores of big heads are huge, the softmax turns almost one-hot and "
        f"its gradients vanish. d_k is the head size ({d_k}), not the model width "
        f"({width}).[/]"
    )
    if walk.softcap is not None:
        console.print(
            f"  Soft-capped: score = {walk.softcap:g} · tanh(score / {walk.softcap:g}), so no "
            f"score leaves (-{walk.softcap:g}, {walk.softcap:g}) (the table shows capped scores)"
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
    if walk.sink is not None:
        console.print(
            f"  Sink: this head's sink, a key of logit {walk.sink:.4f} and value 0, joins the "
            f"softmax and takes weight {1 - total:.6f}, so the tokens' weights sum to less than 1"
        )
    _score_table(walk, run, console)


def _score_table(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """One row per key j (the most attended ones for long texts): q·k, scaled, mask, weight."""
    from rich import box
    from rich.table import Table

    tokens, i, length = run.tokens, walk.token, walk.x.shape[0]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("j", justify="right")
    table.add_column("token j", no_wrap=True, overflow="ellipsis", max_width=14)
    table.add_column(f"q_{i}·k_j", justify="right")
    table.add_column("×1/√d_k" if _scale_is_default(walk) else "×scale", justify="right")
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
            markup_escape(tokens[j]),
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


def _output(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """Step 8: the output as a weighted sum of the values, checked against qkv's own."""
    tokens, i, length, heads = run.tokens, walk.token, walk.x.shape[0], run.heads
    order = torch.argsort(walk.weights, descending=True)[:3].tolist()
    most = ", ".join(f"{_quoted(tokens[j])} ({j}) {float(walk.weights[j]):.4f}" for j in order)
    console.print(f"  Most attended by {_quoted(tokens[i])}: {most}")

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


def _heads(walk: Walkthrough, run: ModelRun, console: Any) -> None:
    """What each head of the layer attends to, and the focus token's strongest link."""
    from rich import box
    from rich.table import Table

    tokens, i, length = run.tokens, walk.token, walk.x.shape[0]
    focus = _quoted(tokens[i])
    console.print()
    console.rule(f"[bold]What each head of layer {walk.layer} attends to")
    summary = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    summary.add_column("head", justify="right")
    summary.add_column("on average (over every token)")
    summary.add_column(f"top word for {focus}", no_wrap=True, overflow="ellipsis")
    words = torch.tensor([not s for s in run.special]) if any(not s for s in run.special) else None
    strongest = (0.0, 0, 0)  # (weight, head, key): the focus token's strongest link to a word
    for head in range(run.heads):
        row = walk.head_weights[head, i]
        shown = row if words is None else row.masked_fill(~words, -1.0)  # skip [CLS]/[SEP]
        j = int(shown.argmax()) if length else 0
        if length and j != i and float(row[j]) > strongest[0]:
            strongest = (float(row[j]), head, j)
        summary.add_row(
            f"▶ {head}" if head == walk.head else str(head),
            markup_escape(head_summary(walk.head_weights[head], tokens, run.special)),
            f"{_quoted(tokens[j])} {float(row[j]):.2f}" if length else "",
            style="bold" if head == walk.head else None,
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
    return "“" + markup_escape(token) + "”"


def markup_escape(text: str) -> str:
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
