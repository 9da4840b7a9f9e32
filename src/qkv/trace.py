"""Recording what attention calls compute, for explanations and pictures.

``qkv.attention`` asks ``current()`` for the active recorder; when there is one, it hands over
each call's canonical inputs, output and weights.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

import torch

from qkv.backends.base import Call


class Recorder(Protocol):
    wants_weights: bool

    def record(self, call: Call, out: torch.Tensor, weights: torch.Tensor | None) -> None: ...


_ACTIVE: ContextVar[Recorder | None] = ContextVar("qkv_trace", default=None)


def current() -> Recorder | None:
    """The recorder of the innermost active trace, or None."""
    return _ACTIVE.get()
