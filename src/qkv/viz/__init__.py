"""Pictures of attention: heatmaps (PNG/SVG via matplotlib) and a self-contained HTML viewer.

Every function takes any of: a ``qkv.trace()`` result, one ``AttentionRecord``, a weights tensor
((Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk)) or a sequence of per-layer weights tensors (such
as a Hugging Face model's ``outputs.attentions``)::

    with qkv.trace(model) as t:
        model(**inputs)
    qkv.viz.save(qkv.viz.heatmap(t, tokens, layer=2, head=5), "head.png")
    qkv.viz.save(qkv.viz.head_grid(t, tokens, layer=2), "heads.svg")
    qkv.viz.view(t, tokens).save("attention.html")    # or just display `t` in a notebook

Rows are queries (the token looking), columns are keys (the tokens looked at); each row sums
to 1. matplotlib is needed for heatmaps only (``pip install matplotlib``).
"""

from qkv.viz._data import AttentionMaps, collect
from qkv.viz.heatmap import draw, head_grid, heatmap, save
from qkv.viz.html import AttentionView, view

__all__ = [
    "AttentionMaps",
    "AttentionView",
    "collect",
    "draw",
    "head_grid",
    "heatmap",
    "save",
    "view",
]
