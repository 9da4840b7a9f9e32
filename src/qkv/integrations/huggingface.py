"""Hugging Face transformers on qkv: ``attn_implementation="qkv"``.

    from qkv.integrations.huggingface import register
    register()                                    # once per process; returns "qkv"
    model = AutoModel.from_pretrained(..., attn_implementation="qkv")
    out = model(**batch, output_attentions=True)  # out.attentions: real softmax weights

``register`` adds two functions to transformers:

- an attention function (``transformers.AttentionInterface``): every attention call of the model
  goes through ``qkv.attention`` (so ``qkv.trace`` sees it). Weights are computed only when the
  caller asks for them (``output_attentions=True``); otherwise qkv picks its fastest backend.
- a mask function (``transformers.masking_utils.AttentionMaskInterface``): without one,
  transformers builds no mask at all for an unknown implementation, and padding would be dropped
  silently. It builds the boolean mask (B, 1, Lq, Lk), True = may attend — qkv's own convention,
  so no conversion is needed — and never leaves a causal or padding mask out.

When a model passes no mask, its own causal rule applies (the ``is_causal`` argument, else the
layer's ``is_causal`` attribute), aligned bottom-right: with a KV cache, the Lq new queries are
the last Lq of the Lk keys.

transformers is optional (``pip install "qkv[hf]"``) and imported only by these functions.
Legend: B batch, H heads (Hq query, Hkv key/value), L/Lq query length, S/Lk key length, D features.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from qkv import masks
from qkv.functional import attention

INSTALL_HINT = 'pip install "qkv[hf]"'
_REGISTERED: set[str] = set()


def require_transformers() -> ModuleType:
    """Import transformers, or raise ``ImportError`` naming the install command."""
    try:
        transformers = importlib.import_module("transformers")
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError as error:
        raise ImportError(
            f"qkv's Hugging Face integration needs transformers: {INSTALL_HINT}"
        ) from error
    if not hasattr(transformers, "AttentionInterface") or not hasattr(
        masking_utils, "AttentionMaskInterface"
    ):
        raise ImportError(
            f"transformers {transformers.__version__} has no AttentionInterface and "
            f"AttentionMaskInterface to register qkv with; upgrade it: {INSTALL_HINT} -U"
        )
    return transformers


def register(name: str = "qkv") -> str:
    """Make ``attn_implementation=name`` run a transformers model's attention on qkv.

    Registers qkv's attention function and mask function under ``name`` (idempotent) and
    returns ``name``. ``name`` may not be one of transformers' own implementations ("eager",
    "sdpa", ...), which it would replace for every model.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = require_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    if name not in _REGISTERED:
        taken = {"eager", *transformers.AttentionInterface._global_mapping}
        taken |= set(AttentionMaskInterface._global_mapping)
        if name in taken:
            raise ValueError(
                f'name "{name}" is already an attention implementation of transformers; '
                f'choose another, e.g. "qkv"'
            )
    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    _REGISTERED.add(name)
    return name


def mask_forward(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for qkv: a bool (B, 1, Lq, Lk) mask, True = may attend.

    It is transformers' own ``sdpa_mask`` (the same mask, in the same convention as qkv) with
    its shortcuts turned off: those return no mask and leave the causal rule to a flag whose
    alignment differs with the cache (top-left for a static cache's prefill), and drop the
    bidirectional mask of models whose layers still say ``is_causal``. With every mask built
    here, a missing mask only ever means the caller passed none.
    """
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function for qkv.

    Shapes: query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) with Hq a multiple
    of Hkv (grouped-query heads are served by ``qkv.attention`` directly); ``attention_mask``
    bool (True = may attend) or float (added), broadcastable to (B, Hq, Lq, Lk), or None.
    Returns ``(out (B, Lq, Hq, Dv), weights (B, Hq, Lq, Lk) or None)``; weights are computed
    only when the model is asked for attentions.
    """
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"qkv attention does not support {unsupported}={kwargs[unsupported]!r}; use "
                f'attn_implementation="eager" for this model'
            )
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(
            'qkv attention does not support paged caches (continuous batching); use "sdpa"'
        )

    # An additive bias per (head, query, key) joins the mask, which adds -inf where it blocks.
    mask = masks.combine(attention_mask, position_bias)
    causal = False
    if attention_mask is None:
        # No mask from the model: its own causal rule, aligned for a cache (bottom-right).
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))

    want_weights = _weights_requested(kwargs)
    result = attention(
        query,
        key,
        value,
        mask=mask,
        causal=causal,
        scale=scaling,
        dropout_p=float(dropout),
        return_weights=want_weights,
    )
    out, weights = result if want_weights else (result, None)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, Hq, Dv)


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the model will return this layer's attention weights.

    transformers asks with ``output_attentions=True``: as an argument passed down to here, or
    (also when set on the config) through its output collector, which is active while the model
    call gathers the weights with hooks.
    """
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collecting = _active_collector.get()  # type: ignore[no-untyped-call]
    return bool(collecting) and any("attentions" in key for key in collecting)
