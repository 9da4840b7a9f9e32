"""Tiny random configs for every transformers model family, generated from its config class.

``tiny_config(model_type)`` takes ``transformers.CONFIG_MAPPING[model_type]()`` (the family's
defaults, billions of parameters) and shrinks it, walking its attributes by name, into its
sub-configs (text_config, vision_config, encoder, decoder, ...): width 32, 4 heads of 8 features
with 2 key/value heads, FFN 64, 2 layers, vocabulary 128, 4 experts of which 2 per token, and a
sliding window of 4 keys, so that windows bite at the sweep's lengths (10 tokens). A per-layer
list (``layer_types`` and its kin) keeps one layer of each kind it holds: sliding and full
layers both appear. Special token ids outside the small vocabulary move to its top.
``OVERRIDES`` holds what the generic rule cannot know about a family.
"""

from __future__ import annotations

import copy
from typing import Any

WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 4, 2, 8, 64
LAYERS, MAX_LAYERS = 2, 4  # (more only where a per-layer list holds more kinds of layers)
VOCAB, POSITIONS, WINDOW = 128, 128, 4
EXPERTS, EXPERTS_PER_TOKEN = 4, 2

# attribute name: its tiny value, for an int (and for None where the name is in SET_WHEN_NONE:
# a default config may leave them to be derived, or forget them).
EXACT: dict[str, int] = {
    **dict.fromkeys(
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "embedding_dim",
            "dim",
            "hidden_dim",
            "model_dim",
            "embedding_size",
            "word_embed_proj_dim",
            "text_hidden_size",
            "out_hidden_size",
            "encoder_hidden_size",
            "projection_dim",
            "projector_hidden_size",
            "lru_width",
            "emb_dim",
            "entity_emb_size",
            "adapter_in_dim",
            "adapter_input_size",
            "adapter_out_dim",
        ),
        WIDTH,
    ),
    **dict.fromkeys(("n_head", "num_heads", "n_heads"), HEADS),
    **dict.fromkeys(("n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("d_kv", "kv_channels", "v_head_dim", "qk_head_dim", "d_head"), HEAD_DIM),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"), HEAD_DIM // 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank"), 16),
    **dict.fromkeys(
        ("d_ff", "n_inner", "mlp_dim", "ffn_hidden_size", "expert_ffn_hidden_size"), FFN
    ),
    "hidden_size_per_layer_input": HEAD_DIM,
    **dict.fromkeys(
        ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS
    ),
    **dict.fromkeys(
        (
            "num_experts_per_tok",
            "num_experts_per_token",
            "moe_k",
            "moe_topk",
            "moe_top_k",
            "top_k_experts",
            "n_activated_experts",
        ),
        EXPERTS_PER_TOKEN,
    ),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "first_k_dense_replace"), 1),
    **dict.fromkeys(
        (
            "sliding_window",
            "local_attention",
            "sliding_window_size",
            "attention_chunk_size",
            "attention_window_size",
            "index_topk",
        ),
        WINDOW,
    ),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim", "mamba_d_state"), 16),
    **dict.fromkeys(("mamba_n_groups", "mamba_ngroups", "n_groups", "n_shared_experts"), 1),
    "vocab_size": VOCAB,
    "index_kpool": 2,
}
SUFFIXES = (  # (the end of a name, its tiny value), for names not in EXACT
    ("key_value_heads", KV_HEADS),
    ("kv_heads", KV_HEADS),
    ("_heads", HEADS),
    ("head_dim", HEAD_DIM),
    ("intermediate_size", FFN),
    ("ffn_dim", FFN),
)
SET_WHEN_NONE = {
    "head_dim",
    "num_key_value_heads",
    "vocab_size",
    "sliding_window",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "top_k_experts",
}
TOKEN_IDS = ("token_id", "token_ids", "token_index")  # (the ends of the names of token ids)
LAYER_NAMES = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
POSITION_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions")
# Families whose default config fails its own validation: what it takes to build one.
BROKEN_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}
# Multimodal rotary sections of the tiny head (they sum to half of it); a text-only config
# leaves them to its model's code, which assumes a full-size head.
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
MROPE = {"rope_parameters": {**ROPE, "mrope_section": [2, 1, 1]}}
# Per-family settings the generic rule cannot derive: {model_type: {attribute: value}}; a
# sub-config's are given under its own model type (a dict value updates a sub-config).
OVERRIDES: dict[str, dict[str, Any]] = {
    **dict.fromkeys(
        (
            "glm4v_text",
            "glm4v_moe_text",
            "glm_image_text",
            "glm_ocr_text",
            "qwen2_vl_text",
            "qwen2_5_vl_text",
            "hunyuan_vl_text",
            "paddleocr_vl_text",
            "qwen2_5_omni_text",
        ),
        MROPE,
    ),
    "ernie4_5_vl_moe_text": {"rope_parameters": {**ROPE, "mrope_section": [1, 1, 2]}},
    "glm4v_moe_text": {"rope_parameters": {**ROPE, "mrope_section": [0, 1, 1]}},
    "hy_v4_vl_text": {"rope_parameters": {"mrope_section": [0, 1, 1]}},
    # hybrids: one attention layer beside one state-space or convolution layer
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "zamba": {  # (its shared attention needs two hybrid layers to share)
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16},
    "mamba2": {"head_dim": 16},
    # defaults that build no model, or name layers the tiny model lacks
    "chameleon": {"vocabulary_map": {"<image>": VOCAB - 1}},
    "dbrx": {"attn_config": {"rope_theta": ROPE["rope_theta"], "clip_qkv": 8.0}},
    "dory": {
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "esm": {"pad_token_id": 1},
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},  # (t5gemma2 sets it on its own)
    "sam3_lite_text_text_model": {"num_hidden_layers": 3},  # (first and last layers: no attention)
    "layoutlmv3": {"coordinate_size": 6, "shape_size": 4},  # (4 × 6 + 2 × 4 = the width)
    "lilt": {"hidden_size": 48},  # (its layout embeddings take a sixth of the width each)
    "dots3_note_audio_encoder": {"num_key_value_heads": HEADS},
    "qwen2_5_omni_thinker": {"vision_start_token_id": VOCAB - 8},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": VOCAB - 8},
    "bridgetower_vision_model": {"hidden_size": 64},  # (width / 64 heads)
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    "granite4_vision": {
        "deepstack_layer_map": [[1, 0]],
        "spatial_target_layers": [1],
        "downsample_rate": "1/2",
        "vision_config": {"hidden_size": 64},  # (its Q-Former has width / 64 heads)
    },
    "molmo2_adapter": {"vision_feature_layer": [-1, -2]},
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": WINDOW,
        "indexer_compress_ratio": 2,
    },
    "cohere_compass_text": {
        "rope_parameters": {kind: ROPE for kind in ("sliding_attention", "full_attention")}
    },
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_unified_text": {"num_kv_shared_layers": 0},
    "neomme": {"head_dim": 2 * HEAD_DIM},  # (a quarter of it rotates: a multiple of 4)
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "xmod": {"default_language": "en_XX"},
    "zaya": {"num_experts_per_tok": 1},
    # audio and speech parts whose sizes must match each other
    "wavtokenizer_encoder": {"codebook_dim": WIDTH},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": WIDTH // 4}},
    "gradium_phonon_tts": {"flow_head_config": {"condition_dim": WIDTH}},
    "pocket_tts": {"flow_head_config": {"condition_dim": WIDTH}},
    "nemotron3_diarization": {"head_config": {"audio_hidden_size": WIDTH}},
    "mimi": {"upsample_groups": WIDTH},
}


def _rule(name: str) -> int | None:
    """The tiny value for attribute ``name`` (None: the name has no rule)."""
    if name in EXACT:
        return EXACT[name]
    return next((value for suffix, value in SUFFIXES if name.endswith(suffix)), None)


def _shrunk_value(name: str, value: Any, config: dict[str, Any], kv_heads: int) -> Any:
    """The tiny value of one scalar attribute of ``config`` (``value`` itself when the rule has
    none), with ``kv_heads`` key/value heads."""
    if name == "attn_logit_softcapping" and isinstance(value, float):
        return 2.0  # (a cap of 50 never bites on tiny random scores)
    if isinstance(value, bool) or not isinstance(value, int | type(None)):
        return value
    if value is None:
        if name not in SET_WHEN_NONE or (
            name == "head_dim" and "num_attention_heads" not in config
        ):
            return None
        return kv_heads if name == "num_key_value_heads" else _rule(name)
    if value == 0:
        return 0  # (0 switches a part off: it stays off)
    if name.endswith(("key_value_heads", "kv_heads")) or name == "multi_query_group_num":
        return 1 if value == 1 else kv_heads  # (multi-query stays multi-query)
    if name.endswith("vocab_size"):
        return min(value, VOCAB)
    if name in POSITION_NAMES:
        return min(value, POSITIONS) if value > 0 else value
    rule = _rule(name)
    return value if rule is None else rule


def _latent_heads(tiny: dict[str, Any], config: dict[str, Any]) -> None:
    """Multi-head latent attention (DeepSeek): the rotary part of a head keeps the head's
    ``head_dim`` where the family had them equal; a query-key head is both parts."""
    if not isinstance(config.get("qk_rope_head_dim"), int):
        return
    if config.get("head_dim") == config["qk_rope_head_dim"]:
        tiny["head_dim"] = tiny["qk_rope_head_dim"]
    if "qk_head_dim" in tiny and isinstance(tiny.get("qk_nope_head_dim"), int):
        tiny["qk_head_dim"] = tiny["qk_nope_head_dim"] + tiny["qk_rope_head_dim"]


def _layer_lists(config: dict[str, Any], layers: int | None) -> tuple[dict[str, Any], int]:
    """The per-layer settings of ``config`` (lists as long as its ``layers``, and the
    ``per_layer_config`` dict by layer index) for the layers kept: the first layer of each
    distinct combination of settings, in order (at least ``LAYERS``, at most ``MAX_LAYERS``).
    Returns them and the new number of layers."""
    if not layers or layers < 2:
        return {}, LAYERS
    lists = {
        name: value
        for name, value in config.items()
        if isinstance(value, list)
        and len(value) == layers
        and all(isinstance(item, str | int | float) for item in value)
    }
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, dict):  # (keys "05" or "5")
        by_index = {int(key): entry for key, entry in per_layer.items() if str(key).isdigit()}
        lists["per_layer_config"] = [by_index.get(i) for i in range(layers)]
    kinds = [repr([value[i] for value in lists.values()]) for i in range(layers)]
    firsts = [kinds.index(kind) for kind in dict.fromkeys(kinds)][:MAX_LAYERS]
    picked = sorted(firsts + [i for i in range(LAYERS) if i not in firsts][: LAYERS - len(firsts)])
    reduced: dict[str, Any] = {name: [value[i] for i in picked] for name, value in lists.items()}
    if "per_layer_config" in reduced:
        entries = enumerate(reduced["per_layer_config"])
        reduced["per_layer_config"] = {str(n): e for n, e in entries if e is not None} or None
    return reduced, len(picked)


def _with_both_layer_kinds(config: dict[str, Any]) -> None:
    """A model with a sliding window whose layers are all full gets a sliding first layer; one
    whose layers all slide gets a full last layer."""
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) < 2 or "sliding_window" not in config:
        return
    if set(types) == {"sliding_attention"}:
        config["layer_types"] = [*types[:-1], "full_attention"]
    if set(types) == {"full_attention"}:
        config["layer_types"] = ["sliding_attention", *types[1:]]
        if "use_sliding_window" in config:
            config["use_sliding_window"] = True
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            rope.setdefault("sliding_attention", rope["full_attention"])


def shrink(config: dict[str, Any], tokens: dict[int, int], kv_heads: int) -> dict[str, Any]:
    """A tiny copy of ``config`` (a config's ``to_dict()``), sub-configs included, with
    ``kv_heads`` key/value heads. ``tokens`` maps special token ids outside the vocabulary to the
    ids they get (filled in here)."""
    layers = next((config[n] for n in LAYER_NAMES if isinstance(config.get(n), int)), None)
    per_layer, new_layers = _layer_lists(config, layers)
    tiny: dict[str, Any] = {}
    for name, value in config.items():
        if isinstance(value, dict) and "model_type" in value:
            tiny[name] = shrink(value, tokens, kv_heads)
        elif name in per_layer:
            tiny[name] = per_layer[name]
            if name == "per_layer_config" and tiny[name]:
                tiny[name] = {
                    layer: {
                        key: _shrunk_value(key, item, entry, kv_heads)
                        for key, item in entry.items()
                    }
                    for layer, entry in tiny[name].items()
                }
        elif name == "rope_parameters" and isinstance(value, dict):
            tiny[name] = _rope(value)
        elif name in LAYER_NAMES and isinstance(value, int) and value > 0:
            tiny[name] = new_layers if value == layers else min(value, new_layers)
        elif not (name == "architectures" and value is None):
            tiny[name] = _shrunk_value(name, value, config, kv_heads)
    _latent_heads(tiny, config)
    _with_both_layer_kinds(tiny)
    for name, value in copy.deepcopy(OVERRIDES.get(str(config.get("model_type")), {})).items():
        if isinstance(value, dict) and isinstance(tiny.get(name), dict):
            value = {**tiny[name], **value}
        tiny[name] = value
    for name, value in tiny.items():
        if str(name).endswith(TOKEN_IDS):
            tiny[name] = _token_ids(value, tokens)
    return tiny


def _rope(parameters: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters for the tiny head dimension: multimodal sections sum to half of it."""
    tiny = {
        key: _rope(value) if isinstance(value, dict) else value for key, value in parameters.items()
    }
    sections = tiny.get("mrope_section")
    if isinstance(sections, list) and sections:
        half = HEAD_DIM // 2
        tiny["mrope_section"] = [half - len(sections) + 1] + [1] * (len(sections) - 1)
    return tiny


def _token_ids(value: Any, tokens: dict[int, int]) -> Any:
    """A special token id (or a list of them) moved inside the vocabulary: ids past it take the
    top ids, one each, the same in every sub-config."""
    if isinstance(value, list):
        return [_token_ids(item, tokens) for item in value]
    if isinstance(value, bool) or not isinstance(value, int) or value < VOCAB:
        return value
    return tokens.setdefault(value, VOCAB - 1 - len(tokens))


def tiny_config(model_type: str, grouped: bool = True) -> tuple[Any, set[int]]:
    """(the family's tiny config, the token ids it reserves: never drawn as input text).

    ``grouped``: KV_HEADS key/value heads for the HEADS query heads; False: as many as query
    heads, for families that allow no grouped-query attention (multi-head latent attention)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    tokens: dict[int, int] = {}
    default = config_class(**BROKEN_DEFAULTS.get(model_type, {}))
    settings = default.to_dict()
    tiny = shrink(settings, tokens, KV_HEADS if grouped else HEADS)
    config = config_class(**_changes(tiny, settings))
    return config, _reserved_ids(config.to_dict())


def _changes(tiny: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``tiny`` that differ from ``default``, its config class's defaults: what
    the config class gets, so that the values it derives from them (a head size from the width,
    a layer pattern from the count) follow. A sub-config is given the same way, against its own
    class's defaults (where that class has any)."""
    from transformers import CONFIG_MAPPING

    changes: dict[str, Any] = {}
    for name, value in tiny.items():
        if isinstance(value, dict) and value.get("model_type") in CONFIG_MAPPING:
            try:
                own = CONFIG_MAPPING[value["model_type"]]().to_dict()
            except Exception:  # (a sub-config class without usable defaults: all of it)
                changes[name] = value
            else:
                changes[name] = {**_changes(value, own), "model_type": value["model_type"]}
        elif value != default.get(name):
            changes[name] = value
    return changes


def _reserved_ids(config: dict[str, Any]) -> set[int]:
    """Every token id a config names (special tokens, image tokens, ...), sub-configs too."""
    found: set[int] = set()
    for name, value in config.items():
        if isinstance(value, dict):
            found |= _reserved_ids(value)
        elif str(name).endswith(TOKEN_IDS):
            items = value if isinstance(value, list) else [value]
            found |= {i for i in items if isinstance(i, int) and not isinstance(i, bool)}
    return found
