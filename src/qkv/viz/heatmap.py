"""Heatmaps of attention weights (matplotlib), readable from 3 tokens to thousands.

Rows are queries (the token doing the looking), columns are keys (the tokens looked at); row i
sums to 1. Blocked cells (the mask says the query may not attend the key) are grey. Long inputs
stay readable: at most ``max_labels`` labels per axis (every n-th token), and matrices larger
than ``max_cells`` per side are shrunk by taking the maximum of each block of cells, so that a
sharp peak never disappears.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot (no GUI, no global state):
save them with ``fig.savefig(path)`` or ``save(fig, path)``.
Legend: H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.viz._data import AttentionMaps, collect

CMAP = "Blues"
BLOCKED_COLOR = "#d9d9d9"


def heatmap(
    source: Any,
    tokens: Sequence[str] | None = None,
    *,
    layer: int | None = None,
    head: int = 0,
    batch: int = 0,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    mask: torch.Tensor | None = None,
    title: str | None = None,
    max_labels: int = 48,
    max_cells: int = 400,
) -> Any:
    """A labelled heatmap of one head's weights (Lq, Lk): a ``matplotlib.figure.Figure``.

    ``source``: a ``qkv.trace()`` result, an ``AttentionRecord``, a weights tensor ((Lq, Lk),
    (H, Lq, Lk) or (layers, H, Lq, Lk)) or a sequence of per-layer tensors; ``layer`` and
    ``head`` pick one map. ``tokens`` label rows and columns (default: positions).
    ``mask`` (bool (Lq, Lk), True = may attend) greys out blocked cells of a tensor source.
    """
    maps = collect(
        source, tokens, query_tokens=query_tokens, key_tokens=key_tokens, batch=batch, mask=mask
    )
    weights = maps.head(layer, head)
    lq, lk = weights.shape
    n_rows, n_cols = min(lq, max_labels), min(lk, max_labels)
    width = float(np.clip(2.5 + 0.2 * n_cols, 4.5, 16.0))
    height = float(np.clip(1.8 + 0.2 * n_rows, 3.5, 16.0))
    figure = _figure(width, height)
    ax = figure.add_subplot(1, 1, 1)
    image = draw(ax, maps, layer=layer, head=head, max_labels=max_labels, max_cells=max_cells)
    colorbar = figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
    colorbar.set_label("attention weight")
    if title is None:
        title = f"{maps.layer_names[maps.row(layer)]}, head {head}"
    ax.set_title(title + _shrunk_note(lq, lk, max_cells), fontsize=11)
    figure.tight_layout()
    return figure


def head_grid(
    source: Any,
    tokens: Sequence[str] | None = None,
    *,
    layer: int | None = None,
    batch: int = 0,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    mask: torch.Tensor | None = None,
    title: str | None = None,
    columns: int | None = None,
    max_labels: int = 16,
    max_cells: int = 160,
) -> Any:
    """Every head of one layer side by side: a ``matplotlib.figure.Figure`` with H heatmaps.

    Arguments as in ``heatmap``; ``columns`` per row of the grid (default about √H, at most 4).
    Token labels are drawn when there are at most ``max_labels`` of them per axis.
    """
    maps = collect(
        source, tokens, query_tokens=query_tokens, key_tokens=key_tokens, batch=batch, mask=mask
    )
    heads = maps.heads
    columns = columns or min(4, math.ceil(math.sqrt(heads)))
    rows = math.ceil(heads / columns)
    lq, lk = maps.weights.shape[-2:]
    labelled = max(lq, lk) <= max_labels
    panel = 3.2 if labelled else 2.4
    figure = _figure(columns * panel + 0.6, rows * panel + 0.8)
    for h in range(heads):
        ax = figure.add_subplot(rows, columns, h + 1)
        draw(
            ax,
            maps,
            layer=layer,
            head=h,
            max_labels=max_labels if labelled else 0,
            max_cells=max_cells,
            fontsize=6,
        )
        ax.set_title(f"head {h}", fontsize=9)
        if h % columns:  # axis names on the outer panels only
            ax.set_ylabel("")
        if h + columns < heads:
            ax.set_xlabel("")
    if title is None:
        title = f"{maps.layer_names[maps.row(layer)]}: all {heads} heads"
    figure.suptitle(title + _shrunk_note(lq, lk, max_cells), fontsize=11)
    figure.tight_layout()
    return figure


def draw(
    ax: Any,
    maps: AttentionMaps,
    *,
    layer: int | None,
    head: int,
    max_labels: int = 48,
    max_cells: int = 400,
    fontsize: float = 8,
) -> Any:
    """Draw one head's weights on a matplotlib ``ax``; returns the image (for a colorbar)."""
    weights = maps.head(layer, head)  # (Lq, Lk)
    lq, lk = weights.shape
    shown = np.ma.masked_array(weights, mask=maps.blocked if maps.blocked is not None else False)
    shown = _shrink(shown, max_cells)
    cmap = _colormap()
    top = float(weights.max()) if weights.size else 1.0
    image = ax.imshow(
        shown,
        cmap=cmap,
        vmin=0.0,
        vmax=top if top > 0 else 1.0,
        extent=(-0.5, lk - 0.5, lq - 0.5, -0.5),  # axes in token positions, however shrunk
        interpolation="nearest",
        aspect="auto",
    )
    ax.set_xlabel("key (attended to)", fontsize=fontsize + 1)
    ax.set_ylabel("query (attending)", fontsize=fontsize + 1)
    _label_axis(ax.set_xticks, maps.key_tokens, max_labels, fontsize, rotation=90)
    _label_axis(ax.set_yticks, maps.query_tokens, max_labels, fontsize, rotation=0)
    ax.tick_params(length=2)
    return image


def save(figure: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """Write ``figure`` (PNG, SVG, PDF: by the suffix) and release its memory; returns the path."""
    from matplotlib import rc_context

    path = Path(path)
    savefig_kwargs.setdefault("dpi", 120)
    with rc_context({"svg.fonttype": "none"}):  # SVG labels stay text (escaped), not outlines
        figure.savefig(path, bbox_inches="tight", **savefig_kwargs)
    figure.clear()
    return path


def thinned(labels: Sequence[str], max_labels: int) -> list[tuple[int, str]]:
    """Every n-th (position, label) so that at most ``max_labels`` remain (all if they fit)."""
    if max_labels <= 0 or not labels:
        return []
    step = math.ceil(len(labels) / max_labels)
    return [(i, labels[i]) for i in range(0, len(labels), step)]


def _label_axis(
    set_ticks: Any, labels: Sequence[str], max_labels: int, fontsize: float, rotation: int
) -> None:
    ticks = thinned(labels, max_labels)
    set_ticks(
        [i for i, _ in ticks],
        [_short(label) for _, label in ticks],
        fontsize=fontsize,
        rotation=rotation,
    )


def _short(label: str, limit: int = 16) -> str:
    label = label.replace("\n", "⏎").replace("$", r"\$")  # "$" would start matplotlib math
    return label if len(label) <= limit else label[: limit - 1] + "…"


def _shrink(weights: np.ma.MaskedArray, max_cells: int) -> np.ma.MaskedArray:
    """Max-pool blocks of cells so that neither side exceeds ``max_cells``."""
    lq, lk = weights.shape
    fq, fk = math.ceil(lq / max_cells), math.ceil(lk / max_cells)
    if fq == 1 and fk == 1:
        return weights
    data = weights.filled(np.nan)
    padded = np.full((math.ceil(lq / fq) * fq, math.ceil(lk / fk) * fk), np.nan, np.float32)
    padded[:lq, :lk] = data
    blocks = padded.reshape(padded.shape[0] // fq, fq, padded.shape[1] // fk, fk)
    with warnings.catch_warnings():  # a block of blocked cells only: NaN, drawn grey
        warnings.simplefilter("ignore", RuntimeWarning)
        pooled = np.nanmax(blocks, axis=(1, 3))
    return np.ma.masked_invalid(pooled)


def _shrunk_note(lq: int, lk: int, max_cells: int) -> str:
    fq, fk = math.ceil(lq / max_cells), math.ceil(lk / max_cells)
    if fq == 1 and fk == 1:
        return ""
    return f"\n(each cell: the largest weight of a {fq}×{fk} block of tokens)"


def _colormap() -> Any:
    from matplotlib import colormaps

    return colormaps[CMAP].with_extremes(bad=BLOCKED_COLOR)  # blocked (masked) cells: grey


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))
