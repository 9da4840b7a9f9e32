"""hypothesis strategies for attention inputs: shapes, dtypes, masks of every broadcast shape,
causal alignments and grouped heads.

``attention_cases()`` draws an ``AttentionCase`` (shapes and options only); ``case.tensors(dtype)``
builds its q, k, v and mask reproducibly from the drawn seed.
Legend: B batch, H heads, Lq query length, Lk key length, Dk / Dv features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
CAUSALS = (False, True, "bottom-right", "top-left")

# 0 and 1 are the edge cases; odd sizes catch off-by-one tiling; a few larger ones cross tiles.
lengths = st.one_of(st.sampled_from([0, 1]), st.integers(2, 9), st.sampled_from([16, 33, 64]))
features = st.sampled_from([1, 2, 3, 4, 8, 16])


def broadcast_shapes_of(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape that broadcasts to ``shape`` without growing it: each dim kept or 1, and any
    number of leading dims dropped."""
    shapes = []
    for dropped in range(len(shape) + 1):
        tail = shape[dropped:]
        for keep in range(2 ** len(tail)):
            shapes.append(tuple(size if keep >> d & 1 else 1 for d, size in enumerate(tail)))
    return sorted(set(shapes), key=lambda s: (len(s), s))


@dataclass(frozen=True)
class AttentionCase:
    """Shapes and options of one ``qkv.attention`` call."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    mask_kind: str | None  # None, "bool" or "float"
    mask_shape: tuple[int, ...]
    mask_density: float  # probability that a mask entry allows attention
    causal: Any
    scale: float | None
    seed: int

    def tensors(
        self, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v in ``dtype`` and the mask (bool, or float in ``dtype``)."""
        generator = torch.Generator().manual_seed(self.seed)

        def normal(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

        q, k, v = normal(self.q_shape), normal(self.k_shape), normal(self.v_shape)
        mask = None
        if self.mask_kind is not None:
            keep = torch.rand(self.mask_shape, generator=generator) < self.mask_density
            if self.mask_kind == "bool":
                mask = keep
            else:
                values = normal(self.mask_shape).masked_fill(~keep, -math.inf)
                mask = values.to(dtype)
        return q, k, v, mask

    def kwargs(self) -> dict[str, Any]:
        return {"causal": self.causal, "scale": self.scale}


@st.composite
def attention_cases(draw: st.DrawFn, *, masks: bool = True) -> AttentionCase:
    """Any valid call: (Lq, D) / (*B, Lq, D) / (*B, H, Lq, D) layouts, batch dims that broadcast
    between q, k and v, grouped and multi-query heads, Dv != Dk, masks of any broadcast shape."""
    lq, lk, dk, dv = draw(lengths), draw(lengths), draw(features), draw(features)
    layout = draw(st.sampled_from(["2d", "3d", "heads", "heads"]))
    if layout == "2d":
        q_lead: tuple[int, ...] = ()
        k_lead: tuple[int, ...] = ()
        v_lead: tuple[int, ...] = ()
        scores_lead: tuple[int, ...] = ()
    else:
        batch = draw(st.lists(st.integers(1, 3), max_size=2 if layout == "heads" else 1))
        kv_heads = draw(st.integers(1, 3))
        groups = draw(st.sampled_from([1, 1, 2, 3]))
        if layout == "3d":  # the first dim is the head dim as far as grouping goes
            batch, kv_heads = [], draw(st.integers(1, 3))

        def sub(sizes: list[int]) -> tuple[int, ...]:  # each batch dim kept or broadcast (1)
            return tuple(size if draw(st.booleans()) else 1 for size in sizes)

        q_lead = (*sub(batch), kv_heads * groups)
        k_lead = (*sub(batch), kv_heads)
        v_lead = (*sub(batch), kv_heads)
        scores_lead = (*torch.broadcast_shapes(q_lead[:-1], k_lead[:-1], v_lead[:-1]), q_lead[-1])
    mask_kind = draw(st.sampled_from([None, "bool", "float"])) if masks else None
    mask_shape = draw(st.sampled_from(broadcast_shapes_of((*scores_lead, lq, lk))))
    return AttentionCase(
        q_shape=(*q_lead, lq, dk),
        k_shape=(*k_lead, lk, dk),
        v_shape=(*v_lead, lk, dv),
        mask_kind=mask_kind,
        mask_shape=mask_shape,
        mask_density=draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])),
        causal=draw(st.sampled_from(CAUSALS)),
        scale=draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
