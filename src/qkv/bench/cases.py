"""What ``qkv bench`` measures: the cases, their shape, the work they do, and one result per
case and implementation.

Legend: B batch, H heads, T sequence length (queries = keys), D features per head, E = H·D.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PASSES = ("forward", "forward+backward")
LEVELS = ("functional", "module")
IMPLEMENTATIONS = ("flash", "reference", "sdpa", "auto")
# The default run: three lengths a factor of 2 apart, small enough for the whole run
# (both levels, passes, dtypes and masks) to take a few minutes on two cores.
DEFAULT_LENGTHS = (256, 512, 1024)
TORCH = "torch"  # the name of PyTorch's own implementation in results


@dataclass(frozen=True)
class Case:
    """One configuration to measure."""

    level: str  # "functional" (attention only) or "module" (with the projections)
    pass_: str  # "forward" or "forward+backward"
    dtype: str
    causal: bool
    length: int  # T: queries = keys

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.level} {self.pass_} {self.dtype} {mask} T={self.length}"


def make_cases(
    levels: tuple[str, ...],
    passes: tuple[str, ...],
    dtypes: tuple[str, ...],
    causal: tuple[bool, ...],
    lengths: tuple[int, ...],
) -> list[Case]:
    """Every combination, the lengths innermost (so that a table reads T upwards)."""
    return [
        Case(level, pass_, dtype, is_causal, length)
        for level in levels
        for pass_ in passes
        for dtype in dtypes
        for is_causal in causal
        for length in lengths
    ]


@dataclass
class Shape:
    batch: int
    heads: int
    dim: int

    @property
    def d_model(self) -> int:
        return self.heads * self.dim

    def flops(self, case: Case) -> float:
        """Floating-point operations of a case, counting the pairs of positions that may attend.

        Forward attention is two products of 2·pairs·D operations per head (Q Kᵀ and P V); the
        backward pass is 2.5 times the forward (five such products). The module level adds the
        four E×E projections of every position (forward), times three with the backward pass.
        """
        t = case.length
        pairs = t * (t + 1) / 2 if case.causal else t * t
        attention = 4 * self.batch * self.heads * pairs * self.dim
        projections = 4 * 2 * self.batch * t * self.d_model**2 if case.level == "module" else 0
        factor = 1.0 if case.pass_ == "forward" else 3.5
        return factor * attention + (1 if case.pass_ == "forward" else 3) * projections


@dataclass
class Result:
    case: Case
    implementation: str  # a qkv backend, or "torch"
    seconds: list[float] = field(default_factory=list)
    gflops: float = math.nan
    vs_torch: float = math.nan  # torch's median time / this one's
    percent_of_matmul: float = math.nan
    memory_mib: float = math.nan  # peak resident memory the case added
    skipped: str | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3 if self.seconds else math.nan

    def as_json(self) -> dict[str, Any]:
        data = {**asdict(self.case), "implementation": self.implementation}
        data["pass"] = data.pop("pass_")
        data.update(
            median_ms=finite(self.median_ms),
            all_ms=[s * 1e3 for s in self.seconds],
            gflops=finite(self.gflops),
            vs_torch=finite(self.vs_torch),
            percent_of_matmul=finite(self.percent_of_matmul),
            memory_mib=finite(self.memory_mib),
            skipped=self.skipped,
        )
        return data


def finite(value: float) -> float | None:
    """``value``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value
