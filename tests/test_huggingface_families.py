"""attn_implementation="qkv" against "eager" across transformers' model families.

Tiny random float32 models, the same weights twice: padded batches with output_attentions=True,
the fast path without weights, and greedy ``generate``, equal within 1e-5 on the real tokens.
Families with sinks (gpt_oss, granite_swa, granitemoe_swa), soft-capping (gemma2, vaultgemma,
t5gemma) and sliding windows (mistral, qwen2, gemma2, gemma3, gpt_oss, granite*, vaultgemma)
pass them to qkv as arguments; models whose attention bypasses transformers' interface are
refused with an error naming them.
Legend: B batch, H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import qkv
from qkv.integrations import huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)

ATOL = 1e-5
VOCAB = 96
NAME = huggingface.register()
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    **SMALL,
)
TWO_KINDS = ["sliding_attention", "full_attention"]
ENCODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    **SMALL,
)
SEQ2SEQ = dict(decoder_start_token_id=0, **SMALL)
T5GEMMA_PART = dict(  # each of T5Gemma's encoder and decoder: soft-capped, with sliding layers
    DECODER,
    head_dim=8,
    attn_logit_softcapping=50.0,
    query_pre_attn_scalar=8,
    sliding_window=4,
    layer_types=TWO_KINDS,
)


def families() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """name: (model class, config class, config arguments)."""
    return {
        "llama": ("LlamaForCausalLM", "LlamaConfig", DECODER),
        "mistral": ("MistralForCausalLM", "MistralConfig", {**DECODER, "sliding_window": 4}),
        "qwen2": (
            "Qwen2ForCausalLM",
            "Qwen2Config",
            {**DECODER, "use_sliding_window": True, "sliding_window": 4, "layer_types": TWO_KINDS},
        ),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {**DECODER, "head_dim": 8}),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", {**DECODER, "head_dim": 8}),
        "gemma2": (
            "Gemma2ForCausalLM",
            "Gemma2Config",
            {
                **DECODER,
                "head_dim": 8,
                "attn_logit_softcapping": 50.0,
                "sliding_window": 4,
                "query_pre_attn_scalar": 8,
            },
        ),
        "gemma3": (
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            {**DECODER, "head_dim": 8, "sliding_window": 4, "layer_types": TWO_KINDS},
        ),
        "gpt_oss": (
            "GptOssForCausalLM",
            "GptOssConfig",
            {
                **DECODER,
                "head_dim": 8,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "sliding_window": 4,
                "layer_types": TWO_KINDS,
            },
        ),
        "granite_swa": (
            "GraniteSWAForCausalLM",
            "GraniteSWAConfig",
            {**DECODER, "sliding_window": 4, "layer_types": TWO_KINDS},
        ),
        "vaultgemma": (
            "VaultGemmaForCausalLM",
            "VaultGemmaConfig",
            {
                **DECODER,
                "head_dim": 8,
                "attn_logit_softcapping": 50.0,
                "query_pre_attn_scalar": 8,
                "sliding_window": 4,
                "layer_types": TWO_KINDS,
            },
        ),
        "granitemoe_swa": (
            "GraniteMoeSWAForCausalLM",
            "GraniteMoeSWAConfig",
            {
                **DECODER,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "sliding_window": 4,
                "layer_types": TWO_KINDS,
            },
        ),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", DECODER),
        "gpt2": (
            "GPT2LMHeadModel",
            "GPT2Config",
            dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, **SMALL),
        ),
        "codegen": (
            "CodeGenForCausalLM",
            "CodeGenConfig",
            dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, **SMALL),
        ),
        "gptj": (
            "GPTJForCausalLM",
            "GPTJConfig",
            dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, **SMALL),
        ),
        "bert": ("BertModel", "BertConfig", ENCODER),
        "roberta": ("RobertaModel", "RobertaConfig", {**ENCODER, "max_position_embeddings": 80}),
        "modernbert": (
            "ModernBertModel",
            "ModernBertConfig",
            {**ENCODER, "local_attention": 4, "global_attn_every_n_layers": 2},
        ),
        "t5": (
            "T5ForConditionalGeneration",
            "T5Config",
            dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, **SEQ2SEQ),
        ),
        "t5gemma": (
            "T5GemmaForConditionalGeneration",
            "T5GemmaConfig",
            dict(encoder=T5GEMMA_PART, decoder=T5GEMMA_PART, **SEQ2SEQ),
        ),
        "bart": (
            "BartForConditionalGeneration",
            "BartConfig",
            dict(
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                forced_eos_token_id=None,
                **SEQ2SEQ,
            ),
        ),
    }


ENCODERS = ("bert", "roberta", "modernbert")
SEQ2SEQ_MODELS = ("t5", "t5gemma", "bart")


def model_pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager, qkv): one random model with the same weights twice; sinks made non-zero."""
    model_name, config_name, arguments = families()[name]
    model_class, config_class = (
        getattr(transformers, model_name),
        getattr(transformers, config_name),
    )
    config = config_class(**arguments)
    torch.manual_seed(0)
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    for param_name, param in eager.named_parameters():
        if param_name.endswith("sinks"):  # initialised to 0: make them matter
            torch.nn.init.normal_(param, std=1.0)
    ours = model_class._from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == NAME
    return eager, ours


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) token ids and a 0/1 mask: left padding (1 or 3 tokens) in two of three rows."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (3, 9), generator=generator)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, :3] = 0
    attention_mask[2, :1] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def run(model: torch.nn.Module, name: str, weights: bool) -> Any:
    input_ids, attention_mask = padded_batch()
    extra: dict[str, Any] = {}
    if name in SEQ2SEQ_MODELS:
        extra["decoder_input_ids"] = input_ids[:, :5].roll(1, dims=0)
    with torch.no_grad():
        return model(
            input_ids=input_ids, attention_mask=attention_mask, output_attentions=weights, **extra
        )


def compare_attentions(
    got: Any, expected: Any, real_queries: torch.Tensor | None, without_sinks: bool = False
) -> None:
    """Weights equal on the rows of real query tokens (``real_queries`` (B, Lq), None: all).

    ``without_sinks``: the family's eager code returns the softmax over the keys alone (granite_swa
    scales its output by the sink afterwards), where qkv's weights, like gpt_oss's, give the sink
    its share: qkv's rows are compared after dividing by their sum."""
    assert got is not None and len(got) == len(expected) > 0
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape
        if without_sinks:
            assert (ours.sum(-1) < 1).all()
            ours = ours / ours.sum(-1, keepdim=True)
        rows = torch.ones(ours.shape[0], ours.shape[2], dtype=torch.bool)
        if real_queries is not None and real_queries.shape[1] == ours.shape[2]:
            rows = real_queries
        torch.testing.assert_close(
            ours.transpose(1, 2)[rows], theirs.transpose(1, 2)[rows], atol=ATOL, rtol=ATOL
        )


@pytest.mark.parametrize("name", list(families()))
def test_family_matches_eager_on_a_padded_batch(name: str) -> None:
    eager, ours = model_pair(name)
    _, attention_mask = padded_batch()
    real = attention_mask.bool()
    expected, got, fast = run(eager, name, True), run(ours, name, True), run(ours, name, False)
    if name in SEQ2SEQ_MODELS:
        key, positions = "logits", torch.ones(3, 5, dtype=torch.bool)
        # (encoder rows of padding queries may attend no key under a local window: not compared)
        compare_attentions(got.encoder_attentions, expected.encoder_attentions, real)
        for part in ("decoder_attentions", "cross_attentions"):
            compare_attentions(getattr(got, part), getattr(expected, part), None)
    else:
        # Real tokens only: a padding query whose local window holds only padding (modernbert)
        # may attend no key; qkv gives it 0 where eager spreads its weight over blocked keys.
        key, positions = ("last_hidden_state" if name in ENCODERS else "logits"), real
        sinks_apart = name in ("granite_swa", "granitemoe_swa")
        compare_attentions(got.attentions, expected.attentions, real, sinks_apart)
    for result in (got, fast):
        torch.testing.assert_close(
            result[key][positions], expected[key][positions], atol=ATOL, rtol=ATOL
        )


@pytest.mark.parametrize(
    "name", [n for n in families() if n not in ENCODERS and n not in ("codegen", "gptj")]
)
def test_family_generates_like_eager(name: str) -> None:
    eager, ours = model_pair(name)
    input_ids, attention_mask = padded_batch()
    kwargs = dict(
        attention_mask=attention_mask,
        max_new_tokens=5,
        do_sample=False,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert_generates_like(eager, ours, input_ids, **kwargs)


@pytest.mark.parametrize("name", list(families()))
def test_family_matches_eager_without_padding(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No padding: decoders build no (Lq, Lk) mask at all, also in sliding-window layers whose
    window the keys reach past; the layer's causal rule and window apply in qkv."""
    eager, ours = model_pair(name)
    input_ids, _ = padded_batch()
    extra: dict[str, Any] = {}
    if name in SEQ2SEQ_MODELS:
        extra["decoder_input_ids"] = input_ids[:, :5]
    calls = spy(monkeypatch)
    with torch.no_grad():
        expected = eager(input_ids=input_ids, **extra)
        got = ours(input_ids=input_ids, **extra)
    key = "last_hidden_state" if name in ENCODERS else "logits"
    torch.testing.assert_close(got[key], expected[key], atol=ATOL, rtol=ATOL)
    if name not in ENCODERS and name not in SEQ2SEQ_MODELS:
        assert all(call["mask"] is None and call["causal"] for call in calls)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss", "gpt2"])
def test_generation_with_either_cache_matches_eager(name: str, cache: str, padded: bool) -> None:
    """A static cache's keys are its whole capacity, so a prefill's queries are not the last of
    them: its masks are never skipped. Unpadded decoding into a dynamic cache builds no mask,
    and sliding layers (window 4, 7 new tokens) get theirs from qkv's window."""
    eager, ours = model_pair(name)
    input_ids, attention_mask = padded_batch()
    if not padded:
        attention_mask = torch.ones_like(attention_mask)
    kwargs = dict(
        attention_mask=attention_mask,
        max_new_tokens=7,
        do_sample=False,
        cache_implementation=cache,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert_generates_like(eager, ours, input_ids, **kwargs)


def assert_generates_like(eager: Any, ours: Any, input_ids: torch.Tensor, **kwargs: Any) -> Any:
    """Greedy ``generate`` on both models (kwargs ask for logits): the same tokens, and each
    step's logits within ATOL. Returns both outputs (ours, eager's) for further checks."""
    expected = eager.generate(input_ids, **kwargs)
    got = ours.generate(input_ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step_got, step_expected in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step_got, step_expected, atol=ATOL, rtol=ATOL)
    return got, expected


def spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every qkv.attention call the integration makes."""
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return qkv.attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "attention", recording)
    return calls


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gemma2", {"softcap": 50.0, "window": (3, 0)}),
        ("gpt_oss", {"sinks": True, "window": (3, 0)}),
        ("granite_swa", {"sinks": True, "window": (3, 0)}),
        ("mistral", {"window": (3, 0)}),
    ],
)
def test_softcap_sinks_and_windows_reach_qkv_as_arguments(
    name: str, expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ours = model_pair(name)
    calls = spy(monkeypatch)
    run(ours, name, False)
    assert calls
    for argument, value in expected.items():
        passed = [call.get(argument) for call in calls]
        if value is True:  # a tensor: one sink per query head
            assert all(isinstance(x, torch.Tensor) and x.shape == (4,) for x in passed)
        elif argument == "window":  # sliding layers only
            assert value in passed
        else:
            assert all(x == value for x in passed)


def test_packed_sequences_follow_the_mask_not_flash_attentions_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FlashAttention's ``cu_seq_lens`` do not change what eager computes: the mask does.
    Without a cache, transformers reads the restarting positions as documents (each equals
    its run alone, passed as segments); with one it reads one sequence, as eager does."""
    eager, ours = model_pair("llama")
    lengths = [4, 3, 5]
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, VOCAB, (1, n), generator=generator) for n in lengths]
    cu_seqlens = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    flash = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=5, max_length_k=5)
    run = dict(input_ids=torch.cat(sequences, dim=1), position_ids=position_ids, **flash)
    calls = spy(monkeypatch)
    with torch.no_grad():
        packed = ours(**run, use_cache=False).logits
        alone = torch.cat([ours(input_ids=s).logits for s in sequences], dim=1)
        one_sequence, expected = ours(**run).logits, eager(**run).logits
    torch.testing.assert_close(packed, alone, atol=ATOL, rtol=ATOL)
    assert calls[0]["segments"].tolist() == [[0] * 4 + [1] * 3 + [2] * 5]
    torch.testing.assert_close(one_sequence, expected, atol=ATOL, rtol=ATOL)
    assert not torch.allclose(one_sequence, alone, atol=1e-3)


BYPASSING = ["bloom", "mpt", "codegen", "falcon", "gptj", "gpt_neo"]


def bypassing_config(name: str) -> tuple[type, Any]:
    configs = {
        "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4)),
        "mpt": ("MptForCausalLM", "MptConfig", dict(d_model=32, n_layers=2, n_heads=4)),
        "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(n_embd=32, n_layer=2, n_head=4)),
        "falcon": (
            "FalconForCausalLM",
            "FalconConfig",
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
        ),
        "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4)),
        "gpt_neo": (
            "GPTNeoForCausalLM",
            "GPTNeoConfig",
            dict(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]),
        ),
    }
    model_name, config_name, arguments = configs[name]
    if name in ("codegen", "gptj"):
        arguments = {**arguments, "rotary_dim": 4, "n_positions": 64}
    config = getattr(transformers, config_name)(**arguments, **SMALL)
    return getattr(transformers, model_name), config


@pytest.mark.parametrize("name", BYPASSING)
def test_models_outside_the_interface_never_run_silently_wrong(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused with an error naming the model and the alternative; a family that has moved to
    transformers' interface (codegen and gptj since transformers 5.24) must then really run
    on qkv and match eager."""
    model_class, config = bypassing_config(name)
    torch.manual_seed(0)
    try:
        ours = model_class._from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    except ValueError as error:
        message = str(error)
        assert model_class.__name__ in message and f'"{config.model_type}"' in message
        assert 'attn_implementation="eager"' in message
        return
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    calls = spy(monkeypatch)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        got = ours(input_ids=input_ids, attention_mask=attention_mask).logits
        expected = eager(input_ids=input_ids, attention_mask=attention_mask).logits
    assert len(calls) == config.num_hidden_layers  # every layer ran on qkv
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=ATOL)


def test_a_bypassing_model_keeps_its_own_attention_when_asked_later() -> None:
    model_class, config = bypassing_config("falcon")
    model = model_class._from_config(config, attn_implementation="eager")
    model.set_attn_implementation(NAME)  # transformers declines (with a warning)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("name", "on_eager", "on_qkv"),
    [
        ("got_ocr2", ["vision_config"], ["text_config"]),
        ("granite_speech", ["encoder_config"], ["text_config", "projector_config"]),
        ("deepseek_vl_hybrid", ["high_res_vision_config"], ["text_config", "vision_config"]),
    ],
)
def test_parts_outside_the_interface_run_on_eager_and_the_rest_on_qkv(
    name: str, on_eager: list[str], on_qkv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A composite model whose encoder computes attention in its own code (or looks its
    attention class up by implementation name) is not refused: one warning names the parts
    that run on eager, and its language model runs on qkv, equal to eager."""
    from hf_tiny import tiny_config

    config, _ = tiny_config(name)
    model_class = transformers.AutoModelForCausalLM
    if type(config) not in model_class._model_mapping:
        model_class = transformers.AutoModelForImageTextToText
    if type(config) not in model_class._model_mapping:
        model_class = transformers.AutoModelForSpeechSeq2Seq
    torch.manual_seed(0)
    eager = model_class.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    with pytest.warns(UserWarning, match='run on "eager"') as caught:
        ours = model_class.from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    message = str(caught[0].message)
    assert all(key in message for key in on_eager + on_qkv)
    for key in on_eager:
        assert getattr(ours.config, key)._attn_implementation == "eager"
    for key in on_qkv:
        assert getattr(ours.config, key)._attn_implementation == NAME
    ours.load_state_dict(eager.state_dict())
    calls = spy(monkeypatch)
    input_ids, attention_mask = padded_batch()
    input_ids = input_ids.clamp(max=config.get_text_config().vocab_size - 1)
    with torch.no_grad():
        got = ours(input_ids=input_ids, attention_mask=attention_mask).logits
        expected = eager(input_ids=input_ids, attention_mask=attention_mask).logits
    assert calls  # the language model ran on qkv
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=ATOL)
