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
  silently.

The mask transformers would build is the truth. Where a request to the mask function is a rule
qkv's arguments mean exactly (causal, a sliding window, bidirectional, key padding, sequences
packed by position ids: ``qkv.integrations.mask_rules``, read from the mask function transformers
hands over, per request; with a static cache, the causal rule over its valid prefix, of which
alone the kernel is handed a view), no (Lq, Lk) mask is built and the rule runs as arguments;
anything else is built as transformers builds it for torch's kernel (bool, True = may attend:
qkv's own convention). Nothing is taken from a layer's attributes: a model that passes no mask
gets its layer's causal rule, as in transformers' sdpa path.

With transformers' continuous batching (``model.generate_batch``, ``init_continuous_batching``:
a ``PagedAttentionCache``) each step is one packed row of requests, attended by
``qkv.varlen_attn`` (``qkv.integrations.hf_paged``).

Models whose attention code bypasses transformers' interface run that code on "eager" (the
parts of a composite model that use the interface stay on qkv, with one warning naming the
rest), or are refused by name where no part uses it.

transformers is optional (``pip install "qkv[hf]"``) and imported only by these functions.
Legend: B batch, H heads (Hq query, Hkv key/value), L/Lq query length, S/Lk key length, D features.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from qkv import _tracing, logsumexp, masks
from qkv.functional import attention
from qkv.integrations import hf_paged, mask_rules, model_parts

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
    hf_paged.accept_continuous_batching(_REGISTERED)
    return name


def _refuse_models_outside_the_interface(model_class: type) -> None:
    """Make asking for qkv run only the parts of a model that call transformers' attention
    interface on qkv, the rest on "eager", and refuse by name a model with no such part
    (``model_parts.split``). transformers chooses every model's implementation in
    ``get_correct_attn_implementation``; this wraps it once."""
    original = model_class.get_correct_attn_implementation  # type: ignore[attr-defined]
    if getattr(original, "refuses_models_outside_the_interface", False):
        return

    def get_correct_attn_implementation(
        self: Any, requested_attention: str | None, is_init_check: bool = False
    ) -> str:
        if requested_attention in _REGISTERED:
            own_code = model_parts.split(self, requested_attention)
            if own_code is not None:
                return own_code
        result: str = original(self, requested_attention, is_init_check)
        return result

    get_correct_attn_implementation.refuses_models_outside_the_interface = True  # type: ignore[attr-defined]
    model_class.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[attr-defined]


def mask_forward(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for qkv: the mask a request describes, as a rule where qkv
    recognises it exactly, else built.

    Where the request is a causal, sliding-window or bidirectional rule with padding (or
    sequences packed by position ids) that qkv's arguments mean exactly
    (``mask_rules.rule_of``), it returns a ``mask_rules.RuleMask``: no (Lq, Lk) mask is built,
    and qkv's attention function runs the rule as arguments. Anything else is transformers'
    own ``sdpa_mask``, a bool (B, 1, Lq, Lk) mask, True = may attend (qkv's convention), built
    in full: the shortcuts that let it return None are turned off, so that a missing mask
    always means the model passed none. Traced (torch.compile, torch.export), every mask is
    built: a tracer follows no tensor subclass made on the way.
    """
    from transformers.masking_utils import sdpa_mask

    tensors = [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
    traced = torch.compiler.is_compiling() or any(_tracing.traced(x) for x in tensors)
    if not traced:  # (traced: the dense mask, exact)
        rule_mask = mask_rules.rule_mask(kwargs)
        if rule_mask is not None:
            return rule_mask
    kwargs["allow_is_causal_skip"] = kwargs["allow_is_bidirectional_skip"] = False
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
    a ``RuleMask`` from qkv's mask function (its rule runs as arguments), bool (True = may
    attend) or float (added), broadcastable to (B, Hq, Lq, Lk), or None: then, as in
    transformers' sdpa path, the layer's causal rule (the ``is_causal`` argument, else the
    layer's attribute), aligned bottom-right (a KV cache's new queries are the last keys).
    Returns ``(out (B, Lq, Hq, Dv), weights (B, Hq, Lq, Lk) or None)``; weights are computed
    only when the model is asked for attentions.
    """
    if hf_paged.is_continuous_batching(kwargs):  # continuous batching: one packed row
        return hf_paged.paged_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
    plain = position_bias is None and kwargs.get("indices") is None
    arguments = _mask_arguments(module, query, key, attention_mask, is_causal, plain)
    used = arguments.pop("used_keys")
    if used != key.shape[-2]:  # (a static cache: its valid prefix, a view)
        key, value = key.narrow(-2, 0, used), value.narrow(-2, 0, used)
    # An additive bias per (head, query, key) joins the mask, which adds -inf where it blocks;
    # so do the keys a sparse-attention indexer selected for each query.
    arguments["mask"] = masks.combine(arguments["mask"], position_bias)
    selected = _selected_keys(module, kwargs, key.shape[-2])
    arguments["mask"] = masks.combine(arguments["mask"], selected)
    want_weights = _weights_requested(kwargs)
    sinks = _first(kwargs, "s_aux", "sinks")
    head_sinks = sinks is None or tuple(sinks.shape) == (query.shape[-3],)
    result = attention(
        query,
        key,
        value,
        scale=scaling,
        dropout_p=float(dropout),
        return_weights=want_weights,
        softcap=kwargs.get("softcap") or None,  # 0: none, as in FlashAttention
        sinks=sinks if head_sinks else None,
        return_lse=not head_sinks,
        **arguments,
    )
    parts = list(result) if isinstance(result, tuple) else [result]
    if not head_sinks:  # one sink logit per query row: (B, Hq, Lq) or (B, Hq, Lq, 1)
        parts = _with_row_sinks(parts[:-1], parts[-1], sinks)
    out, weights = parts if want_weights else (parts[0], None)
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, Hq, Dv)


def _with_row_sinks(
    parts: list[torch.Tensor], lse: torch.Tensor, sinks: torch.Tensor
) -> list[torch.Tensor]:
    """Output (and weights) of attention with one sink logit per query row (a virtual key of
    value 0, as a per-token sink projection gives): the keys keep exp(lse) / (exp(lse) +
    exp(sink)) of the row's probability (``logsumexp.shares``), the sink the rest. A row with no
    key keeps nothing (lse = −inf): its output is 0."""
    if sinks.dim() == lse.dim() + 1 and sinks.shape[-1] == 1:
        sinks = sinks.squeeze(-1)
    _, share, _ = logsumexp.shares(lse, sinks.to(lse.dtype).expand_as(lse))  # (B, Hq, Lq)
    return [(part * share[..., None]).to(part.dtype) for part in parts]


def _mask_arguments(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
    plain: bool = True,
) -> dict[str, Any]:
    """``qkv.attention``'s mask, causal rule, window and segments for one layer's call, and
    ``used_keys``: how many of the keys it reads (a rule's ``key_count``: a static cache's
    valid prefix, where nothing else of the call (``plain`` False: a bias or chosen keys per
    key) spans the whole cache; else all)."""
    lk = key.shape[-2]
    if isinstance(attention_mask, mask_rules.RuleMask):
        rule = attention_mask.rule
        fits = (rule.lq, rule.lk, rule.batch) == (query.shape[-2], lk, query.shape[0])
        if fits and (plain or rule.used is None):
            return {**rule.arguments(), "used_keys": rule.key_count}
        attention_mask = attention_mask.materialize()  # (sizes of another layer: as eager)
    if attention_mask is not None:
        return {"mask": attention_mask, "causal": False, "used_keys": lk}
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    return {"mask": None, "causal": bool(causal), "used_keys": lk}


def _selected_keys(module: torch.nn.Module, kwargs: dict[str, Any], lk: int) -> Any:
    """(B, 1, Lq, Lk) bool, True at the keys a sparse-attention indexer chose for each query
    (DeepSeek V3.2's ``indices``, (B, Lq, top-k) key positions), or None. Models of that kind
    apply the choice as a mask on "eager" and "sdpa" and hand it to their kernel otherwise: qkv
    applies it as eager does. Block indices (choices of key blocks) are refused: their meaning
    lives in the model's own indexer."""
    if kwargs.get("block_indices") is not None:
        raise ValueError(
            f"{type(module).__name__} passes block_indices (the key blocks its sparse-attention "
            'indexer chose), which qkv cannot apply; load it with attn_implementation="eager" '
            'or "sdpa" instead'
        )
    indices = kwargs.get("indices")
    if not isinstance(indices, torch.Tensor):
        return None
    if indices.ndim != 3 or bool((indices < 0).any()) or bool((indices >= lk).any()):
        raise ValueError(
            f"{type(module).__name__}'s indices (the keys chosen for each query) must be "
            f"(B, Lq, top-k) positions in [0, {lk}), got shape {tuple(indices.shape)}"
        )
    chosen = torch.zeros(*indices.shape[:2], lk, dtype=torch.bool, device=indices.device)
    return chosen.scatter(-1, indices.long(), True)[:, None]  # (B, 1, Lq, Lk)


def _first(kwargs: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` that the model passed (not None), or None."""
    return next((kwargs[name] for name in names if kwargs.get(name) is not None), None)


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the model will return this layer's attention weights.

    transformers asks with ``output_attentions=True``: as an argument passed down to here, or
    (also when set on the config) through its output collector, which is active while the model
    call gathers the weights with hooks.
    """
    if kwargs.get("output_attentions"):
        return True
    collector = _output_collector()
    if collector is None:
        return False
    collecting = collector.get()
    return bool(collecting) and any("attentions" in key for key in collecting)


@functools.cache
def _output_collector() -> Any:
    """transformers' context variable of the outputs a model call is collecting (None in a
    version without one), looked up once: the attention function asks on every call."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector
