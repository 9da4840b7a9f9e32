"""``qkv.attention`` and ``qkv.attention_with_cache``: the functional entry points.

Data flows one way: inputs -> checks and canonicalisation (``canonical``, once) -> a ``Call`` ->
one backend (``backends.dispatch``) -> output, which an active ``qkv.trace`` observes. A plain
decoding call, unobserved, takes a short way to the same kernel call (``dispatch.plain_decoding``,
``plain_decoding_step``).

Legend: B batch, H heads (Hq query heads, Hkv key/value heads), L/Lq query length,
S/Lk key length, D features (Dk query/key, Dv value).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal, overload

import torch

from qkv import _checks, logsumexp, observers
from qkv.backends import dispatch
from qkv.backends.base import CacheWrite, Call
from qkv.cache import KVCache
from qkv.canonical import Causal, Segments, Window, canonical_call
from qkv.mods import MaskMod, ScoreMod
from qkv.paged import PagedKVCache, attention_with_paged_cache

# attention's result: out, or (out, weights), (out, lse) or (out, weights, lse) as asked
Returned = torch.Tensor | tuple[torch.Tensor, ...]


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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    alibi_slopes: torch.Tensor | None = ...,
    window: Window = ...,
    segments: Segments = ...,
    return_lse: Literal[False] = ...,
    score_mod: ScoreMod | None = ...,
    mask_mod: MaskMod | None = ...,
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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    alibi_slopes: torch.Tensor | None = ...,
    window: Window = ...,
    segments: Segments = ...,
    return_lse: Literal[False] = ...,
    score_mod: ScoreMod | None = ...,
    mask_mod: MaskMod | None = ...,
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
    return_weights: Literal[False] = ...,
    backend: str = ...,
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    alibi_slopes: torch.Tensor | None = ...,
    window: Window = ...,
    segments: Segments = ...,
    return_lse: Literal[True],
    score_mod: ScoreMod | None = ...,
    mask_mod: MaskMod | None = ...,
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
    return_weights: Literal[True],
    backend: str = ...,
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    alibi_slopes: torch.Tensor | None = ...,
    window: Window = ...,
    segments: Segments = ...,
    return_lse: Literal[True],
    score_mod: ScoreMod | None = ...,
    mask_mod: MaskMod | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    alibi_slopes: torch.Tensor | None = ...,
    window: Window = ...,
    segments: Segments = ...,
    return_lse: bool = ...,
    score_mod: ScoreMod | None = ...,
    mask_mod: MaskMod | None = ...,
) -> Returned: ...
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: Window = None,
    segments: Segments = None,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
) -> Returned:
    """Scaled dot-product attention: ``softmax(q kᵀ · scale + mask) v``.

    Shapes (leading dims broadcast by torch rules)::

        q: (*batch, Hq, Lq, Dk)   or any (*batch, Lq, Dk), e.g. (Lq, Dk)
        k: (*batch, Hkv, Lk, Dk)
        v: (*batch, Hkv, Lk, Dv)
        returns out: (*batch, Hq, Lq, Dv) in q's dtype [, weights: (*batch, Hq, Lq, Lk)]
                     [, lse: (*batch, Hq, Lq)]

    When ``Hq`` is a multiple g > 1 of ``Hkv`` (grouped-query / multi-query attention), key/value
    head j serves query heads j*g ... j*g+g-1.

    **Mask convention: True means "may attend".** ``mask`` is bool (True keeps a position) or
    float (added to the scaled scores; -inf blocks), broadcastable to (*batch, Hq, Lq, Lk).
    ``causal``: ``True``/``"bottom-right"`` lets query i attend key j iff j <= i + Lk - Lq (the
    alignment a KV cache needs); ``"top-left"``: j <= i. A key must pass both mask and causal.

    ``scale`` defaults to 1/sqrt(Dk). ``dropout_p`` drops attention weights (survivors scaled by
    1/(1-p)) whenever > 0. ``return_weights`` also returns the softmax weights before dropout.
    ``backend``: "auto", "reference", "flash" or "sdpa"; all give the same answer.

    What real models add (each None by default; all combine with each other and the above):

    - ``softcap``: each scaled score s becomes softcap · tanh(s / softcap) (Gemma 2), before
      ALiBi and the mask are added.
    - ``sinks`` (Hq,): one logit per query head for a virtual key with value 0 that joins every
      row's softmax (gpt-oss); returned weights leave it out, so rows sum to less than 1.
    - ``alibi_slopes`` (Hq,) or (*batch, Hq): adds -slope · |i + Lk - Lq - j| to the scores.
    - ``window``: (left, right) lets query i attend key j iff i' - left <= j <= i' + right with
      i' = i + Lk - Lq (None: unbounded); an int w is (w - 1, 0), the w most recent keys, and
      needs ``causal=True``.
    - ``segments``: integer ids, (*batch, Lk) (the queries take the last Lq) or a pair
      ((*batch, Lq), (*batch, Lk)); query i may attend key j only if their ids are equal
      (packed sequences; ``segments_from_cu_seqlens`` converts ``cu_seqlens``).
    - ``return_lse``: also return each row's natural log-sum-exp of its scaled, capped, biased
      scores over allowed keys and the sink (-inf for a row with neither), in float32 (float64
      for float64 inputs); ``merge`` combines two calls over two sets of keys with it.

    Your own rule, with FlexAttention's signatures and meanings (``qkv.mods``, docs/flex.md):

    - ``score_mod(score, b, h, q_idx, kv_idx)``: returns the new score for the scaled score
      q·k·scale; softcap, ALiBi and a float mask then apply to what it returns.
    - ``mask_mod(b, h, q_idx, kv_idx)``: True where the query may attend; joins mask, causal,
      window and segments (a key must pass all).

    Both are called per block with broadcast index tensors, so they must be elementwise; flash
    skips the blocks mask_mod empties, and gradients reach the tensors score_mod captures.

    A query with no key it may attend gives 0 output, 0 weights and 0 gradient (never NaN).
    float16/bfloat16 inputs are computed with float32 scores, softmax and sums.
    """
    given = (mask, softcap, sinks, alibi_slopes, window, segments, score_mod, mask_mod)
    if _plain(given, dropout_p, return_weights, return_lse):
        out = dispatch.plain_decoding(q, k, v, causal, scale, backend)  # (None: not decoding)
        if out is not None:
            return out
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
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        window=window,
        segments=segments,
        return_lse=return_lse,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    return _run(call, backend, squeeze_head)


def attention_with_cache(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache | PagedKVCache,
    *,
    mask: torch.Tensor | None = None,
    causal: Causal = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: Window = None,
    segments: Segments = None,
    return_lse: bool = False,
    sequences: Sequence[Hashable] | None = None,
) -> Returned:
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

    A ``qkv.PagedKVCache`` holds many sequences: batch entry b is sequence ``sequences[b]``
    (any ids; default 0 … B − 1), created by its first step, each of its own length (causal
    aligns each one's last query with its own last key). It takes causal=True/False, scale,
    window, softcap, sinks, alibi_slopes (Hq,) and return_lse (lse (B, Hq, L)); not a mask,
    dropout, weights or segments. See ``qkv.varlen_attn`` for batches of different L.
    """
    if isinstance(cache, PagedKVCache):  # many sequences in pages: qkv.paged
        options = dict(mask=mask, causal=causal, scale=scale, dropout_p=dropout_p,
                       return_weights=return_weights, backend=backend, softcap=softcap,
                       sinks=sinks, alibi_slopes=alibi_slopes, window=window,
                       segments=segments, return_lse=return_lse)  # fmt: skip
        return attention_with_paged_cache(q, k_new, v_new, cache, sequences, options)
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be a qkv.KVCache or qkv.PagedKVCache, got {type(cache).__name__}"
        )
    if sequences is not None:
        raise ValueError("sequences= names the batch entries of a PagedKVCache; a KVCache has none")
    step = cache.prepare(k_new, v_new)
    given = (mask, softcap, sinks, alibi_slopes, window, segments)
    if _plain(given, dropout_p, return_weights, return_lse):
        out = dispatch.plain_decoding_step(q, step.write, causal, scale, backend)
        if out is not None:
            cache.commit(step)
            return out
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
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        window=window,
        segments=segments,
        return_lse=return_lse,
    )
    result = _run(call, backend, squeeze_head, step.write)
    cache.commit(step)
    return result


def _plain(given: tuple[Any, ...], dropout_p: Any, return_weights: Any, return_lse: Any) -> bool:
    """Whether a call gives nothing but q, k, v, causal, scale and backend (``given``: its other
    optional arguments, all None), and no ``qkv.trace`` observes it: then a decoding call may take
    the short way to flash's kernel (``dispatch.plain_decoding``)."""
    nothing = all(x is None for x in given) and return_weights is False and return_lse is False
    no_dropout = type(dropout_p) is float and dropout_p == 0.0
    return nothing and no_dropout and observers.current() is None


def _run(call: Call, backend: str, squeeze_head: bool, write: CacheWrite | None = None) -> Returned:
    """Run a canonical call on ``backend`` and tell an active observer (``qkv.trace``); return
    the output, then the weights and the log-sum-exp if the caller asked for them."""
    out, weights, lse = dispatch.run(call, backend, write)
    observer = observers.current()
    if observer is not None:
        observer.record(call, out, weights)
    if squeeze_head:
        out = out.squeeze(-3)
        weights = None if weights is None else weights.squeeze(-3)
        lse = None if lse is None else lse.squeeze(-2)
    if not (call.return_weights or call.return_lse):
        return out
    returned = [out]
    if call.return_weights:
        assert weights is not None
        returned.append(weights)
    if call.return_lse:
        assert lse is not None
        returned.append(lse)
    return tuple(returned)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two sets of keys from attention over each: ``(out, lse)``.

    Shapes: out_a, out_b (*batch, Hq, Lq, Dv); lse_a, lse_b (*batch, Hq, Lq), as returned by
    ``attention(..., return_lse=True)`` over keys A and over keys B of the same queries. A row's
    softmax over A ∪ B gives A the share exp(lse_a − lse) of its weight, with
    lse = log(exp(lse_a) + exp(lse_b)), so::

        out = exp(lse_a − lse) · out_a + exp(lse_b − lse) · out_b

    (what ring attention and chunked prefill do). A row with no key in either set (both lse
    −inf) gets out 0 and lse −inf. ``out`` is in out_a's dtype, ``lse`` in lse_a's; both are
    differentiable.
    """
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _checks.tensor(name, x, min_ndim=1 if name.startswith("lse") else 2)
        _checks.floating(name, x)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            f"out_a and out_b must share a shape (*batch, Hq, Lq, Dv) and lse_a, lse_b be its "
            f"(*batch, Hq, Lq), got out_a {_checks.shape_str(out_a.shape)}, out_b "
            f"{_checks.shape_str(out_b.shape)}, lse_a {_checks.shape_str(lse_a.shape)}, lse_b "
            f"{_checks.shape_str(lse_b.shape)}"
        )
    dtype = torch.promote_types(lse_a.dtype, torch.float32)
    lse, share_a, share_b = logsumexp.shares(lse_a.to(dtype), lse_b.to(dtype))  # (*batch, Hq, Lq)
    out = share_a[..., None] * out_a.to(dtype) + share_b[..., None] * out_b.to(dtype)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
