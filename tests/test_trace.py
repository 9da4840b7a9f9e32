"""qkv.trace(): every attention call recorded, with names, layers, inputs, scores, mask, weights.

The float64 oracle is the textbook formula written out here: scores = q kᵀ · scale, blocked
positions -inf, softmax over keys (a fully masked row gives zeros), output = weights · v.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qkv
from qkv.observers import current
from qkv.trace import AttentionRecord, Trace


def oracle(q, k, v, keep, scale):
    """(weights, out) in float64: softmax(q kᵀ · scale, blocked = -inf) v; empty rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scores = q @ k.transpose(-2, -1) * scale
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool) if keep is None else keep
    scores = scores.masked_fill(~keep, -math.inf)
    has_key = keep.any(-1, keepdim=True)  # a query with no key it may attend: all zeros
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    return weights, weights @ v


def two_layers(**kwargs) -> nn.Sequential:
    return nn.Sequential(
        qkv.SelfAttention(16, 4, bias=True, **kwargs), qkv.SelfAttention(16, 4, **kwargs)
    )


def test_records_every_call_with_module_names_and_layers() -> None:
    model = two_layers()
    x = torch.randn(2, 5, 16)
    with qkv.trace(model) as t:
        model(x)
    assert isinstance(t, Trace) and len(t) == 2
    assert [r.name for r in t] == ["0", "1"]
    assert [r.layer for r in t] == [0, 1] and t.layers == [0, 1]
    assert all(r.module == "SelfAttention" for r in t)
    first = t.layer(0)
    assert first.shape == (2, 4, 5, 5) and first.heads == 4
    assert first.q.shape == first.k.shape == first.v.shape == (2, 4, 5, 4)
    assert first.weights.shape == (2, 4, 5, 5) and first.out.shape == (2, 4, 5, 4)
    torch.testing.assert_close(first.x, x)  # the input of the module that made the call
    assert first.scale == pytest.approx(1 / math.sqrt(4))


def test_recorded_numbers_match_the_float64_oracle() -> None:
    model = two_layers(causal=True)
    x = torch.randn(1, 6, 16)
    with qkv.trace(model) as t:
        model(x)
    for record in t:
        keep = qkv.causal_mask(6, 6)
        torch.testing.assert_close(record.mask, keep)
        weights, out = oracle(record.q, record.k, record.v, keep, record.scale)
        torch.testing.assert_close(record.weights.double(), weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(record.out.double(), out, atol=1e-6, rtol=1e-5)
        scores = record.q.double() @ record.k.double().transpose(-2, -1) * record.scale
        torch.testing.assert_close(record.scores.double(), scores, atol=1e-5, rtol=1e-5)
        assert bool((record.weights[..., ~keep] == 0).all())  # blocked keys get exactly 0


def test_the_layer_input_and_projection_give_the_recorded_q() -> None:
    model = two_layers()
    x = torch.randn(1, 4, 16)
    with qkv.trace(model) as t:
        model(x)
    layer = model[0]
    q = layer.qkv_proj(t[0].x)[..., :16].view(1, 4, 4, 4).transpose(1, 2)  # (B, H, L, D)
    torch.testing.assert_close(t[0].q, q)


def test_tracing_does_not_change_the_output() -> None:
    model = two_layers()
    x = torch.randn(2, 7, 16)
    plain = model(x)
    with qkv.trace(model):
        traced = model(x)
    torch.testing.assert_close(traced, plain, atol=1e-6, rtol=1e-5)


def test_keep_weights_only_and_layer_selection() -> None:
    model = two_layers()
    x = torch.randn(1, 5, 16)
    with qkv.trace(model, layers=[1], keep="weights") as t:
        model(x)
    assert len(t) == 1 and t[0].layer == 1
    record = t[0]
    assert record.weights is not None
    assert record.q is None and record.k is None and record.v is None and record.out is None
    with pytest.raises(ValueError, match="keep='all'"):
        _ = record.scores
    with qkv.trace(model, layers=["0"]) as by_name:
        model(x)
    assert [r.name for r in by_name] == ["0"]


def test_calls_outside_modules_and_without_model() -> None:
    q, k, v = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4)
    with qkv.trace() as t:
        out = qkv.attention(q, k, v, causal=True)
    (record,) = t.records
    assert record.name == "" and record.layer is None and record.module == ""
    assert record.shape == (1, 3, 5)  # the canonical call: a head dim was added
    torch.testing.assert_close(record.out[0], out)
    torch.testing.assert_close(record.mask, qkv.causal_mask(3, 5))
    layer = qkv.SelfAttention(8, 2)
    with qkv.trace() as unnamed:  # no model given: the outermost module names the calls
        layer(torch.randn(3, 8))
    assert unnamed[0].name == "SelfAttention" and unnamed[0].layer == 0


def test_weights_are_recorded_even_when_a_fused_backend_is_forced() -> None:
    layer = qkv.SelfAttention(16, 2, backend="sdpa")
    x = torch.randn(1, 6, 16)
    with qkv.trace(layer) as t:
        layer(x)
    record = t[0]
    weights, out = oracle(record.q, record.k, record.v, None, record.scale)
    torch.testing.assert_close(record.weights.double(), weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(record.out.double(), out, atol=1e-6, rtol=1e-5)


def test_grouped_query_heads_are_recorded_per_query_head() -> None:
    layer = qkv.SelfAttention(16, 4, kv_heads=1)
    with qkv.trace(layer) as t:
        layer(torch.randn(1, 5, 16))
    record = t[0]
    assert record.groups == 4 and record.k.shape == (1, 1, 5, 4)
    assert record.scores.shape == record.weights.shape == (1, 4, 5, 5)
    weights, _ = oracle(record.q, record.k, record.v, None, record.scale)
    torch.testing.assert_close(record.weights.double(), weights, atol=1e-6, rtol=1e-5)


def test_padding_and_float_masks_are_the_mask_applied() -> None:
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    bias = torch.tensor([0.0, 0.5, -math.inf])
    with qkv.trace() as t:
        qkv.attention(q, k, v, mask=bias)
    record = t[0]
    assert record.mask.reshape(-1).tolist() == [True, True, False]
    expected = q.double() @ k.double().transpose(-2, -1) / 2 + bias.double()
    torch.testing.assert_close(record.scores.double(), expected, atol=1e-6, rtol=1e-6)


def test_trace_ends_cleanly_and_nests() -> None:
    hooks = nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    layer = qkv.SelfAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with qkv.trace(layer) as outer:
        layer(x)
        with qkv.trace(layer) as inner:
            layer(x)
        layer(x)
    layer(x)  # after the trace: not recorded
    assert len(outer) == 2 and len(inner) == 1
    assert len(hooks) == before
    assert current() is None
    with outer, pytest.raises(RuntimeError, match="already active"):
        outer.__enter__()
    layer(x)
    with outer:  # a finished trace can record again; it appends
        layer(x)
    assert len(outer) == 3 and current() is None


def test_a_failing_forward_does_not_leave_the_trace_behind() -> None:
    layer = qkv.SelfAttention(8, 2)
    with pytest.raises(ValueError, match="d_model"), qkv.trace(layer) as t:
        layer(torch.randn(1, 3, 5))
    assert current() is None and len(t) == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="keep"):
        qkv.trace(keep="scores")
    with pytest.raises(TypeError, match="layers"):
        qkv.trace(layers=[1.5])
    with pytest.raises(TypeError, match="model"):
        qkv.trace("model")
    with qkv.trace() as t:
        pass
    with pytest.raises(ValueError, match="layer"):
        t.layer(3)


def test_repr_and_html() -> None:
    layer = qkv.SelfAttention(8, 2)
    with qkv.trace(layer) as t:
        layer(torch.randn(1, 3, 8))
    assert "1 attention calls" in repr(t) and "weights=(1, 2, 3, 3)" in repr(t[0])
    # Pictures are viz's concern: a trace shows itself through qkv.viz.view(t), never itself.
    assert not hasattr(t, "_repr_html_")
    assert isinstance(t[0], AttentionRecord)


@given(
    lq=st.integers(0, 5),
    lk=st.integers(0, 5),
    heads=st.sampled_from([1, 2]),
    causal=st.sampled_from([False, True, "top-left"]),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_recorded_weights_are_the_softmax_of_the_recorded_scores(
    lq: int, lk: int, heads: int, causal: bool | str, masked: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, lq, 3, generator=generator, dtype=torch.float64)
    k = torch.randn(1, heads, lk, 3, generator=generator, dtype=torch.float64)
    v = torch.randn(1, heads, lk, 2, generator=generator, dtype=torch.float64)
    mask = torch.rand(lq, lk, generator=generator) > 0.3 if masked else None
    with qkv.trace() as t:
        out = qkv.attention(q, k, v, mask=mask, causal=causal)
    record = t[0]
    keep = record.mask
    weights, expected = oracle(q, k, v, keep, record.scale)
    torch.testing.assert_close(record.weights, weights)
    torch.testing.assert_close(out, expected)
    if keep is not None:
        assert bool((record.weights.masked_select(~keep.expand(record.shape)) == 0).all())


def test_hugging_face_models_on_qkv_are_traced() -> None:
    transformers = pytest.importorskip("transformers")
    from qkv.integrations.huggingface import register

    register("qkv")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation("qkv")
    ids = torch.tensor([[2, 7, 9, 11, 3, 0]])
    padding = torch.tensor([[1, 1, 1, 1, 1, 0]])
    with torch.no_grad(), qkv.trace(model) as t:
        out = model(input_ids=ids, attention_mask=padding, output_attentions=True)
    assert [r.name for r in t] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    assert [r.layer for r in t] == [0, 1]
    for record, weights in zip(t, out.attentions):
        torch.testing.assert_close(record.weights, weights)
        assert bool((record.weights[..., 5] == 0).all())  # the padded key is masked
        assert record.mask is not None and not bool(record.mask[..., 5].any())
