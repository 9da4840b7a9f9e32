"""Backends: each takes one checked ``Call`` and returns ``(out, weights or None)``.

- ``reference``: the textbook formula, written to be read.
- ``flash``: qkv's tiled online-softmax algorithm, memory linear in length, its own backward.
- ``sdpa``: torch's fused ``scaled_dot_product_attention`` where it has exactly these semantics.

``"auto"`` picks, per call, the fastest backend that supports the call (see ``choose``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from qkv.backends.base import Call, Unsupported

NAMES = ("auto", "reference", "flash", "sdpa")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"qkv.backends.{name}")


def why_not(name: str, call: Call) -> str | None:
    """Why backend ``name`` cannot run ``call`` (None if it can)."""
    try:
        module = _module(name)
    except ModuleNotFoundError:
        return f'backend "{name}" is not available in this installation'
    reason: str | None = module.why_not(call)
    return reason


def choose(call: Call) -> str:
    """The backend ``"auto"`` uses: the fastest one that supports the call.

    torch's fused kernel first, then the reference computation (needed for weights).
    """
    for name in ("sdpa", "reference"):
        if why_not(name, call) is None:
            return name
    return "reference"


def run(call: Call, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    name = choose(call) if backend == "auto" else backend
    reason = why_not(name, call)
    if reason is not None:
        raise Unsupported(f'backend="{name}" cannot run this call: {reason}')
    out, weights = _module(name).attention(call)
    return out, weights
