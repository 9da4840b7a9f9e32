"""transformers' continuous batching on qkv: ``model.generate_batch(...)`` and
``model.init_continuous_batching()`` with ``attn_implementation="qkv"``.

Continuous batching packs every request of a step into one row: each request's new tokens
(a prompt, a chunk of one, or the one token it decodes) one after the other, T queries in all,
delimited by ``cu_seq_lens_q`` (N + 1,). transformers' ``PagedAttentionCache`` keeps the keys
and values in pages; in the model's attention code, before the attention function is called,
``cache.update`` writes the step's new keys and values into their pages (the write indices)
and reads each request's keys back in order (the read indices: everything cached for a full
attention layer, the last ``sliding_window - 1`` tokens for a sliding one), the new ones last.
The attention function receives those keys packed the same way, delimited by
``cu_seq_lens_k``, and no mask: request i's queries are the *last* of its keys, so causal (and
a window) must line up with each request's own last key. That is ``qkv.varlen_attn``'s
convention (flash-attn's), so one call attends the whole step, nothing padded, and no
(T, total keys) mask is built (transformers' "sdpa" path builds one).

The pages are not read in place here: transformers has already gathered them when the
attention function runs (the gather is in the model's code, not in the attention function);
the only path that leaves the pages to the kernel (``block_table``, with ``k_cache``/``v_cache``)
is enabled by transformers for flash_attn_with_kvcache on CUDA/XPU alone, and is refused here.

Legend: T packed query tokens, S packed key tokens, N requests, Hq/Hkv heads, D features.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.varlen import varlen_attn

__all__ = ["accept_continuous_batching", "is_continuous_batching", "paged_attention_forward"]


def is_continuous_batching(kwargs: dict[str, Any]) -> bool:
    """Whether an attention call's keyword arguments come from a continuous-batching step.

    The layer usually keeps the ``PagedAttentionCache`` to itself (it is the layer's own
    ``cache`` argument), so the step is known by what only continuous batching passes down: the
    cache's write indices, with the packed requests' ``cu_seq_lens_q``.
    """
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        return True
    return kwargs.get("write_index") is not None and kwargs.get("cu_seq_lens_q") is not None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One attention layer of a continuous-batching step, on ``qkv.varlen_attn``.

    Shapes: query (1, Hq, T, D); key, value (1, Hkv, S, D) as ``cache.update`` returned them;
    ``kwargs`` carry ``cu_seq_lens_q`` (N + 1,), and ``cu_seq_lens_k`` (N + 1,) and
    ``max_length_k`` of this layer's cache group (``cache.update`` chose them), ``max_length_q``,
    and the layer's ``sliding_window``, ``softcap`` and sinks (``s_aux``) if it has them.
    Causal, bottom-right per request. A padded step (T beyond ``cu_seq_lens_q[-1]``, as CUDA
    graphs pad it) is refused by ``varlen_attn``'s check of ``cu_seq_q``. Returns
    ``(out (1, T, Hq, D), None)``: no weights on this path.
    """
    _refuse_what_is_not_attention(module, query, attention_mask, dropout, kwargs)
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    window = _window(module, kwargs)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    hq, hkv = query.shape[1], key.shape[1]
    out = varlen_attn(
        query[0].transpose(0, 1),  # (T, Hq, D)
        key[0].transpose(0, 1),  # (S, Hkv, D)
        value[0].transpose(0, 1),
        cu_q.to(torch.int32),
        cu_k.to(torch.int32),
        max_q,
        max_k,
        scale=scaling,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        enable_gqa=hq != hkv,
        softcap=kwargs.get("softcap") or None,  # 0: none, as in FlashAttention
        sinks=sinks,
        causal=True,
    )
    assert isinstance(out, torch.Tensor)  # no return_aux: the output alone
    return out.unsqueeze(0), None  # (1, T, Hq, D)


def _refuse_what_is_not_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    """A ValueError naming what this path cannot do: transformers' kernel-managed pages
    (``block_table``), a mask, dropout, attention weights, a position bias, or a batch that is
    not one packed row."""
    name = type(module).__name__
    if kwargs.get("block_table") is not None:
        raise ValueError(
            f"{name}: continuous batching passed a block_table (the decode path where the "
            "attention kernel writes and reads the pages itself, which transformers enables for "
            "flash_attn_with_kvcache only); qkv attends the keys cache.update returns"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{name}: continuous batching on qkv expects no attention_mask (requests are "
            f"delimited by cu_seq_lens_q/k), got a {tuple(attention_mask.shape)} mask"
        )
    if dropout:
        raise ValueError(f"{name}: dropout must be 0 in continuous batching, got {dropout}")
    if kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{name}: continuous batching on qkv returns no attention weights and takes no "
            "position_bias; run the model without a paged cache for them"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(f"{name}: continuous batching on qkv is causal; is_causal=False given")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"{name}: continuous batching packs every request into one row: query must be "
            f"(1, Hq, T, D), got {tuple(query.shape)}"
        )
    for argument in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        if not isinstance(kwargs.get(argument), (torch.Tensor, int)):
            raise ValueError(
                f"{name}: continuous batching must pass {argument} for this layer's cache "
                f"group, got {type(kwargs.get(argument)).__name__}"
            )


def _window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The layer's sliding window (each query sees its ``window`` most recent keys, itself
    included) or None: the ``sliding_window`` the layer passes, else the window of the cache
    group the layer belongs to (the group's keys are what ``cache.update`` read; transformers'
    "sdpa" path masks by the group)."""
    passed = kwargs.get("sliding_window")
    grouped = _group_window(module)
    if passed is not None and grouped is not None and int(passed) != grouped:
        raise ValueError(
            f"{type(module).__name__} passes sliding_window={passed} but its cache group "
            f"keeps a window of {grouped}"
        )
    window = passed if passed is not None else grouped
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")
    return None if window is None else int(window)


def _group_window(module: torch.nn.Module) -> int | None:
    """The sliding window of the layer's continuous-batching cache group, or None for a group
    of full attention (transformers' ``group_layers_by_attn_type`` on the layer's config)."""
    config, layer_idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or layer_idx is None:
        return None
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    if layer_idx not in group_layers_by_attn_type(config).get("sliding_attention", []):
        return None
    return int(config.sliding_window)


def accept_continuous_batching(registered: set[str]) -> None:
    """Make transformers' continuous batching manager keep a model on a registered qkv name.

    transformers 5.x accepts only "sdpa", "paged|eager" and flash implementations for
    continuous batching (``ContinuousBatchingManager.switch_to_cb_friendly_attn`` raises
    otherwise, and may switch sdpa/eager to a flash kernel). A model on a name in
    ``registered`` keeps it: qkv's attention function serves paged caches (this module), and
    as no mask is built for it, the requests are delimited by ``cu_seq_lens`` alone. Wraps the
    method once; does nothing where transformers has no continuous batching.
    """
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return
    original = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(original, "keeps_qkv", False):
        return

    def switch_to_cb_friendly_attn(
        self: Any, model: Any, auto_switch_to_flash: bool = True
    ) -> None:
        if getattr(model.config, "_attn_implementation", None) in registered:
            return
        original(self, model, auto_switch_to_flash)

    switch_to_cb_friendly_attn.keeps_qkv = True  # type: ignore[attr-defined]
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn  # type: ignore[method-assign]
