"""``qkv explain TEXT``: one real attention computation, step by step, with pictures.

The model (by default the real all-MiniLM-L6-v2, running its attention through ``qkv.attention``)
reads TEXT inside ``qkv.trace()``. From the recorded call of the chosen layer, head and focus
token it prints the whole computation with its true numbers:

    X -> Q, K, V -> scores q·k -> × 1/√d_k -> mask -> softmax -> weighted sum of V

then one line per head saying what that head attends to, and writes pictures next to the user:
a heatmap of the chosen head, a grid of the layer's heads (PNG, SVG on request) and a
self-contained HTML viewer of every layer and head.

One module per job:

- ``models``: the real model and the toy one, each run under ``qkv.trace()`` (``ModelRun``).
- ``walkthrough``: the numbers of one layer, head and focus token, read from the trace.
- ``render``: printing them (rich) and writing the pictures (``qkv.viz``).
- ``command``: the ``qkv explain`` command line.
"""

from qkv.explain.command import configure, load, run
from qkv.explain.models import (
    INSTALL_EXPLAIN,
    MAX_TOKENS,
    MINILM,
    ExplainError,
    ModelRun,
    load_minilm,
    run_minilm,
    run_random,
    toy_embeddings,
    toy_model,
    toy_tokens,
)
from qkv.explain.render import render, write_pictures
from qkv.explain.walkthrough import Walkthrough, focus_index, head_summary, walkthrough

__all__ = [
    "INSTALL_EXPLAIN",
    "MAX_TOKENS",
    "MINILM",
    "ExplainError",
    "ModelRun",
    "Walkthrough",
    "configure",
    "focus_index",
    "head_summary",
    "load",
    "load_minilm",
    "render",
    "run",
    "run_minilm",
    "run_random",
    "toy_embeddings",
    "toy_model",
    "toy_tokens",
    "walkthrough",
    "write_pictures",
]
