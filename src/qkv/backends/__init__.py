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


_MODULES: dict[str, ModuleType] = {}


def _module(name: str) -> ModuleType:
    """The backend's module, imported on first use."""
    if name not in _MODULES:
        _MODULES[name] = importlib.import_module(f"qkv.backends.{name}")
    return _MODULES[name]


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

    The rule, from ``qkv bench --auto`` on a 2-core x86 CPU with torch 2.13 (the table is in
    docs/performance.md):

    - Few queries for the keys (Lq <= 64, or Lq <= Lk / 8) under a mask or a causal rule that
      is not top-left, as when prefilling a chunk against a KV cache: ``"flash"``. torch's
      kernel needs such a rule as an explicit mask, which costs it more than flash's tiles
      (16 queries against 1024 cached keys: flash 0.86 ms, sdpa 1.9 ms). One new token against
      its own cache has a causal rule that blocks nothing: ``qkv.attention`` drops it, and the
      call goes to sdpa with no mask.
    - Otherwise ``"sdpa"``. Before flash had its compiled CPU kernel, torch's fused kernel was
      faster on every other case measured (forward and backward; float32, bfloat16, float16,
      float64; padding masks; grouped heads; T from 64 to 16384). With the kernel, flash is
      level in float32 forward passes and faster on several causal calls without a mask
      (docs/performance.md); the rule has not moved yet, because the full-length runs disagree
      for bfloat16, flash's backward is slower, and choosing flash would make a call build the
      kernel the first time.
    - When that backend cannot run the call, the next one that can: ``"flash"`` for empty
      sequences and NaN/Inf under a mask (which sdpa refuses), ``"sdpa"`` for dropout (which
      flash refuses), and ``"reference"``, the only backend that returns the weights.
    """
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    masked = call.mask is not None or call.causal_offset not in (None, 0)
    if masked and (lq <= 64 or 8 * lq <= lk):
        order = ("flash", "sdpa", "reference")
    else:
        order = ("sdpa", "flash", "reference")
    reasons = []
    for name in order:
        reason = why_not(name, call)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise Unsupported("no backend can run this call (" + "; ".join(reasons) + ")")


def run(call: Call, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if backend == "auto":
        name = choose(call)  # checked there: only a backend that can run the call is chosen
    else:
        name = backend
        reason = why_not(name, call)
        if reason is not None:
            raise Unsupported(f'backend="{name}" cannot run this call: {reason}')
    out, weights = _module(name).attention(call)
    return out, weights
