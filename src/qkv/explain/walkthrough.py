"""The walkthrough: every number ``qkv explain`` prints, read from the trace of one layer.

For one layer, head and focus token i: X, Q, K, V, the scores q_i·k_j, the scale, the mask row,
the softmax weights and the output, plus every head's (L, L) weights for the head summaries.
Legend: L tokens, E model width, H heads, Hkv key/value heads, D head size (d_k), Dv value size.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qkv.explain.models import ExplainError, ModelRun
from qkv.trace import AttentionRecord, Trace


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
    softcap: float | None = None  # scores were soft-capped: softcap · tanh(score / softcap)
    sink: float | None = None  # this head's sink logit: a key with value 0 that takes weight

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
        softcap=record.softcap,
        sink=None if record.sinks is None else float(record.sinks[head]),
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
