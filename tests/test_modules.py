"""``qkv.SelfAttention`` against a float64 computation written from its weights, ``qkv.KVCache``,
and the layer's algebraic properties: causality, padding invariance, grouped-query = repeated
heads, cached decoding = one full pass.

Legend: B batch, H heads, Hkv key/value heads, L query length, S key length, E d_model,
C d_context, D head_dim.
"""

from __future__ import annotations

import itertools
import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, oracle, require

import qkv
from qkv.backends.flash import kernel

f64 = torch.float64


def layer(*args, **kwargs) -> qkv.SelfAttention:
    """A float64 layer with random (not default-initialised) weights, biases included."""
    module = qkv.SelfAttention(*args, dtype=f64, **kwargs)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.5)
    return module


def by_hand(
    module: qkv.SelfAttention,
    x: torch.Tensor,
    context: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    causal=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, weights) of the layer, computed in float64 from its weights: Q = x W_qᵀ, K and V from
    the context (or x), attention per head by the oracle, heads concatenated, out projection."""
    h, hkv, d = module.heads, module.kv_heads, module.head_dim
    unbatched = x.dim() == 2
    if unbatched:
        x = x[None]
        context = None if context is None else context[None]
        padding_mask = None if padding_mask is None else padding_mask[None]
    if module.qkv_proj is not None:  # rows of the fused weight: [W_q; W_k; W_v]
        w, b = module.qkv_proj.weight, module.qkv_proj.bias
        w_q, w_k, w_v = w[: h * d], w[h * d : (h + hkv) * d], w[(h + hkv) * d :]
        b_q, b_k, b_v = (
            (None, None, None)
            if b is None
            else (b[: h * d], b[h * d : (h + hkv) * d], b[(h + hkv) * d :])
        )
    else:
        w_q, b_q = module.q_proj.weight, module.q_proj.bias
        w_k, w_v = module.kv_proj.weight[: hkv * d], module.kv_proj.weight[hkv * d :]
        b = module.kv_proj.bias
        b_k, b_v = (None, None) if b is None else (b[: hkv * d], b[hkv * d :])

    def project(inputs, weight, bias, heads):  # (B, L, ·) -> (B, heads, L, D)
        y = inputs.double() @ weight.double().T + (0 if bias is None else bias.double())
        return y.view(y.shape[0], y.shape[1], heads, d).transpose(1, 2)

    source = x if context is None else context
    q, k, v = (
        project(x, w_q, b_q, h),
        project(source, w_k, b_k, hkv),
        project(source, w_v, b_v, hkv),
    )
    if padding_mask is not None:
        keep = padding_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        if mask is None or mask.dtype == torch.bool:
            mask = keep if mask is None else mask & keep
        else:
            mask = mask.double().masked_fill(~keep, -math.inf)
    causal = module.causal if causal is None else causal
    heads_out, weights = oracle(q, k, v, mask=mask, causal=causal)  # (B, H, L, D)
    joined = heads_out.transpose(1, 2).reshape(x.shape[0], x.shape[1], h * d)
    w_o, b_o = module.out_proj.weight.double(), module.out_proj.bias
    out = joined @ w_o.T + (0 if b_o is None else b_o.double())
    if unbatched:
        out, weights = out[0], weights[0]
    return out, weights


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=f64)


# --- the layer against its hand computation ------------------------------------------------------

CONFIGS = {
    "single head": ((8,), {}),
    "multi-head": ((12, 3), {}),
    "grouped-query": ((16, 4), {"kv_heads": 2}),
    "multi-query": ((16, 4), {"kv_heads": 1}),
    "head_dim != d_model / heads": ((10, 2), {"head_dim": 7}),
    "biases": ((8, 2), {"bias": True}),
    "out_bias only": ((8, 2), {"out_bias": True}),
    "bias, no out_bias": ((8, 2), {"bias": True, "out_bias": False}),
    "causal": ((8, 2), {"causal": True}),
    "cross-attention, d_context": ((8, 2), {"d_context": 5, "bias": True}),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_layer_matches_hand_computation(backend, config):
    require(backend)
    args, kwargs = CONFIGS[config]
    module = layer(*args, backend=backend, **kwargs)
    x = randn(2, 5, module.d_model)
    context = randn(2, 7, module.d_context) if module.qkv_proj is None else None
    expected, _ = by_hand(module, x, context)
    assert_close(module(x, context), expected, f64)


@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_cross_attention_with_context(backend, causal):
    require(backend)
    module = layer(8, 2, kv_heads=1, bias=True, backend=backend)  # d_context = d_model: fused
    x, context = randn(2, 4, 8), randn(2, 6, 8)
    assert_close(
        module(x, context, causal=causal), by_hand(module, x, context, causal=causal)[0], f64
    )
    # cross-attention really reads the context, not x
    assert not torch.allclose(module(x, context), module(x))


def test_projection_layout():
    fused = qkv.SelfAttention(16, 4, kv_heads=2)
    assert fused.qkv_proj.weight.shape == ((4 + 2 + 2) * 4, 16)  # one fused Q, K, V projection
    assert fused.q_proj is None and fused.kv_proj is None
    cross = qkv.SelfAttention(16, 4, head_dim=3, d_context=6)
    assert cross.qkv_proj is None
    assert cross.q_proj.weight.shape == (12, 16) and cross.kv_proj.weight.shape == (24, 6)
    assert cross.out_proj.weight.shape == (16, 12)
    assert fused.qkv_proj.bias is None and fused.out_proj.bias is None
    with_bias = qkv.SelfAttention(8, bias=True, out_bias=False)
    assert with_bias.qkv_proj.bias is not None and with_bias.out_proj.bias is None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_and_padding_mask(kind):
    module = layer(8, 2, causal=True)
    x = randn(3, 6, 8)
    keep = torch.rand(3, 2, 6, 6) < 0.7
    mask = keep if kind == "bool" else randn(3, 2, 6, 6).masked_fill(~keep, -math.inf)
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    got = module(x, mask=mask, padding_mask=padding)
    assert_close(got, by_hand(module, x, mask=mask, padding_mask=padding)[0], f64)
    assert not torch.allclose(got, module(x, mask=mask))  # the padding mask is used
    bool_padding = module(x, mask=mask, padding_mask=padding.bool())
    torch.testing.assert_close(bool_padding, got, atol=0, rtol=0)


def test_causal_argument_overrides_the_constructor():
    causal, plain = layer(8, 2, causal=True), layer(8, 2)
    plain.load_state_dict(causal.state_dict())
    x = randn(2, 5, 8)
    torch.testing.assert_close(causal(x, causal=False), plain(x))
    torch.testing.assert_close(plain(x, causal=True), causal(x))
    assert_close(causal(x, causal="top-left"), by_hand(causal, x, causal="top-left")[0], f64)
    assert not torch.allclose(causal(x), plain(x))


def test_return_weights_shapes_and_values():
    module = layer(12, 3, kv_heads=1, causal=True)
    x = randn(2, 5, 12)
    out, weights = module(x, return_weights=True)
    assert out.shape == (2, 5, 12) and weights.shape == (2, 3, 5, 5)  # (B, heads, L, S)
    expected_out, expected_weights = by_hand(module, x)
    assert_close(out, expected_out, f64)
    assert_close(weights, expected_weights, f64)
    cross = layer(12, 3, d_context=4)
    out, weights = cross(x, randn(2, 7, 4), return_weights=True)
    assert weights.shape == (2, 3, 5, 7)


def test_unbatched_input():
    module = layer(8, 2, d_context=3)
    x, context, padding = randn(5, 8), randn(4, 3), torch.tensor([1, 1, 0, 1])
    out, weights = module(x, context, padding_mask=padding, return_weights=True)
    assert out.shape == (5, 8) and weights.shape == (2, 5, 4)
    batched, batched_weights = module(
        x[None], context[None], padding_mask=padding[None], return_weights=True
    )
    torch.testing.assert_close(out, batched[0])
    torch.testing.assert_close(weights, batched_weights[0])
    assert_close(out, by_hand(module, x, context, padding_mask=padding)[0], f64)


def test_dropout_only_in_training():
    module = layer(8, 2, dropout=0.5)
    x = randn(2, 6, 8)
    without = layer(8, 2)
    without.load_state_dict(module.state_dict())
    module.eval()
    torch.testing.assert_close(module(x), without(x), atol=0, rtol=0)  # eval: no dropout
    torch.testing.assert_close(module(x), module(x), atol=0, rtol=0)  # and deterministic
    module.train()
    first, second = module(x), module(x)
    assert not torch.allclose(first, without(x)) and not torch.allclose(first, second)
    # Training without dropout changes nothing.
    without.train()
    torch.testing.assert_close(without(x), module.eval()(x), atol=0, rtol=0)


def test_dropout_in_training_preserves_the_mean():
    module = layer(4, 1, dropout=0.3).train()
    x = randn(1, 3, 4).expand(3000, 3, 4)
    expected = module.eval()(x[:1])
    mean = module.train()(x).mean(0, keepdim=True)
    torch.testing.assert_close(mean, expected, atol=0.05, rtol=0.05)


def test_low_precision_layer():
    module = layer(16, 4, kv_heads=2, causal=True)
    x = randn(2, 9, 16)
    expected, _ = by_hand(module, x.to(torch.bfloat16).double())
    low = module.to(torch.bfloat16)
    got = low(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    # bfloat16 weights and projections: a few units in the last place of bfloat16
    torch.testing.assert_close(got.double(), expected, atol=0.1, rtol=0.05)


# --- KVCache ----------------------------------------------------------------------------------


def test_cache_append_len_reset():
    cache = qkv.KVCache()
    assert len(cache) == 0
    k1, v1 = randn(2, 3, 4, 5), randn(2, 3, 4, 6)
    keys, values = cache.append(k1, v1)
    assert len(cache) == 4 and torch.equal(keys, k1) and torch.equal(values, v1)
    k2, v2 = randn(2, 3, 1, 5), randn(2, 3, 1, 6)
    keys, values = cache.append(k2, v2)
    assert len(cache) == 5
    assert torch.equal(keys, torch.cat([k1, k2], -2)) and torch.equal(
        values, torch.cat([v1, v2], -2)
    )
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    cache.reset()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="empty"):
        cache.keys  # noqa: B018
    keys, _ = cache.append(k2, v2)  # usable again, with a new shape
    assert torch.equal(keys, k2) and len(cache) == 1


def test_cache_growth_keeps_contents_and_reuses_storage():
    cache = qkv.KVCache()
    steps = [randn(1, 2, n, 3) for n in [1] * 40 + [7, 30, 1, 1, 100]]
    storages = []
    with torch.no_grad():
        for step in steps:
            keys, _ = cache.append(step, 2 * step)
            storages.append(keys.untyped_storage().data_ptr())
    everything = torch.cat(steps, dim=-2)
    assert len(cache) == everything.shape[-2]
    assert torch.equal(cache.keys, everything) and torch.equal(cache.values, 2 * everything)
    # Storage is reused while it has room: 45 appends, O(log n) reallocations, not one per step.
    reallocations = sum(a != b for a, b in itertools.pairwise(storages))
    assert reallocations <= math.ceil(math.log2(everything.shape[-2]))
    assert storages[1] == storages[0]  # the second token goes into the first one's storage


def test_cache_keeps_gradients_flowing():
    k = randn(1, 1, 3, 2).requires_grad_()
    cache = qkv.KVCache()
    cache.append(k[..., :2, :], k[..., :2, :])
    keys, _ = cache.append(k[..., 2:, :], k[..., 2:, :])
    keys.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))


# --- decoding steps on flash's kernel ---------------------------------------------------------
# A plain decoding step (float32/bfloat16 on the CPU, no mask, nothing to differentiate) runs as
# one kernel call, flash's kernel.decode_step, which writes the cache and attends. It must give
# what the unfused path gives (the cache written first, then the kernel's attention), bit for bit.


@pytest.fixture
def kernel_on() -> None:
    if os.environ.get("QKV_FLASH_KERNEL") == "0":
        pytest.skip("QKV_FLASH_KERNEL=0 switches the compiled kernel off")
    assert kernel.load() is not None, "flash's compiled CPU kernel did not build"


def decode(
    module: qkv.SelfAttention, x: torch.Tensor, sizes: list[int], **kwargs: object
) -> tuple[torch.Tensor, qkv.KVCache, int]:
    """x fed to the layer in chunks of ``sizes`` through one cache: the outputs, the cache and
    how many calls took the kernel's decoding step."""
    cache, outputs, end = qkv.KVCache(), [], 0
    with mock.patch.object(kernel, "decode_step", wraps=kernel.decode_step) as step:
        for size in sizes:
            outputs.append(module(x[:, end : end + size], cache=cache, **kwargs))
            end += size
    return torch.cat(outputs, dim=1), cache, step.call_count


def general_path(module: qkv.SelfAttention, x: torch.Tensor, sizes: list[int], **kwargs: object):
    """``decode`` with the kernel's fused decoding step off: each step writes the cache, then
    attends (on the same kernel, which reads the cache's buffers where they lie)."""
    with mock.patch.object(kernel, "decode_step_takes", return_value=False):
        outputs, cache, steps = decode(module, x, sizes, **kwargs)
    assert steps == 0
    return outputs, cache


@settings(max_examples=25, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([1, 5, 16, 24, 40, 64, 72]),
    bias=st.booleans(),
    causal=st.sampled_from([False, True, "top-left"]),
    batch=st.integers(1, 3),
    length=st.integers(1, 40),
    data=st.data(),
)
def test_decoding_steps_on_the_kernel_equal_the_general_path(
    kernel_on, kv_heads, group, head_dim, bias, causal, batch, length, data
):
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    heads = kv_heads * group
    module = layer(8, heads, kv_heads=kv_heads, head_dim=head_dim, bias=bias, causal=causal)
    module = module.float().eval()
    x = torch.randn(batch, length, 8)
    sizes = []  # chunks of fewer than 16 positions, as decoding (and a short prompt) gives
    while sum(sizes) < length:
        sizes.append(data.draw(st.integers(1, min(15, length - sum(sizes)))))
    with torch.no_grad():
        outputs, cache, steps = decode(module, x, sizes)
        expected, expected_cache = general_path(module, x, sizes)
        in_float64, _, _ = decode(module.double(), x.double(), sizes)  # the general path
    assert steps == len(sizes)  # every call, the first (which fills the empty cache) included
    assert torch.equal(outputs, expected)
    assert torch.equal(cache.keys, expected_cache.keys)
    assert torch.equal(cache.values, expected_cache.values)
    assert len(cache) == length
    torch.testing.assert_close(outputs.double(), in_float64, atol=2e-5, rtol=2e-5)


def test_decoding_steps_on_the_kernel_in_bfloat16(kernel_on):
    module = layer(16, 4, kv_heads=2, bias=True, causal=True).to(torch.bfloat16).eval()
    x = torch.randn(2, 20, 16, dtype=torch.bfloat16)
    sizes = [3] + [1] * 10 + [5, 2]
    with torch.no_grad():
        outputs, cache, steps = decode(module, x, sizes)
        expected, expected_cache = general_path(module, x, sizes)
    assert steps == len(sizes) and outputs.dtype == torch.bfloat16
    assert torch.equal(outputs, expected)
    assert torch.equal(cache.keys, expected_cache.keys)


@pytest.mark.parametrize(
    "why",
    ["gradients", "dropout", "backend", "kernel off", "float64", "chunk of 16"],
)
def test_decoding_steps_leave_the_kernel_when_they_must(kernel_on, why, monkeypatch):
    module = qkv.SelfAttention(8, 2, causal=True, dropout=0.5 if why == "dropout" else 0.0)
    module.train(why == "dropout")
    if why == "backend":
        module.backend = "sdpa"
    if why == "kernel off":
        monkeypatch.setattr(kernel, "ENABLED", False)
    if why == "float64":
        module = module.double()
    x = torch.randn(1, 20, 8, dtype=module.out_proj.weight.dtype)
    sizes = [2, 16, 2] if why == "chunk of 16" else [2, 1, 1]
    with torch.set_grad_enabled(why == "gradients"):
        outputs, _, steps = decode(module, x, sizes)
    taken = {"chunk of 16": 2}.get(why, 0)  # the chunks of 2 still take it
    assert steps == taken
    assert outputs.requires_grad == (why == "gradients")


def test_a_trace_observes_decoding_steps_without_moving_them_off_the_kernel(kernel_on):
    module = qkv.SelfAttention(8, 2, causal=True).eval()
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        untraced, _, _ = decode(module, x, [3, 1, 1, 1])
        with qkv.trace() as recorded:
            traced, _, steps = decode(module, x, [3, 1, 1, 1])
    assert steps == 4 and len(recorded) == 4
    assert torch.equal(traced, untraced)
    last = recorded[-1]  # weights the trace computed itself, from the step's own q and k
    assert last.weights.shape == (1, 2, 1, 6)
    torch.testing.assert_close(last.weights @ last.v, last.out, atol=1e-6, rtol=1e-5)


def test_a_decoding_step_under_autocast_meets_the_cache_check(kernel_on):
    # Autocast projects a float32 x to bfloat16: a float32 cache refuses those keys with the
    # cache's own error, as on the general path, not with an error from inside the kernel.
    module = qkv.SelfAttention(8, 2, causal=True).eval()
    cache = qkv.KVCache()
    with torch.no_grad():
        module(torch.randn(1, 3, 8), cache=cache)
        with torch.autocast("cpu"), pytest.raises(TypeError, match="cache's dtype"):
            module(torch.randn(1, 1, 8), cache=cache)
    assert len(cache) == 3


# --- properties -----------------------------------------------------------------------------------


@st.composite
def layers(draw: st.DrawFn, **fixed) -> qkv.SelfAttention:
    """A small float64 layer: any head layout, head size and biases."""
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    options = {
        "kv_heads": kv_heads,
        "head_dim": draw(st.integers(1, 4)),
        "bias": draw(st.booleans()),
        "causal": draw(st.sampled_from([False, True])),
        **fixed,
    }
    torch.manual_seed(draw(st.integers(0, 2**16)))
    return layer(draw(st.sampled_from([3, 4, 8])), heads, **options)


@settings(max_examples=40)
@given(module=layers(causal=True), length=st.integers(2, 12), data=st.data())
def test_causality(module, length, data):
    # Changing token t (and everything after it) never changes the outputs before t.
    t = data.draw(st.integers(1, length - 1))
    x = randn(2, length, module.d_model)
    changed = x.clone()
    changed[:, t:] = randn(2, length - t, module.d_model)
    before, after = module(x), module(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(after[:, t:], before[:, t:])


@settings(max_examples=40)
@given(
    module=layers(),
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    causal=st.sampled_from([False, True, "top-left"]),
)
def test_padding_invariance(module, lengths, causal):
    # A padded batch gives each sequence the outputs it gets alone, whatever the padding holds.
    # (top-left causal aligns queries and keys from the left: right padding keeps it intact.)
    longest = max(lengths)
    x = randn(len(lengths), longest, module.d_model)  # the padding positions hold noise
    padding = torch.tensor([[j < n for j in range(longest)] for n in lengths])
    batched = module(x, padding_mask=padding, causal=causal)
    for b, n in enumerate(lengths):
        alone = module(x[b : b + 1, :n], causal=causal)
        torch.testing.assert_close(batched[b : b + 1, :n], alone, atol=1e-12, rtol=1e-12)


@settings(max_examples=40)
@given(module=layers(causal=False), length=st.integers(1, 8))
def test_grouped_query_is_repeated_heads(module, length):
    # A kv_heads layer equals a full-heads layer whose K and V weights are repeated per group.
    h, hkv, d = module.heads, module.kv_heads, module.head_dim
    full = layer(module.d_model, h, head_dim=d, bias=module.qkv_proj.bias is not None)

    def repeated(rows: torch.Tensor) -> torch.Tensor:  # (Hkv * D, ·) -> (H * D, ·)
        return rows.unflatten(0, (hkv, d)).repeat_interleave(h // hkv, dim=0).flatten(0, 1)

    with torch.no_grad():
        for name in ("weight", "bias"):
            fused = getattr(module.qkv_proj, name)
            if fused is None:
                continue
            q, k, v = fused.split([h * d, hkv * d, hkv * d])
            getattr(full.qkv_proj, name).copy_(torch.cat([q, repeated(k), repeated(v)]))
        full.out_proj.load_state_dict(module.out_proj.state_dict())
    x = randn(2, length, module.d_model)
    torch.testing.assert_close(full(x), module(x), atol=1e-12, rtol=1e-12)


def chunks_of(draw: st.DrawFn, total: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(draw(st.integers(1, total - sum(sizes))))
    return sizes


@settings(max_examples=30)
@given(
    module=layers(causal=True),
    length=st.integers(1, 10),
    padded=st.booleans(),
    token_by_token=st.booleans(),
    backend=st.sampled_from(["auto", "reference", "flash"]),
    data=st.data(),
)
def test_cached_decoding_equals_one_full_pass(
    module, length, padded, token_by_token, backend, data
):
    require(backend)
    module.backend = backend
    x = randn(2, length, module.d_model)
    padding = None
    if padded:  # left padding, as a batch of prompts of different lengths is decoded
        first_real = data.draw(st.integers(0, length - 1))
        padding = torch.ones(2, length, dtype=torch.bool)
        padding[1, :first_real] = False
    full = module(x, padding_mask=padding)
    sizes = [1] * length if token_by_token else chunks_of(data.draw, length)
    cache, outputs, end = qkv.KVCache(), [], 0
    with torch.no_grad():
        for size in sizes:
            step_padding = None if padding is None else padding[:, : end + size]
            outputs.append(module(x[:, end : end + size], padding_mask=step_padding, cache=cache))
            end += size
    assert len(cache) == length
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, atol=1e-12, rtol=1e-12)


@settings(max_examples=10)
@given(module=layers(d_context=5), length=st.integers(1, 6), data=st.data())
def test_cached_cross_attention_equals_one_full_pass(module, length, data):
    x, context = randn(2, length, module.d_model), randn(2, 4, 5)
    full = module(x, context, causal=False)
    cache, outputs, end = qkv.KVCache(), [], 0
    for size in chunks_of(data.draw, length):
        outputs.append(module(x[:, end : end + size], context, causal=False, cache=cache))
        end += size
    assert len(cache) == 4  # the context is projected and cached once
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, atol=1e-12, rtol=1e-12)


def test_cached_decoding_gradients_equal_full_pass():
    module = layer(8, 2, kv_heads=1, causal=True)
    x = randn(1, 5, 8)
    full = module(x)
    grads_full = torch.autograd.grad(full.sum(), list(module.parameters()))
    cache = qkv.KVCache()
    steps = [module(x[:, i : i + 1], cache=cache) for i in range(5)]
    grads_cached = torch.autograd.grad(torch.cat(steps, 1).sum(), list(module.parameters()))
    for cached, whole in zip(grads_cached, grads_full):
        torch.testing.assert_close(cached, whole)


def test_rejected_call_leaves_the_cache_unchanged():
    layer = qkv.SelfAttention(8, 2, causal=True)
    cache = qkv.KVCache()
    x = torch.randn(1, 3, 8)
    layer(x, cache=cache)
    keys_before = cache.keys.clone()
    with pytest.raises(ValueError, match="padding_mask"):
        layer(x[:, :1], cache=cache, padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        layer(x[:, :1], cache=cache, mask=torch.ones(1, 2, 1, 3, dtype=torch.bool))
    assert len(cache) == 3
    assert torch.equal(cache.keys, keys_before)
    # the right sizes count the cached keys: (B, S) = (1, 4) after this step's key is added
    layer(x[:, :1], cache=cache, padding_mask=torch.ones(1, 4, dtype=torch.bool))
    assert len(cache) == 4
