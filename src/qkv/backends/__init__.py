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
      kernel needs such a rule as an explicit mask, which costs it more than flash's tiles.
    - No mask, no gradient to follow, and a call flash's compiled CPU kernel takes
      (``flash.kernel_takes``: CPU, float32/float16/bfloat16, nothing empty): ``"flash"`` when
      the call is causal, when it is decoding (fewer than 16 queries; a KV cache's causal rule
      blocks nothing, so ``qkv.attention`` drops it), or when it is big enough for the kernel's
      blocks (``_kernel_beats_torch_without_a_rule``). There flash was faster than torch's fused
      kernel in the calls measured, but for a few near that size within 3 %; below it torch's
      kernel is faster, up to 3× for small float16 calls. (``qkv.SelfAttention`` runs a
      decoding step with a KV cache as one kernel call, ``flash.decode_step``, without coming
      here.) Where the inputs need gradients, sdpa: flash's backward is its PyTorch loop, slower
      than torch's.
    - Otherwise ``"sdpa"``: torch's fused kernel was the fastest on every other case measured
      (masks with many queries; float64; forward+backward).
    - When that backend cannot run the call, the next one that can: ``"flash"`` for empty
      sequences and NaN/Inf under a mask (which sdpa refuses), ``"sdpa"`` for dropout (which
      flash refuses), and ``"reference"``, the only backend that returns the weights.
    """
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    masked = call.mask is not None or call.causal_offset not in (None, 0)
    few_queries_under_a_mask = masked and (lq <= 64 or 8 * lq <= lk)
    inference_on_the_kernel = (
        call.mask is None
        and not call.needs_gradients
        and (call.causal_offset is not None or _kernel_beats_torch_without_a_rule(call))
        and _flash_kernel_takes(call)
    )
    if few_queries_under_a_mask or inference_on_the_kernel:
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


def _kernel_beats_torch_without_a_rule(call: Call) -> bool:
    """For a call with no mask and no causal rule: whether flash's compiled kernel is the faster
    one. Decoding (fewer than 16 queries) always is. Otherwise the kernel works in blocks of 128
    queries, and its cost per call only pays off with 2^20 scores (B·Hq·Lq·Lk; 8 heads at
    T = 362) or more, and, outside bfloat16, whole blocks of queries (Lq >= 128): 64 queries
    against 1024 keys took flash 0.92× of torch's speed in float32, 1.10× in bfloat16."""
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    if lq < _module("flash")._KERNEL_BLOCK_QUERIES:  # the kernel's decoding path
        return True
    scores = call.q.numel() // max(1, call.q.shape[-1]) * lk
    return scores >= 2**20 and (lq >= 128 or call.q.dtype == torch.bfloat16)


def _flash_kernel_takes(call: Call) -> bool:
    takes: bool = _module("flash").kernel_takes(call.q, call.k, call.v)
    return takes


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
