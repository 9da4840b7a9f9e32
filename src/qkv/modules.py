"""Attention layers: ``SelfAttention`` and the ``KVCache`` it decodes with.

The layer only projects and reshapes; the attention itself is ``qkv.attention``. One exception,
for speed: a plain decoding step (float32 or bfloat16 on the CPU, a cache that already holds the
layer's keys, no mask, nothing to differentiate) is one call of flash's compiled kernel
(``flash.decode_step``), which writes the new keys and values into the cache's buffers and
attends: the arithmetic ``qkv.attention`` would run, bit for bit, without the dozen torch
operations around it.
Legend: B batch, H heads, Hkv key/value heads, L query length, S key length, E model width
(d_model), C context width (d_context), D head size (head_dim).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qkv import _checks, backends, masks
from qkv.backends import flash
from qkv.functional import attention_of_projections
from qkv.trace import current as current_recorder


class KVCache:
    """The keys and values one attention layer has seen, for decoding step by step.

    ``append`` stores the new keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) and returns all
    cached ones. Storage is pre-allocated and doubles when full, so decoding n tokens copies
    O(n) elements in all, not O(n²). (When the new keys need gradients, the cache concatenates
    instead, so that autograd sees every step.)
    """

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None  # (B, Hkv, capacity, Dk)
        self._values: torch.Tensor | None = None  # (B, Hkv, capacity, Dv)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        shape = None if self._keys is None else _checks.shape_str(self.keys.shape)
        return f"KVCache(len={self._length}, keys={shape})"

    def reset(self) -> None:
        """Forget everything cached."""
        self._keys = self._values = None
        self._length = 0

    @property
    def keys(self) -> torch.Tensor:
        """(B, Hkv, len, Dk) cached keys."""
        if self._keys is None:
            raise ValueError("cache is empty: no keys have been appended")
        return self._keys[..., : self._length, :]

    @property
    def values(self) -> torch.Tensor:
        """(B, Hkv, len, Dv) cached values."""
        if self._values is None:
            raise ValueError("cache is empty: no values have been appended")
        return self._values[..., : self._length, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys and values; return everything cached (keys, values)."""
        if not self._continues(k, v):
            self._check(k, v)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            self._keys = k if self._keys is None else torch.cat([self.keys, k], dim=-2)
            self._values = v if self._values is None else torch.cat([self.values, v], dim=-2)
            self._length = self._keys.shape[-2]
            return self.keys, self.values
        added = k.shape[-2]
        keys, values, start = self._room(added, k, v)
        keys.narrow(-2, start, added).copy_(k)
        values.narrow(-2, start, added).copy_(v)
        self._extend(added)
        return keys.narrow(-2, 0, self._length), values.narrow(-2, 0, self._length)

    def _holds(self, batch: int, kv_heads: int, head_dim: int, like: torch.Tensor) -> bool:
        """Whether the cache holds keys and values (batch, kv_heads, ·, head_dim) of ``like``'s
        dtype and device, in buffers that ``_room`` can extend."""
        keys, values = self._keys, self._values
        return (
            keys is not None
            and values is not None
            and keys.shape == values.shape
            and keys.shape[:2] == (batch, kv_heads)
            and keys.shape[3] == head_dim
            and keys.dtype == like.dtype
            and keys.device == like.device
            and not (keys.requires_grad or values.requires_grad)
        )

    def _room(
        self, added: int, k: torch.Tensor | None = None, v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a caller that writes the next ``added`` positions itself (``append``, and
        ``SelfAttention``'s decoding step where ``_holds``): the key and value buffers
        (B, Hkv, capacity, D), grown if they are full (an empty cache's shaped like the new k
        and v), and the position the new ones start at. ``_extend`` counts them once they are
        written."""
        k = self._keys if k is None else k
        v = self._values if v is None else v
        assert k is not None and v is not None
        start = self._length
        self._keys = _grown(self._keys, start, added, k)
        self._values = _grown(self._values, start, added, v)
        return self._keys, self._values, start

    def _extend(self, added: int) -> None:
        self._length += added

    def _continues(self, k: Any, v: Any) -> bool:
        """Whether k and v plainly continue what is cached (the common step): tensors with the
        cache's (B, Hkv, ·, D), dtype and device, agreeing in length. ``_check`` says what is
        wrong with anything else, or lets a first call through."""
        keys, values = self._keys, self._values
        return (
            keys is not None
            and values is not None
            and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and k.dtype == keys.dtype == v.dtype
            and k.device == keys.device == v.device
            and k.dim() == 4
            and v.dim() == 4
            and k.shape[:2] == keys.shape[:2] == v.shape[:2]
            and k.shape[2] == v.shape[2]
            and k.shape[3] == keys.shape[3]
            and v.shape[3] == values.shape[3]
        )

    def _check(self, k: Any, v: Any) -> None:
        """k and v: (B, Hkv, L, D) floating tensors that agree, and match the cache if any."""
        _checks.tensor("k", k, ndims=(4,))
        _checks.tensor("v", v, ndims=(4,))
        _checks.floating("k", k)
        _checks.same_dtype(("k", "v"), (k, v))
        _checks.same_device(("k", "v"), (k, v))
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(
                f"k and v must agree in (B, Hkv, L), got k {_checks.shape_str(k.shape)} and v "
                f"{_checks.shape_str(v.shape)}"
            )
        if self._keys is not None and self._values is not None:
            for name, new, old in (("k", k, self._keys), ("v", v, self._values)):
                if new.shape[:2] != old.shape[:2] or new.shape[-1] != old.shape[-1]:
                    raise ValueError(
                        f"{name} of shape {_checks.shape_str(new.shape)} does not match the cache "
                        f"(B, Hkv, ·, D) = "
                        f"{_checks.shape_str((*old.shape[:2], self._length, old.shape[-1]))}"
                    )
                if new.dtype != old.dtype or new.device != old.device:
                    raise TypeError(
                        f"{name} must have the cache's dtype {old.dtype} on {old.device}, got "
                        f"{new.dtype} on {new.device}"
                    )


def _grown(
    buffer: torch.Tensor | None, length: int, added: int, like: torch.Tensor
) -> torch.Tensor:
    """``buffer`` if it has room for ``added`` positions after ``length``, else a copy with
    double the room (geometric growth keeps appending amortised O(1) per position), shaped
    (*like's dims but -2, capacity, like's last dim) in like's dtype and device."""
    needed = length + added
    if buffer is not None and buffer.shape[-2] >= needed:
        return buffer
    capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[-2]), 16)
    grown = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
    if buffer is not None:
        grown[..., :length, :] = buffer[..., :length, :]
    return grown


class SelfAttention(nn.Module):
    """Multi-head attention: project to Q, K, V, attend with ``qkv.attention``, project back.

    ``heads=1`` is single-head attention; ``kv_heads < heads`` is grouped-query attention
    (``kv_heads=1``: multi-query). ``head_dim`` defaults to ``d_model // heads``. ``d_context`` is
    the feature size of ``context`` for cross-attention (default ``d_model``). For self-attention
    Q, K and V come from one fused projection ``qkv_proj``. ``bias`` applies to every projection;
    ``out_bias`` (default: ``bias``) overrides it for the output projection. ``dropout`` drops
    attention weights in training mode only. ``causal`` is the default rule of ``forward``.
    """

    def __init__(
        self,
        d_model: int,
        heads: int = 1,
        *,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        d_context: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        causal: bool | str = False,
        backend: str = "auto",
        out_bias: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = _checks.positive_int("d_model", d_model)
        self.heads = _checks.positive_int("heads", heads)
        self.kv_heads = heads if kv_heads is None else _checks.positive_int("kv_heads", kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads must be a multiple of kv_heads, got heads={heads}, kv_heads={kv_heads}"
            )
        if head_dim is None and d_model % heads:
            raise ValueError(
                f"d_model must be divisible by heads (or give head_dim), got d_model={d_model}, "
                f"heads={heads}"
            )
        self.head_dim = (
            d_model // heads if head_dim is None else _checks.positive_int("head_dim", head_dim)
        )
        self.d_context = (
            d_model if d_context is None else _checks.positive_int("d_context", d_context)
        )
        _checks.boolean("bias", bias)
        out_bias = bias if out_bias is None else _checks.boolean("out_bias", out_bias)
        self.dropout = _checks.probability("dropout", dropout)
        self.causal = _checks.choice("causal", causal, masks.CAUSAL_VALUES)
        self.backend = _checks.choice("backend", backend, backends.NAMES)

        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj: nn.Linear | None = None
        self.kv_proj: nn.Linear | None = None
        self.qkv_proj: nn.Linear | None = None
        if self.d_context == self.d_model:  # self-attention: one fused projection
            self.qkv_proj = nn.Linear(d_model, q_size + 2 * kv_size, bias=bias, **factory)
        else:  # cross-attention only: queries from x, keys and values from context
            self.q_proj = nn.Linear(d_model, q_size, bias=bias, **factory)
            self.kv_proj = nn.Linear(self.d_context, 2 * kv_size, bias=bias, **factory)
        self.out_proj = nn.Linear(q_size, d_model, bias=out_bias, **factory)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.heads}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, d_context={self.d_context}, dropout={self.dropout}, "
            f"causal={self.causal!r}, backend={self.backend!r}"
        )

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        causal: bool | str | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (B, L, E) or (L, E); context: (B, S, C) or (S, C) for cross-attention.

        ``mask`` (True = may attend, or float added) broadcasts to (B, H, L, S); ``padding_mask``
        is (B, S) bool or 0/1 with True/1 at real key tokens; ``cache`` appends this call's keys
        and values and attends to all of them (with ``context``, the context's keys and values
        are cached on the first call and reused afterwards). Returns (B, L, E) [, weights
        (B, H, L, S)], unbatched if x was.
        """
        unbatched = self._check_inputs(x, context)
        causal = (
            self.causal if causal is None else _checks.choice("causal", causal, masks.CAUSAL_VALUES)
        )
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a qkv.KVCache, got {type(cache).__name__}")
        _checks.boolean("return_weights", return_weights)
        if unbatched:
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
            padding_mask = None if padding_mask is None else _as_batched(padding_mask)

        # Masks are checked before the cache grows, so a rejected call leaves the cache as it was.
        batch, length = x.shape[:2]
        cached = 0 if cache is None else len(cache)
        reuse_context = context is not None and cached > 0  # cross-attention: keys are cached
        keys = cached + (0 if reuse_context else (x if context is None else context).shape[1])
        if mask is not None:  # checked here too: it is combined with padding_mask below
            scores_shape = (batch, self.heads, length, keys)
            _checks.mask("mask", mask, scores_shape, "(B, heads, L, S)")
        if padding_mask is not None:
            padding_mask = self._padding_mask(padding_mask, batch, keys)
        weights = None
        plain = mask is None and padding_mask is None and context is None and not return_weights
        if plain and cache is not None and self._steps_on_kernel(x, cache):
            out = self._decode_step(x, cache, causal)  # (B, L, H·D)
        else:
            q, k, v = self._project(x, context, cache)  # (B, H, L, D), (B, Hkv, S, D) x 2
            result = attention_of_projections(
                q,
                k,
                v,
                mask=masks.combine(mask, padding_mask),
                causal=causal,
                dropout_p=self.dropout if self.training else 0.0,
                return_weights=return_weights,
                backend=self.backend,
            )
            out, weights = result if isinstance(result, tuple) else (result, None)
            out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        out = self.out_proj(out)  # (B, L, E)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return (out, weights) if weights is not None else out

    def _steps_on_kernel(self, x: torch.Tensor, cache: KVCache) -> bool:
        """Whether this call (self-attention of x with a cache, no mask, no weights asked for) is
        a decoding step that flash's kernel runs in one call (``flash.decode_step``): the cache
        already holds this layer's keys, nothing is differentiated or dropped out, no autocast
        changes the projections' dtype, no ``qkv.trace`` records the call, and the backend is
        flash, or auto, which picks flash for such a call (``backends.choose``)."""
        return (
            self.backend in ("auto", "flash")
            and (self.dropout == 0.0 or not self.training)
            and not (torch.is_grad_enabled() and _needs_gradients(self, x))
            and not torch.is_autocast_enabled(x.device.type)  # projections in another dtype
            and current_recorder() is None
            and cache._holds(x.shape[0], self.kv_heads, self.head_dim, x)
            and flash.decode_step_takes(x, x.shape[1])
        )

    def _decode_step(self, x: torch.Tensor, cache: KVCache, causal: bool | str) -> torch.Tensor:
        """The fused projection of x's L positions; the kernel appends their keys and values to
        the cache and attends their queries to every cached position. Returns (B, L, H·D)."""
        assert self.qkv_proj is not None
        length = x.shape[1]
        keys, values, start = cache._room(length)
        rows = self.qkv_proj(x)  # (B, L, (H + 2·Hkv)·D)
        offset = masks.causal_offset(causal, length, start + length)
        scale = 1.0 / math.sqrt(self.head_dim)
        out = flash.decode_step(rows, keys, values, start, self.heads, scale, offset)
        cache._extend(length)
        return out

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q from x; K, V from context (cross) or x (self), through the cache if given."""
        if context is None:  # self-attention: one matmul gives Q, K and V, split by heads
            assert self.qkv_proj is not None
            heads = _split_heads(self.qkv_proj(x), self.heads + 2 * self.kv_heads)
            q, k, v = heads.split_with_sizes([self.heads, self.kv_heads, self.kv_heads], dim=1)
            return (q, *cache.append(k, v)) if cache is not None else (q, k, v)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = self.q_proj(x) if self.q_proj is not None else _rows(self.qkv_proj, x, 0, q_size)
        q = _split_heads(q, self.heads)  # (B, H, L, D)
        if cache is not None and len(cache) > 0:  # the context was projected and cached
            return q, cache.keys, cache.values
        kv = (
            self.kv_proj(context)
            if self.kv_proj is not None
            else _rows(self.qkv_proj, context, q_size, q_size + 2 * kv_size)
        )
        k, v = _split_heads(kv, 2 * self.kv_heads).split(self.kv_heads, dim=1)  # (B, Hkv, S, D)
        return (q, *cache.append(k, v)) if cache is not None else (q, k, v)

    def _check_inputs(self, x: Any, context: Any) -> bool:
        """Check x and context against the layer; True if they are unbatched."""
        weight = self.out_proj.weight
        _checks.tensor("x", x, ndims=(2, 3))
        _checks.floating("x", x)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have d_model={self.d_model} features in its last dim, got "
                f"{_checks.shape_str(x.shape)}"
            )
        tensors, names = [x], ["x"]
        if context is None:
            if self.qkv_proj is None:
                raise ValueError(
                    f"context is required: this layer has d_context={self.d_context} != "
                    f"d_model={self.d_model}, so it only does cross-attention"
                )
        else:
            _checks.tensor("context", context, ndims=(x.dim(),))
            if context.shape[-1] != self.d_context:
                raise ValueError(
                    f"context must have d_context={self.d_context} features in its last dim, "
                    f"got {_checks.shape_str(context.shape)}"
                )
            if x.dim() == 3 and context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context batch size must match x's, got x {_checks.shape_str(x.shape)} and "
                    f"context {_checks.shape_str(context.shape)}"
                )
            tensors.append(context)
            names.append("context")
        for name, tensor in zip(names, tensors):
            if tensor.dtype != weight.dtype:
                raise TypeError(
                    f"{name} must have the layer's dtype {weight.dtype}, got {tensor.dtype}"
                )
            _checks.same_device((name, "layer weights"), (tensor, weight))
        return x.dim() == 2

    @staticmethod
    def _padding_mask(padding_mask: Any, batch: int, keys: int) -> torch.Tensor:
        _checks.tensor("padding_mask", padding_mask, ndims=(2,))
        if tuple(padding_mask.shape) != (batch, keys):
            raise ValueError(
                f"padding_mask must have shape (B, S) = ({batch}, {keys}), got "
                f"{_checks.shape_str(padding_mask.shape)}"
            )
        try:
            return masks.padding_mask(padding_mask)
        except (TypeError, ValueError) as error:
            raise type(error)(f"padding_mask: {error}") from None


def _as_batched(padding_mask: Any) -> Any:
    """An unbatched layer call takes an (S,) padding mask."""
    return padding_mask.unsqueeze(0) if isinstance(padding_mask, torch.Tensor) else padding_mask


def _rows(layer: nn.Linear | None, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Output features start:stop of a linear layer (a slice of the fused QKV projection)."""
    assert layer is not None
    bias = None if layer.bias is None else layer.bias[start:stop]
    return nn.functional.linear(x, layer.weight[start:stop], bias)


def _needs_gradients(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether autograd would record the layer's call on x (with grad mode on)."""
    return x.requires_grad or any(p.requires_grad for p in layer.parameters())


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads * D) -> (B, heads, L, D)."""
    batch, length, features = x.shape
    return x.view(batch, length, heads, features // heads).transpose(1, 2)
