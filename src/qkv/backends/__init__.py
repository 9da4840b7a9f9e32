"""Backends: each takes one checked ``Call`` and returns ``(out, weights or None)``.

- ``reference``: the textbook formula, written to be read.
- ``flash``: qkv's tiled online-softmax algorithm, memory linear in length, its own backward.
- ``sdpa``: torch's fused ``scaled_dot_product_attention`` where it has exactly these semantics.

``dispatch`` decides which one runs a call (``backend="auto"`` picks the fastest that can).
"""
