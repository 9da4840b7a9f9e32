"""Which mask the implementation takes: its layout and its polarity, found by trying them.

A padding mask says which keys are real. Implementations take it as (B, L), (B, 1, 1, L),
(B, 1, L) or (B, L, L); as bool with True = keep (qkv, torch's SDPA) or True = ignore (torch's
``key_padding_mask``), as 1/0 (Hugging Face's ``attention_mask``) or as a float added to the
scores (0 / -inf). Each encoding is tried on a batch whose first item starts with two padding
tokens; the one whose real tokens' outputs equal running those tokens alone is the one the
implementation understands. When none is exact (a broken mask), the closest is reported.
Legend: B batch, L length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkv.checker.capture import run_captured
from qkv.checker.compare import difference, tolerance
from qkv.checker.diagnose import MASK_MISTAKES, Setting, candidates, diagnose
from qkv.checker.inputs import Inputs
from qkv.checker.target import Target

LAYOUTS = ("(B, L)", "(B, 1, 1, L)", "(B, 1, L)", "(B, L, L)")
POLARITIES = ("bool, True = keep", "bool, True = ignore", "1 = keep, 0 = ignore", "float 0 / -inf")
PADDED = 2  # item 0 starts with this many padding tokens


@dataclass(frozen=True)
class Encoding:
    """How a (B, L) keep mask (True = real key) is handed to the implementation."""

    layout: str
    polarity: str

    def encode(self, keep: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The mask for inputs of ``dtype`` (a float mask takes their dtype)."""
        length = keep.shape[-1]
        shaped = {
            "(B, L)": keep,
            "(B, 1, 1, L)": keep[:, None, None, :],
            "(B, 1, L)": keep[:, None, :],
            "(B, L, L)": keep[:, None, :].expand(-1, length, -1),
        }[self.layout]
        if self.polarity == "bool, True = keep":
            return shaped.clone()
        if self.polarity == "bool, True = ignore":
            return ~shaped
        if self.polarity == "1 = keep, 0 = ignore":
            return shaped.to(dtype)
        return torch.zeros(shaped.shape, dtype=dtype).masked_fill(~shaped, -math.inf)

    def describe(self, parameter: str) -> str:
        return f"{parameter} {self.layout}, {self.polarity}"


ENCODINGS = tuple(Encoding(layout, polarity) for layout in LAYOUTS for polarity in POLARITIES)


@dataclass(frozen=True)
class Probe:
    """The encoding found, whether it is exact, and by how much the closest one missed."""

    encoding: Encoding | None
    exact: bool
    error: float
    tried: int


def padding_keep(batch: int, length: int, *, side: str = "left") -> torch.Tensor:
    """(B, L) bool: item 0 starts (``side="left"``) or ends with ``PADDED`` padding tokens, the
    others are all real. Left padding is invisible to no query, causal or not; right padding
    leaves every causal query a key (its padded queries are not fully masked)."""
    keep = torch.ones(batch, length, dtype=torch.bool)
    padded = slice(0, min(PADDED, length)) if side == "left" else slice(length - PADDED, length)
    keep[0, padded] = False
    return keep


def alone(target: Target, inputs: Inputs, causal: bool) -> torch.Tensor:
    """Item 0's real tokens run alone (no padding at all): what masking must reproduce."""
    real = Inputs(
        tuple(t[:1].narrow(inputs.seq_dim, PADDED, inputs.length - PADDED) for t in inputs.tensors),
        inputs.seq_dim,
    )
    return target.call(real, causal=causal).rows.detach()


def probe(target: Target, inputs: Inputs, causal: bool = False) -> Probe:
    """Try every encoding of the padding mask: the first exact one wins; else the first one whose
    output a broken mask (a wrong fill, the wrong axis) explains; else the closest."""
    if target.mask_param is None:
        return Probe(None, False, math.inf, 0)
    keep = padding_keep(inputs.batch, inputs.length)
    runnable: list[tuple[Encoding, float]] = []
    with torch.no_grad():
        reference = alone(target, inputs, causal)
        for encoding in ENCODINGS:
            try:
                rows = target.call(inputs, causal=causal, mask=encoding.encode(keep)).rows
            except Exception:  # an encoding the implementation does not take
                continue
            if rows.shape[:2] != keep.shape:
                continue
            miss = difference(rows[:1, PADDED:], reference)
            if miss <= tolerance(reference):
                return Probe(encoding, True, miss, len(ENCODINGS))
            runnable.append((encoding, miss))
    if not runnable:
        return Probe(None, False, math.inf, len(ENCODINGS))
    for encoding, miss in runnable:
        if _broken_mask_explains(target, inputs, causal, encoding, keep):
            return Probe(encoding, False, miss, len(ENCODINGS))
    encoding, miss = min(runnable, key=lambda pair: pair[1])
    return Probe(encoding, False, miss, len(ENCODINGS))


def _broken_mask_explains(
    target: Target, inputs: Inputs, causal: bool, encoding: Encoding, keep: torch.Tensor
) -> bool:
    """Whether this encoding's output is what a broken mask (a wrong fill or axis) gives."""
    _, cap = run_captured(target, inputs, causal=causal, mask=encoding.encode(keep))
    if cap is None:
        return False
    d_in = target.width if target.kind == "module" else 0
    setting = Setting(causal=causal, keep=keep, d_in=d_in)
    broken = [m for m in candidates(setting, cap.per_head) if m.name in MASK_MISTAKES]
    return diagnose(cap, setting, target.heads, broken) is not None
