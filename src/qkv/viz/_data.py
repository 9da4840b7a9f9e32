"""What every picture is drawn from: attention weights of some layers and heads, with labels.

``collect`` accepts a ``qkv.trace()`` result, one ``AttentionRecord``, a weights tensor, or a
sequence of per-layer weights tensors (e.g. a Hugging Face model's ``outputs.attentions``).
Legend: H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qkv.trace import AttentionRecord, Trace


@dataclass
class AttentionMaps:
    """Weights of ``len(layer_names)`` layers, ready to draw."""

    weights: np.ndarray  # (layers, H, Lq, Lk) float32, rows sum to 1 (0 for fully masked rows)
    query_tokens: list[str]  # Lq labels
    key_tokens: list[str]  # Lk labels
    layer_names: list[str]  # one per layer, e.g. "layer 3"
    layer_ids: list[int | None]  # the layer index of each row (``--layer`` / ``layer=``)
    blocked: np.ndarray | None  # (Lq, Lk) bool, True where the mask blocks (None: nothing)

    @property
    def heads(self) -> int:
        return int(self.weights.shape[1])

    def row(self, layer: int | None) -> int:
        """Position in ``weights`` of layer index ``layer`` (None: the first)."""
        if layer is None:
            return 0
        if layer in self.layer_ids:
            return self.layer_ids.index(layer)
        known = [i for i in self.layer_ids if i is not None] or list(range(len(self.layer_ids)))
        if all(i is None for i in self.layer_ids) and 0 <= layer < len(self.layer_ids):
            return layer
        raise ValueError(f"layer must be one of {known}, got {layer}")

    def head(self, layer: int | None, head: int) -> np.ndarray:
        """(Lq, Lk) weights of one head."""
        if isinstance(head, bool) or not isinstance(head, int):
            raise TypeError(f"head must be an int, got {type(head).__name__}")
        if not 0 <= head < self.heads:
            raise ValueError(f"head must be in [0, {self.heads - 1}], got {head}")
        heads: np.ndarray = self.weights[self.row(layer), head]
        return heads


def collect(
    source: Any,
    tokens: Sequence[str] | None = None,
    *,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    batch: int = 0,
    mask: torch.Tensor | None = None,
) -> AttentionMaps:
    """Attention weights and labels from a trace, a record, a tensor or a sequence of tensors.

    Tensors: (Lq, Lk) one head; (H, Lq, Lk) one layer; (layers, H, Lq, Lk) a whole model. A
    sequence of tensors is one layer each, (H, Lq, Lk) or (B, H, Lq, Lk) (``batch`` picks one).
    ``tokens`` labels both queries and keys (self-attention); ``query_tokens``/``key_tokens``
    label them separately. ``mask`` (bool (Lq, Lk), True = may attend) marks blocked cells of
    tensors; a trace's records carry their own mask.
    """
    if isinstance(batch, bool) or not isinstance(batch, int):
        raise TypeError(f"batch must be an int, got {type(batch).__name__}")
    if isinstance(source, Trace) and tokens is None and query_tokens is None:
        tokens = source.tokens
    layers, names, ids, blocked = _layers(source, batch)
    if mask is not None:
        blocked = _blocked(mask, tuple(layers.shape[-2:]))
    weights = layers.detach().to("cpu", torch.float32).numpy()  # (layers, H, Lq, Lk)
    lq, lk = weights.shape[-2:]
    if query_tokens is None and key_tokens is None and tokens is not None:
        query_tokens, key_tokens = tokens, tokens
        if lq != lk:  # a query block attending to all keys (e.g. with a KV cache): the last Lq
            query_tokens = list(tokens)[lk - lq :] if len(tokens) == lk else tokens
    return AttentionMaps(
        weights=weights,
        query_tokens=_labels("query_tokens", query_tokens, lq),
        key_tokens=_labels("key_tokens", key_tokens, lk),
        layer_names=names,
        layer_ids=ids,
        blocked=None if blocked is None or not blocked.any() else blocked,
    )


def _layers(
    source: Any, batch: int
) -> tuple[torch.Tensor, list[str], list[int | None], np.ndarray | None]:
    """(layers, H, Lq, Lk) weights, layer names, layer ids and a record's blocked cells."""
    if isinstance(source, Trace):
        source = _one_shape(source.records)
    if isinstance(source, AttentionRecord):
        source = [source]
    if isinstance(source, torch.Tensor):
        layers = _layers_from_tensor(source)
        return layers, [f"layer {i}" for i in range(layers.shape[0])], [None] * len(layers), None
    if isinstance(source, Sequence) and source:
        if all(isinstance(r, AttentionRecord) for r in source):
            layers = torch.stack([_record_weights(r, batch) for r in source])
            blocked = None
            keep = source[0].mask
            if keep is not None:
                keep = keep.expand(source[0].shape)
                keep = keep.reshape(-1, *keep.shape[-3:])[min(batch, keep.shape[0] - 1), 0]
                blocked = (~keep).cpu().numpy()
            return layers, [_record_name(r) for r in source], [r.layer for r in source], blocked
        if all(isinstance(t, torch.Tensor) for t in source):
            layers = torch.stack([_layer_from_tensor(t, batch, i) for i, t in enumerate(source)])
            ids: list[int | None] = list(range(len(source)))
            return layers, [f"layer {i}" for i in range(len(source))], ids, None
    raise TypeError(
        "source must be a qkv.trace() result, an AttentionRecord, a weights tensor or a "
        f"sequence of per-layer weights tensors, got {type(source).__name__}"
    )


def _blocked(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The cells a bool (Lq, Lk) ``mask`` (True = may attend) blocks."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a bool tensor (True = may attend), got {got}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask must have shape (Lq, Lk) = {shape}, got {tuple(mask.shape)}")
    return (~mask).cpu().numpy()


def _one_shape(records: list[AttentionRecord]) -> list[AttentionRecord]:
    with_weights = [r for r in records if r.weights is not None]
    if not with_weights:
        raise ValueError(
            "the trace holds no attention weights: record something inside `with qkv.trace()` "
            "and keep weights (keep='all' or 'weights')"
        )
    shape = with_weights[0].shape
    same = [r for r in with_weights if r.shape == shape]
    if len(same) != len(with_weights):
        raise ValueError(
            f"the trace's calls have different shapes ({sorted({r.shape for r in with_weights})}); "
            "draw one record at a time, or trace only some of them with qkv.trace(layers=...)"
        )
    return same


def _record_weights(record: AttentionRecord, batch: int) -> torch.Tensor:
    if record.weights is None:
        raise ValueError(f"{record!r} kept no weights; trace with keep='all' or keep='weights'")
    weights = record.weights.reshape(-1, *record.weights.shape[-3:])  # (B, H, Lq, Lk)
    if not 0 <= batch < weights.shape[0]:
        raise ValueError(f"batch must be in [0, {weights.shape[0] - 1}], got {batch}")
    return weights[batch]


def _record_name(record: AttentionRecord) -> str:
    if record.layer is not None:
        return f"layer {record.layer}"
    return record.name or f"call {record.index}"


def _layers_from_tensor(weights: torch.Tensor) -> torch.Tensor:
    if weights.dim() == 2:
        return weights[None, None]
    if weights.dim() == 3:
        return weights[None]
    if weights.dim() == 4:
        return weights
    raise ValueError(
        "weights must have shape (Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk), got "
        f"{tuple(weights.shape)}"
    )


def _layer_from_tensor(weights: torch.Tensor, batch: int, index: int) -> torch.Tensor:
    if weights.dim() == 3:
        return weights
    if weights.dim() == 4:
        if not 0 <= batch < weights.shape[0]:
            raise ValueError(f"batch must be in [0, {weights.shape[0] - 1}], got {batch}")
        return weights[batch]
    raise ValueError(
        f"layer {index} weights must have shape (H, Lq, Lk) or (B, H, Lq, Lk), got "
        f"{tuple(weights.shape)}"
    )


def _labels(name: str, labels: Sequence[str] | None, length: int) -> list[str]:
    if labels is None:
        return [str(i) for i in range(length)]
    if isinstance(labels, str):
        raise TypeError(f"{name} must be a sequence of str (one per position), got a str")
    labels = [str(label) for label in labels]
    if len(labels) != length:
        raise ValueError(f"{name} must have one label per position ({length}), got {len(labels)}")
    return labels
