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
  so no conversion is needed — and never leaves a causal or padding mask out. Where the layer's
  causal rule, window or packed documents (``qkv.integrations.packing``) say all of it, it
  builds none; where padding is all they leave, only the (B, 1, 1, Lk) key padding.

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
from qkv.integrations import packing

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
    _refuse_models_outside_the_interface(transformers.PreTrainedModel)
    return name


def _refuse_models_outside_the_interface(model_class: type) -> None:
    """Make asking for qkv on a model whose attention layers bypass transformers' attention
    interface (bloom, falcon, gpt_neo, mpt, ... compute attention in their own code) an error
    naming the model and the alternative. Without it such a model either fails with a bare
    ``KeyError`` or runs its own attention on qkv's bool mask read as numbers, silently wrong.

    transformers chooses every model's implementation in ``get_correct_attn_implementation``;
    this wraps it once. A model bypasses the interface when transformers' own test
    (``_can_set_attn_implementation``: its attention class never calls the interface) says so.
    """
    original = model_class.get_correct_attn_implementation  # type: ignore[attr-defined]
    if getattr(original, "refuses_models_outside_the_interface", False):
        return

    def get_correct_attn_implementation(
        self: Any, requested_attention: str | None, is_init_check: bool = False
    ) -> str:
        can_set = getattr(type(self), "_can_set_attn_implementation", None)
        if requested_attention in _REGISTERED and can_set is not None and not can_set():
            model_type = getattr(getattr(self, "config", None), "model_type", "?")
            raise ValueError(
                f'{type(self).__name__} (model type "{model_type}") computes attention in its '
                f"own code, outside transformers' attention interface, so "
                f'attn_implementation="{requested_attention}" cannot run it on qkv (it would '
                f'never call qkv, or misread its mask); load it with attn_implementation="eager" '
                f'or "sdpa" instead'
            )
        result: str = original(self, requested_attention, is_init_check)
        return result

    get_correct_attn_implementation.refuses_models_outside_the_interface = True  # type: ignore[attr-defined]
    model_class.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[attr-defined]


def mask_forward(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for qkv: a bool (B, 1, Lq, Lk) mask, True = may attend; a
    (B, 1, 1, Lk) key padding mask where the layer's causal rule and window say the rest; or None
    where they (with packed documents) say all of it.

    It is transformers' own ``sdpa_mask`` (the same mask, in the same convention as qkv). Its
    causal shortcut is kept where qkv's bottom-right causal rule means what the skipped mask
    meant: with no padding, for one query or as many queries as keys (where both alignments
    agree), never when decoding into a static cache. (transformers also takes it for a static
    cache's prefill, whose queries are the first of the cache's keys, top-left: not here.) Then
    no (Lq, Lk) mask is built at all and the layer's causal rule applies (``attention_forward``).
    transformers does not take it for a sliding window
    the keys reach past (``local_size``), because torch's kernel has no window; qkv has one, and
    a sliding layer passes its window to the attention function (as FlashAttention needs), so
    qkv takes the shortcut there too, except for chunked attention, which ``local_size`` also
    describes. The bidirectional shortcut is turned off: it would drop the mask of models whose
    layers still say ``is_causal``.

    Sequences packed by their position ids (one row holds several documents, each restarting its
    positions; transformers' ``DataCollatorWithFlattening`` with ``return_position_ids=True``) get
    no mask either when transformers' mask is exactly its causal (or sliding-window causal) rule
    within each document: the document ids transformers found are kept for the model's config,
    and ``attention_forward`` passes them to qkv as ``segments`` (``qkv.integrations.packing``).

    Padding in a causal (or sliding-window causal) layer's mask, several queries being the last
    of the keys, is a (B, 1, 1, Lk) key padding mask (``_key_padding``): the layer's causal rule
    and window apply in qkv.
    """
    from transformers.masking_utils import sdpa_mask

    rule, documents = packing.causal_rule(kwargs)
    if rule:  # (the model's packing, or none, for its layers: ``attention_forward``)
        packing.remember(kwargs.get("config"), documents)
        if documents is not None:
            return None
        key_padding = _key_padding(kwargs)
        if key_padding is not None:
            return key_padding
    kwargs["allow_is_bidirectional_skip"] = False
    if kwargs.get("q_length") not in (1, kwargs.get("kv_length")):
        kwargs["allow_is_causal_skip"] = False
    chunked = getattr(kwargs.get("config"), "attention_chunk_size", None) is not None
    if kwargs.get("local_size") is not None and not chunked:
        kwargs["local_size"] = None  # a sliding window: qkv applies it (see above)
    return sdpa_mask(*args, **kwargs)


def _key_padding(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """(B, 1, 1, Lk) bool, True = a real key: the padding of transformers' causal mask request
    ``kwargs`` when the rest of that mask is the layer's causal rule aligned bottom-right (the
    Lq > 1 queries are the last Lq of the keys: no static cache) and the caller lets the mask be
    left out (it may combine the mask with others). Else None: the mask is built."""
    padding, lq, lk = (kwargs.get(name) for name in ("attention_mask", "q_length", "kv_length"))
    offsets = [kwargs.get(name, 0) for name in ("q_offset", "kv_offset")]
    if (
        not isinstance(padding, torch.Tensor)
        or padding.ndim != 2
        or not kwargs.get("allow_is_causal_skip", True)
    ):
        return None
    if not (isinstance(lq, int) and isinstance(lk, int) and lq > 1):
        return None
    if not all(isinstance(offset, int) for offset in offsets):
        return None
    q_offset, kv_offset = offsets
    if q_offset + lq != kv_offset + lk or padding.shape[-1] < kv_offset + lk:
        return None
    keys = padding[:, kv_offset : kv_offset + lk].to(torch.bool)
    batch = kwargs.get("batch_size", keys.shape[0])
    return keys[:, None, None, :].expand(batch, 1, 1, lk)


def _key_padding_only(mask: torch.Tensor | None, lq: int, causal_layer: bool) -> bool:
    """Whether a causal layer's bool mask holds key padding alone ((…, 1, Lk) for Lq > 1
    queries: ``_key_padding``'s, never transformers', whose masks have a row per query), so the
    layer's causal rule and window still apply."""
    return (
        causal_layer
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.ndim == 4
        and mask.shape[-2] == 1
        and lq > 1
    )


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
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(
            'qkv attention does not support paged caches (continuous batching); use "sdpa"'
        )

    # An additive bias per (head, query, key) joins the mask, which adds -inf where it blocks.
    mask = masks.combine(attention_mask, position_bias)
    # The layer's own causal rule; applied when the model passes no mask, aligned for a cache
    # (bottom-right).
    causal_layer = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    no_mask = attention_mask is None
    rule_left = no_mask or _key_padding_only(attention_mask, query.shape[-2], causal_layer)
    causal = causal_layer and rule_left
    if rule_left and kwargs.get("sliding_window") is None:
        kwargs["sliding_window"] = getattr(module, "sliding_window", None)  # (the mask skipped it)
    lk = key.shape[-2]
    structure = _structure(module, query.shape, lk, (no_mask, rule_left), causal_layer, kwargs)

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
        softcap=kwargs.get("softcap") or None,  # 0: none, as in FlashAttention
        sinks=_first(kwargs, "s_aux", "sinks"),
        **structure,
    )
    out, weights = result if want_weights else (result, None)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, Hq, Dv)


def _first(kwargs: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` that the model passed (not None), or None."""
    return next((kwargs[name] for name in names if kwargs.get(name) is not None), None)


def _structure(
    module: torch.nn.Module,
    query_shape: torch.Size,
    lk: int,
    masked: tuple[bool, bool],
    causal_layer: bool,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The window and the packed sequences a model passes, as ``window=`` and ``segments=``.

    transformers' mask already blocks what they block; passed as well, they let flash skip the
    tiles outside them. In a causal layer ``sliding_window`` = w means the w most recent keys
    (transformers' mask and FlashAttention's window (w − 1, ·) agree), ``window=(w − 1, 0)``,
    bottom-right aligned: the mask's alignment when the model passed no mask (or key padding
    alone, ``masked``) or queries and keys have one length (with a static cache, a prefill's
    queries are not the last of its keys, so the window is left to the mask there). A
    bidirectional layer's w is left to the mask: its meaning differs between families
    (modernbert passes one more than its mask's reach, t5gemma's encoder the reach itself).
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (a flattened batch of packed sequences) become segment
    ids, as do, in a causal layer given no mask, the documents of sequences packed by position
    ids (``packing.documents``).
    """
    structure: dict[str, Any] = {}
    batch, lq = query_shape[0], query_shape[-2]
    sliding_window = kwargs.get("sliding_window")
    no_mask, rule_left = masked  # (no mask; no mask or key padding alone)
    known = causal_layer and (rule_left or lq == lk)
    if isinstance(sliding_window, int) and sliding_window > 0 and known:
        structure["window"] = (sliding_window - 1, 0)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and batch == 1:
        if int(cu_q[-1]) <= lq and int(cu_k[-1]) <= lk:  # (B = 1: the sequences lie side by side)
            structure["segments"] = (
                masks.segments_from_cu_seqlens(cu_q, lq)[None],
                masks.segments_from_cu_seqlens(cu_k, lk)[None],
            )
    elif no_mask and causal_layer and lq == lk:  # maybe packed by position ids (mask_forward)
        documents = packing.documents(module, kwargs.get("position_ids"), batch, lq)
        if documents is not None:
            structure["segments"] = documents
    return structure


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
