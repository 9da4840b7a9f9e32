"""Dispatch: which backend runs a call, in one place.

Every backend module answers one capability query, ``why_not(call) -> str | None`` (None: it can
run the call; otherwise the reason, which names an alternative), and runs a call with
``attention(call) -> (out, weights or None, lse or None)``. A backend that can write a KV cache
and attend in one step also has ``attention_with_cache(call, write)``. ``backend="auto"``
picks, per call, by the rule in ``choose``; its thresholds are named below, and
``qkv bench --auto`` measures every scenario they decide (the evidence is that benchmark's
output, docs/performance.md).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from qkv import masks
from qkv.backends import flash, reference, sdpa
from qkv.backends.base import CacheWrite, Call, Unsupported, default_scale

NAMES = ("auto", "reference", "flash", "sdpa")

# A call under a mask or a causal rule with at most this many queries, or at most 1/FEW_QUERIES_
# PER_KEY of its keys (prefilling a chunk against a KV cache), goes to flash: torch's kernel needs
# such a rule as an explicit mask, which costs it more than flash's tiles.
FEW_QUERIES = 64
FEW_QUERIES_PER_KEY = 8
# With no mask and no causal rule, flash's compiled kernel is faster than torch's fused kernel for
# decoding (fewer than DECODING_QUERIES queries) on every build. Beyond decoding it depends on the
# build (``qkv bench --auto`` measures each; docs/performance.md):
# - on CPUs whose bfloat16 products run on matrix units (AMX; measured on an Intel Xeon), only from
#   KERNEL_MIN_SCORES scores (B·Hq·Lq·Lk) up and, except in bfloat16, with whole query blocks
#   (KERNEL_MIN_QUERIES): below that the units' fixed cost per call does not pay off;
# - elsewhere (AVX-512 and AVX2 builds, measured on an AMD EPYC) at every size measured, except
#   float16/bfloat16 with few queries for their keys (FEW_QUERIES_PER_KEY) where the kernel's own
#   register tiles run the products (narrow vectors): widening K and V to float32 then costs more
#   than the whole call.
DECODING_QUERIES = 16
KERNEL_MIN_SCORES = 2**20
KERNEL_MIN_QUERIES = 128

# Imported with this module, not per call: a tracer (torch.compile) follows a dict lookup.
_MODULES: dict[str, ModuleType] = {"reference": reference, "flash": flash, "sdpa": sdpa}


def backend(name: str) -> ModuleType:
    """The backend module ``name`` ("reference", "flash" or "sdpa")."""
    return _MODULES[name]


def why_not(name: str, call: Call) -> str | None:
    """Why backend ``name`` cannot run ``call`` (None if it can)."""
    reason: str | None = backend(name).why_not(call)
    return reason


def preference(call: Call) -> tuple[str, ...]:
    """The backends ``"auto"`` tries for ``call``, fastest first.

    - flash first for a window or segments: it skips the tiles they block, where torch's kernel
      needs them as an (Lq, Lk) mask (memory quadratic in length).
    - flash first for few queries under a mask or a non-top-left causal rule (see
      ``FEW_QUERIES``), and for calls without a mask that flash's compiled kernel runs where it
      is the faster kernel: causal calls, decoding, and unmasked calls as ``_kernel_is_faster``
      says for this build; with gradients to follow, where the kernel also runs the backward
      pass (``flash.differentiates_compiled``).
    - sdpa first for everything else (masks over many queries, float64, training under a mask).
    - The others follow as fallbacks: flash for empty sequences and NaN/Inf under a mask (which
      sdpa refuses on the CPU), sdpa for dropout (which flash refuses), reference, the only
      backend that returns weights.
    """
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    masked = call.mask is not None or call.causal_offset not in (None, 0)
    few_queries = masked and (lq <= FEW_QUERIES or FEW_QUERIES_PER_KEY * lq <= lk)
    if few_queries or call.structured:  # (asked first: segments' runs are read from their ids)
        return ("flash", "sdpa", "reference")
    on_kernel = (
        call.mask is None
        and flash.runs_compiled(call)
        and (not call.needs_gradients or flash.differentiates_compiled(call))
        and (call.causal_offset is not None or _kernel_is_faster(call))
    )
    if on_kernel:
        return ("flash", "sdpa", "reference")
    return ("sdpa", "flash", "reference")


def _kernel_is_faster(call: Call) -> bool:
    """For a call with no mask and no causal rule that flash's compiled kernel takes: whether
    it beats torch's fused kernel on this build (see the thresholds above)."""
    lq, lk = call.q.shape[-2], call.k.shape[-2]
    if lq < DECODING_QUERIES:
        return True
    kernel = flash.kernel
    if kernel.matrix_units():
        scores = call.q.numel() // max(1, call.q.shape[-1]) * lk
        return scores >= KERNEL_MIN_SCORES and (
            lq >= KERNEL_MIN_QUERIES or call.q.dtype == torch.bfloat16
        )
    low = call.q.dtype in (torch.float16, torch.bfloat16)
    widened = low and kernel.cached_products() == "tiles"
    return not (widened and FEW_QUERIES_PER_KEY * lq <= lk)


def choose(call: Call) -> str:
    """The backend ``"auto"`` runs ``call`` on: the first of ``preference(call)`` that can."""
    reasons = []
    for name in preference(call):
        reason = why_not(name, call)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise Unsupported("no backend can run this call (" + "; ".join(reasons) + ")")


def resolve(call: Call, name: str) -> str:
    """The backend that runs ``call`` when ``name`` is asked for (checked: it can)."""
    if name == "auto":
        return choose(call)
    reason = why_not(name, call)
    if reason is not None:
        raise Unsupported(f'backend="{name}" cannot run this call: {reason}')
    return name


Result = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # out, weights, lse


def run(call: Call, name: str, write: CacheWrite | None = None) -> Result:
    """Run ``call`` on backend ``name`` ("auto": ``choose``): (out, weights or None, lse or
    None); weights when the call returns weights, lse when it returns the log-sum-exp.

    ``write``: a KV cache step's new keys and values, which ``call``'s k and v end with. The
    backend ``"auto"`` would try first (or the one named) writes them and attends in one step
    where it can (``attention_with_cache``); otherwise they are written before any backend looks
    at the call, so that every check sees the keys and values it will attend to."""
    if write is not None:
        first = backend(preference(call)[0] if name == "auto" else name)
        fuses = hasattr(first, "attention_with_cache") and first.why_not(call) is None
        if fuses:
            fused: Result = first.attention_with_cache(call, write)
            return fused
        write.apply()
    result: Result = backend(resolve(call, name)).attention(call)
    return result


_LANE_DTYPES = (torch.float32, torch.bfloat16)
_LANE_BACKENDS = ("auto", "flash")


def plain_decoding(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, backend: Any
) -> torch.Tensor | None:
    """The output of a plain decoding call straight from flash's decoding kernel, or None where
    the call is not one (then it takes the whole path: checks, a ``Call``, ``run``).

    Plain decoding: ``attention(q, k, v, causal=, scale=, backend=)`` and nothing else given,
    backend "auto" or "flash", eager CPU tensors (*B, Hq, Lq, Dk), (*B, Hkv, Lk, ·) of one batch
    shape and one dtype, float32 or bfloat16, 1 <= Lq < 16, none empty, Hq a multiple of Hkv, no
    gradient to record, the kernel built. ``choose`` gives such a call to flash (``preference``:
    few queries, no mask), which runs it on this kernel function: the same bits, with less
    Python on the way (a decoding step comes once per layer per token, with the caches cold
    from the model's weights). The caller checks that no ``qkv.trace`` observes the call.
    """
    scale = _plain_scale(q, k, v, causal, scale, backend)
    if scale is None:
        return None
    out = flash.kernel.decode(
        q, k, v, scale, masks.binding_offset(causal, q.shape[-2], k.shape[-2])
    )
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def plain_decoding_step(
    q: Any, write: CacheWrite | None, causal: Any, scale: Any, backend: Any
) -> torch.Tensor | None:
    """``plain_decoding`` for a ``KVCache`` step (``attention_with_cache``): q (B, Hq, Lq, Dk)
    against the cached keys and the step's ``write``, whose new keys and values are written and
    attended in one kernel call (``kernel.decode_step``), as ``flash.attention_with_cache`` does
    with the call ``choose`` gives it; None where the step is not plain decoding (or its keys
    are concatenated, not written: ``write`` None)."""
    if write is None or type(q) is not torch.Tensor or q.dim() != 4:
        return None
    scale = _plain_scale(q, write.k_new, write.v_new, causal, scale, backend)
    if scale is None or not flash.kernel.decode_step_takes(q, write.k_new, write.v_new):
        return None
    offset = masks.binding_offset(causal, q.shape[-2], write.start + write.k_new.shape[-2])
    return flash.kernel.decode_step(
        q, write.k_new, write.v_new, write.keys, write.values, write.start, scale, offset
    )


def _plain_scale(q: Any, k: Any, v: Any, causal: Any, scale: Any, backend: Any) -> float | None:
    """The scale of a plain decoding call of q against k and v (``plain_decoding`` says which),
    or None where the call is not one."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None  # (subclasses and a tracer's tensors: the whole path)
    if type(backend) is not str or backend not in _LANE_BACKENDS or torch.compiler.is_compiling():
        return None
    dtype = q.dtype
    if dtype not in _LANE_DTYPES or k.dtype != dtype or v.dtype != dtype:
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if not len(qs) == len(ks) == len(vs) >= 3 or ks[:-1] != vs[:-1] or ks[:-3] != qs[:-3]:
        return None  # (k and v: one shape but for Dv; q: k's batch shape)
    (hq, lq, d), (hkv, _, dk) = qs[-3:], ks[-3:]
    if not (lq < min(DECODING_QUERIES, flash.kernel.DECODE_QUERIES) and dk == d):
        return None
    if 0 in qs or 0 in vs or hq % hkv or not (q.is_cpu and k.is_cpu and v.is_cpu):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if scale is None:
        scale = default_scale(d)
    elif type(scale) is not float or not math.isfinite(scale):
        return None  # (the whole path checks it)
    alignment = type(causal) is str and causal in masks.ALIGNMENTS
    if not (type(causal) is bool or alignment) or not flash.kernel.available():
        return None  # (available: what flash.kernel.takes asks beyond the above)
    return float(scale)
