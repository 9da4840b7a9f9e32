"""``SelfAttention``: projections to Q, K, V, attention, and the output projection.

The layer only projects and reshapes; the attention itself is ``qkv.attention``, or
``qkv.attention_with_cache`` when it decodes with a ``KVCache``. How fast a call runs is decided
by the backends' dispatch, never here.
Legend: B batch, H heads, Hkv key/value heads, L query length, S key length, E model width
(d_model), C context width (d_context), D head size (head_dim).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qkv import _checks, masks
from qkv.backends.dispatch import NAMES
from qkv.cache import KVCache
from qkv.functional import attention, attention_with_cache


class SelfAttention(nn.Module):
    """Multi-head attention: project to Q, K, V, attend with ``qkv.attention``, project back.

    ``heads=1`` is single-head attention; ``kv_heads < heads`` is grouped-query attention
    (``kv_heads=1``: multi-query). ``head_dim`` defaults to ``d_model // heads``. ``d_context`` is
    the feature size of ``context`` for cross-attention (default ``d_model``). For self-attention
    Q, K and V come from one fused projection ``qkv_proj``. ``bias`` applies to every projection;
    ``out_bias`` (default: ``bias``) overrides it for the output projection. ``dropout`` drops
    attention weights in training mode only. ``causal`` is the default rule of ``forward``.

    What real models add (as in ``qkv.attention``): ``softcap`` soft-caps the scores,
    ``sinks=True`` gives each head a learnable sink logit (the parameter ``sinks``, (heads,),
    initialised to 0), ``window`` limits each query to a local window of keys, ``alibi=True``
    adds ALiBi's linear distance penalty with the paper's slopes 2^(−8h/heads), h = 1 … heads
    (the buffer ``alibi_slopes``), in place of position embeddings.
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
        softcap: float | None = None,
        sinks: bool = False,
        window: int | tuple[int | None, int | None] | None = None,
        alibi: bool = False,
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
        self.backend = _checks.choice("backend", backend, NAMES)

        factory = {"device": device, "dtype": dtype}
        self._score_options(softcap, sinks, window, alibi, factory)
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

    def _score_options(
        self, softcap: Any, sinks: Any, window: Any, alibi: Any, factory: dict[str, Any]
    ) -> None:
        """Check and keep softcap, window, the sinks parameter and the ALiBi slopes buffer."""
        self.softcap = None if softcap is None else _checks.positive_float("softcap", softcap)
        self.window = None if window is None else _checks.window("window", window, self.causal)
        self.sinks: nn.Parameter | None = None
        if _checks.boolean("sinks", sinks):  # one logit per head, learnt (gpt-oss)
            self.sinks = nn.Parameter(torch.zeros(self.heads, **factory))
        slopes = None
        if _checks.boolean("alibi", alibi):  # a geometric sequence, one slope per head
            exponents = torch.arange(1, self.heads + 1, device=factory["device"]) * (
                -8 / self.heads
            )
            slopes = torch.exp2(exponents).to(factory["dtype"] or torch.float32)
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", slopes)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.heads}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, d_context={self.d_context}, dropout={self.dropout}, "
            f"causal={self.causal!r}, backend={self.backend!r}"
            + (f", softcap={self.softcap}" if self.softcap is not None else "")
            + (", sinks=True" if self.sinks is not None else "")
            + (f", window={self.window!r}" if self.window is not None else "")
            + (", alibi=True" if self.alibi_slopes is not None else "")
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
        q, k, v, new = self._project(x, context, cache)  # (B, H, L, D), (B, Hkv, ·, D) x 2
        options = {
            "mask": masks.combine(mask, padding_mask),
            "causal": causal,
            "dropout_p": self.dropout if self.training else 0.0,
            "return_weights": return_weights,
            "backend": self.backend,
            "softcap": self.softcap,
            "sinks": self.sinks,
            "window": self.window,
            "alibi_slopes": self.alibi_slopes,
        }
        if new:  # this call's keys and values join the cache
            assert cache is not None
            result = attention_with_cache(q, k, v, cache, **options)
        else:
            result = attention(q, k, v, **options)
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        out = self.out_proj(out)  # (B, L, E)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return (out, weights) if weights is not None else out

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Q from x; K, V from context (cross) or x (self). The flag says whether K and V are
        new positions for ``cache``; False when there is no cache, and for cross-attention
        after the first call, whose K and V are then the cached projections of the context."""
        if context is None:  # self-attention: one matmul gives Q, K and V, split by heads
            assert self.qkv_proj is not None
            heads = _split_heads(self.qkv_proj(x), self.heads + 2 * self.kv_heads)
            q, k, v = heads.split_with_sizes([self.heads, self.kv_heads, self.kv_heads], dim=1)
            return q, k, v, cache is not None
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = self.q_proj(x) if self.q_proj is not None else _rows(self.qkv_proj, x, 0, q_size)
        q = _split_heads(q, self.heads)  # (B, H, L, D)
        if cache is not None and len(cache) > 0:  # the context was projected and cached
            return q, cache.keys, cache.values, False
        kv = (
            self.kv_proj(context)
            if self.kv_proj is not None
            else _rows(self.qkv_proj, context, q_size, q_size + 2 * kv_size)
        )
        k, v = torch.split(
            _split_heads(kv, 2 * self.kv_heads), self.kv_heads, dim=1
        )  # (B, Hkv, S, D)
        return q, k, v, cache is not None

    def _check_inputs(self, x: Any, context: Any) -> bool:
        """Check x and context against the layer; True if they are unbatched."""
        weight = self.out_proj.weight
        if (  # the common call, tested at once (a decoding step comes here once per layer)
            context is None
            and self.qkv_proj is not None
            and isinstance(x, torch.Tensor)
            and x.dim() in (2, 3)
            and x.shape[-1] == self.d_model
            and x.dtype == weight.dtype
            and x.device == weight.device
        ):
            return bool(x.dim() == 2)
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
        return bool(x.dim() == 2)

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


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads * D) -> (B, heads, L, D)."""
    batch, length, features = x.shape
    return x.view(batch, length, heads, features // heads).transpose(1, 2)
