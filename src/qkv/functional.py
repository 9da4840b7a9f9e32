"""``qkv.attention`` and ``qkv.attention_with_cache``: the functional entry points.

Data flows one way: inputs -> checks and canonicalisation (``canonical``, once) -> a ``Call`` ->
one backend (``backends.dispatch``) -> output, which an active ``qkv.trace`` observes.

Legend: B batch, H heads (Hq query heads, Hkv key/value heads), L/Lq query length,
S/Lk key length, D features (Dk query/key, Dv value).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from qkv import observers
from qkv.backends import dispatch
from qkv.backends.base import CacheWrite, Call
from qkv.cache import KVCache
from qkv.canonical import Causal, canonical_call


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: Causal = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_weights: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...
@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: Causal = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_weights: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: Causal = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_weights: bool = ...,
    backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: Causal = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention: ``softmax(q kᵀ · scale + mask) v``.

    Shapes (leading dims broadcast by torch rules)::

        q: (*batch, Hq, Lq, Dk)   or any (*batch, Lq, Dk), e.g. (Lq, Dk)
        k: (*batch, Hkv, Lk, Dk)
        v: (*batch, Hkv, Lk, Dv)
        returns out: (*batch, Hq, Lq, Dv) in q's dtype [, weights: (*batch, Hq, Lq, Lk)]

    When ``Hq`` is a multiple g > 1 of ``Hkv`` (grouped-query / multi-query attention), key/value
    head j serves query heads j*g ... j*g+g-1.

    **Mask convention: True means "may attend".** ``mask`` is bool (True keeps a position) or
    float (added to the scaled scores; -inf blocks), broadcastable to (*batch, Hq, Lq, Lk).
    ``causal``: ``True``/``"bottom-right"`` lets query i attend key j iff j <= i + Lk - Lq (the
    alignment a KV cache needs); ``"top-left"``: j <= i. A key must pass both mask and causal.

    ``scale`` defaults to 1/sqrt(Dk). ``dropout_p`` drops attention weights (survivors scaled by
    1/(1-p)) whenever > 0. ``return_weights`` also returns the softmax weights before dropout.
    ``backend``: "auto", "reference", "flash" or "sdpa"; all give the same answer.

    A query with no key it may attend gives 0 output, 0 weights and 0 gradient (never NaN).
    float16/bfloat16 inputs are computed with float32 scores, softmax and sums.
    """
    call, squeeze_head = canonical_call(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        backend=backend,
    )
    return _run(call, backend, squeeze_head, return_weights)


def attention_with_cache(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    *,
    mask: torch.Tensor | None = None,
    causal: Causal = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Write this step's keys and values into ``cache`` and attend to everything cached.

    Shapes::

        q:      (B, Hq, L, Dk)      this step's L queries
        k_new:  (B, Hkv, L, Dk)     this step's keys, appended to the cache's S
        v_new:  (B, Hkv, L, Dv)
        returns out: (B, Hq, L, Dv) [, weights: (B, Hq, L, S + L)]

    The same as ``attention(q, keys, values, ...)`` over the cache's keys and values after the
    write, with every argument meaning what it means there (``mask`` (True = may attend)
    broadcasts to (B, Hq, L, S + L)). ``causal=True`` is bottom-right aligned, the alignment
    decoding needs: query i is position S + i of the sequence and sees keys 0 … S + i::

        cache S = 3, L = 2:   keys  0 1 2 | 3 4
                      query 0       x x x | x .
                      query 1       x x x | x x

    So decoding token by token, or in chunks, gives the outputs of one full causal pass. The
    backend may fuse the write into its attention (flash's kernel does, for a decoding step).
    A call rejected for a bad argument leaves the cache unchanged.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a qkv.KVCache, got {type(cache).__name__}")
    step = cache.prepare(k_new, v_new)
    call, squeeze_head = canonical_call(
        q,
        step.keys,
        step.values,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        backend=backend,
    )
    result = _run(call, backend, squeeze_head, return_weights, step.write)
    cache.commit(step)
    return result


def _run(
    call: Call,
    backend: str,
    squeeze_head: bool,
    return_weights: bool,
    write: CacheWrite | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a canonical call on ``backend`` and tell an active observer (``qkv.trace``); return
    the output, and the weights if the caller asked for them."""
    out, weights = dispatch.run(call, backend, write)
    observer = observers.current()
    if observer is not None:
        observer.record(call, out, weights)
    if squeeze_head:
        out = out.squeeze(-3)
        weights = None if weights is None else weights.squeeze(-3)
    if return_weights:
        assert weights is not None
        return out, weights
    return out
