"""attn_implementation="qkv" against transformers' "eager" on small random GPT-2, BERT and Llama.

The same weights give the same logits and attention weights (1e-5) with left-padded batches, and
greedy generation with a KV cache gives the same tokens. The one difference is a fix: a padding
query that may attend no key (left padding under a causal mask) gets 0 weights where eager
spreads its weight uniformly over blocked keys; such rows are checked to be 0.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import qkv
from qkv.integrations import huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)

from test_huggingface_families import assert_generates_like  # noqa: E402  (after the skip)

ATOL = 1e-5
VOCAB = 96
NAME = huggingface.register()


def configs() -> dict[str, tuple[type, object]]:
    small = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "gpt2": (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **small),
        ),
        "bert": (
            transformers.BertModel,
            transformers.BertConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
                **small,
            ),
        ),
        "llama": (  # grouped-query attention (4 query heads, 2 key/value heads) and RoPE
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                max_position_embeddings=64,
                **small,
            ),
        ),
    }


def model_pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager, qkv): one randomly initialised model with the same weights twice."""
    model_class, config = configs()[name]
    torch.manual_seed(0)
    eager = model_class(copy.deepcopy(config)).eval()
    ours = model_class(copy.deepcopy(config)).eval()
    ours.load_state_dict(eager.state_dict())
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation(NAME)
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == NAME
    return eager, ours


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (3, 7), generator=generator)
    attention_mask = torch.ones(3, 7, dtype=torch.long)
    attention_mask[1, :3] = 0
    attention_mask[2, :1] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def attended_rows(name: str, attention_mask: torch.Tensor, lq: int) -> torch.Tensor:
    """(B, 1, Lq, 1) True where a query has at least one key it may attend."""
    real = attention_mask.bool()[:, None, :]  # (B, 1, S)
    keys = torch.arange(real.shape[-1])
    queries = torch.arange(real.shape[-1] - lq, real.shape[-1])
    allowed = real.expand(-1, lq, -1)
    if name != "bert":
        allowed = allowed & (keys[None, :] <= queries[:, None])
    return allowed.any(-1)[:, None, :, None]


def assert_attentions_match(name: str, ours, theirs, attention_mask: torch.Tensor) -> None:
    assert ours is not None and len(ours) == len(theirs) > 0
    for got, expected in zip(ours, theirs):
        assert got.shape == expected.shape
        rows = attended_rows(name, attention_mask, got.shape[-2]).expand_as(got)
        torch.testing.assert_close(got[rows], expected[rows], atol=ATOL, rtol=ATOL)
        assert (got[~rows] == 0).all()


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_same_logits_and_attention_weights_as_eager(name: str) -> None:
    eager, ours = model_pair(name)
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = eager(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        got = ours(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        fast = ours(input_ids=input_ids, attention_mask=attention_mask)
    key = "last_hidden_state" if name == "bert" else "logits"
    # Real tokens everywhere; for BERT every position (no query row is empty without causality).
    positions = torch.ones_like(attention_mask, dtype=torch.bool)
    if name != "bert":
        positions = attention_mask.bool()
    torch.testing.assert_close(got[key][positions], expected[key][positions], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(fast[key][positions], expected[key][positions], atol=ATOL, rtol=ATOL)
    assert_attentions_match(name, got.attentions, expected.attentions, attention_mask)
    assert fast.attentions is None
    # The padding mask really matters here: without it the outputs differ.
    with torch.no_grad():
        unmasked = ours(input_ids=input_ids)
    assert not torch.allclose(unmasked[key][positions], expected[key][positions], atol=1e-3)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generation_with_cache_matches_eager(name: str) -> None:
    eager, ours = model_pair(name)
    input_ids, attention_mask = left_padded_batch()
    kwargs = dict(
        attention_mask=attention_mask,
        max_new_tokens=6,
        do_sample=False,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        output_attentions=True,
    )
    got, expected = assert_generates_like(eager, ours, input_ids, **kwargs)
    # Attention weights of every decoding step: one new query over the growing cache.
    mask = attention_mask
    for step, (step_got, step_expected) in enumerate(zip(got.attentions, expected.attentions)):
        if step > 0:
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
        assert_attentions_match(name, step_got, step_expected, mask)
    assert got.attentions[1][0].shape[-2:] == (1, input_ids.shape[1] + 1)


def test_weights_computed_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []

    def spy(*args, **kwargs):
        asked.append(kwargs["return_weights"])
        return qkv.attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "attention", spy)
    _, ours = model_pair("gpt2")
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        ours(input_ids=input_ids, attention_mask=attention_mask)
        assert asked == [False, False]
        ours(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        assert asked[2:] == [True, True]
        # generate asks for weights at every step only when told to
        ours.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False)
    assert asked[4:] == [False] * 4


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


@pytest.mark.parametrize("is_causal", [True, False])
def test_no_mask_applies_the_layers_causal_rule_bottom_right(is_causal: bool) -> None:
    """A cache: 2 new queries over 5 keys; they are the last 2 positions."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 8, generator=generator)
    k, v = torch.randn(2, 2, 5, 8, generator=generator), torch.randn(2, 2, 5, 8)
    out, weights = huggingface.attention_forward(
        _Layer(is_causal), q, k, v, None, scaling=0.5, output_attentions=True
    )
    keep = qkv.causal_mask(2, 5) if is_causal else torch.ones(2, 5, dtype=torch.bool)
    expected, expected_weights = qkv.attention(q, k, v, mask=keep, scale=0.5, return_weights=True)
    torch.testing.assert_close(out, expected.transpose(1, 2))
    torch.testing.assert_close(weights, expected_weights)
    if is_causal:
        assert (weights[..., 0, 4] == 0).all() and (weights[..., 1, 4] > 0).all()
    # The model's is_causal argument overrides the layer's attribute.
    overridden, _ = huggingface.attention_forward(
        _Layer(not is_causal), q, k, v, None, scaling=0.5, is_causal=is_causal
    )
    torch.testing.assert_close(overridden, out)


def test_position_bias_joins_the_mask() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=generator) for _ in range(3))
    bias = torch.randn(1, 2, 3, 3, generator=generator)  # (1, H, Lq, Lk)
    keep = torch.tensor([[True, True, False], [True, False, True]])[
        :, None, None, :
    ]  # (B, 1, 1, Lk)
    q, k, v = (x.expand(2, -1, -1, -1) for x in (q, k, v))
    out, _ = huggingface.attention_forward(_Layer(False), q, k, v, keep, position_bias=bias)
    additive = torch.where(keep, bias, float("-inf"))
    expected = qkv.attention(q, k, v, mask=additive).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_register_returns_the_name_and_refuses_transformers_own() -> None:
    assert huggingface.register("qkv") == "qkv"
    assert huggingface.register("qkv-custom") == "qkv-custom"
    with pytest.raises(ValueError, match="sdpa"):
        huggingface.register("sdpa")
    with pytest.raises(TypeError, match="name"):
        huggingface.register("")


def test_softcap_and_sinks_are_arguments() -> None:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=generator) for _ in range(3))
    sinks = torch.randn(2, generator=generator)
    out, _ = huggingface.attention_forward(_Layer(True), q, k, v, None, softcap=0.5, s_aux=sinks)
    expected = qkv.attention(q, k, v, causal=True, softcap=0.5, sinks=sinks)
    torch.testing.assert_close(out, expected.transpose(1, 2))
    assert not torch.allclose(out, qkv.attention(q, k, v, causal=True).transpose(1, 2))
    uncapped, _ = huggingface.attention_forward(_Layer(True), q, k, v, None, softcap=0.0)
    torch.testing.assert_close(uncapped, qkv.attention(q, k, v, causal=True).transpose(1, 2))


def test_sinks_per_query_row_join_each_rows_softmax() -> None:
    """A sink logit per (batch, head, query) (inkling2's per-token sink projection, shape
    (B, Hq, Lq, 1)) against the softmax over the scores and the sink, dropping the sink."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, 2, 4, 1, generator=generator, dtype=torch.float64)
    out, weights = huggingface.attention_forward(
        _Layer(True), q, k, v, None, sinks=sinks, output_attentions=True
    )
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    scores = scores.masked_fill(~qkv.causal_mask(4, 4), float("-inf"))
    expected_weights = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(out, (expected_weights @ v).transpose(1, 2))
    assert (weights.sum(-1) < 1).all()  # (the sinks took a share)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError, match=r'pip install "qkv\[hf\]"'):
        huggingface.register()
