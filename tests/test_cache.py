"""``qkv.KVCache`` and ``qkv.attention_with_cache``: decoding in steps equals one full pass, on
every backend, with grouped heads, masks and low precision; a rejected step leaves the cache as it
was. Legend: B batch, Hq/Hkv heads, L step length, S cached length, D features."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.backends.flash import kernel

F64 = torch.float64
BACKENDS = ["auto", "reference", "flash", "sdpa"]


def _tensors(batch: int, hq: int, hkv: int, length: int, dk: int, dv: int, dtype: torch.dtype):
    q = torch.randn(batch, hq, length, dk, dtype=dtype)
    k = torch.randn(batch, hkv, length, dk, dtype=dtype)
    v = torch.randn(batch, hkv, length, dv, dtype=dtype)
    return q, k, v


def _in_steps(q, k, v, sizes, cache=None, **options):
    """q, k, v fed to attention_with_cache in chunks of ``sizes`` along the length."""
    cache = qkv.KVCache() if cache is None else cache
    outputs, start = [], 0
    for size in sizes:
        end = start + size
        chunk = (x[..., start:end, :] for x in (q, k, v))
        outputs.append(qkv.attention_with_cache(*chunk, cache, **options))
        start = end
    return torch.cat(outputs, dim=-2), cache


@st.composite
def chunkings(draw: st.DrawFn, length: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < length:
        sizes.append(draw(st.integers(1, length - sum(sizes))))
    return sizes


def _prefix_pass(q, k, v, sizes, **options):
    """What each step must give: its queries against every key up to its end, in one call."""
    outputs, end = [], 0
    for size in sizes:
        end += size
        chunk = q[..., end - size : end, :]
        outputs.append(qkv.attention(chunk, k[..., :end, :], v[..., :end, :], **options))
    return torch.cat(outputs, dim=-2)


@settings(max_examples=30, deadline=None)
@given(
    backend=st.sampled_from(BACKENDS),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    length=st.integers(1, 24),
    causal=st.sampled_from([True, "bottom-right", False]),
    data=st.data(),
)
def test_decoding_in_steps_equals_one_pass(backend, hkv, group, length, causal, data):
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    q, k, v = _tensors(2, hkv * group, hkv, length, 8, 5, F64)
    sizes = data.draw(chunkings(length))
    stepped, cache = _in_steps(q, k, v, sizes, causal=causal, backend=backend)
    expected = _prefix_pass(q, k, v, sizes, causal=causal, backend="reference")
    torch.testing.assert_close(stepped, expected, atol=1e-12, rtol=1e-12)
    if causal:  # bottom-right alignment: the steps together are one full causal pass
        full = qkv.attention(q, k, v, causal=True, backend="reference")
        torch.testing.assert_close(stepped, full, atol=1e-12, rtol=1e-12)
    assert len(cache) == length
    torch.testing.assert_close(cache.keys, k, atol=0, rtol=0)  # stored as given: a copy
    torch.testing.assert_close(cache.values, v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_decoding_matches_float64(dtype, backend):
    torch.manual_seed(0)
    q, k, v = _tensors(1, 4, 2, 21, 16, 16, dtype)
    stepped, _ = _in_steps(q, k, v, [5, 1, 1, 14], causal=True, backend=backend)
    assert stepped.dtype == dtype
    expected = qkv.attention(q.double(), k.double(), v.double(), causal=True)
    eps = torch.finfo(dtype).eps  # inputs rounded to dtype, sums in float32, output rounded
    torch.testing.assert_close(stepped.double(), expected, atol=4 * eps, rtol=4 * eps)


def test_a_mask_covers_the_cached_and_the_new_keys():
    torch.manual_seed(1)
    q, k, v = _tensors(2, 2, 2, 6, 4, 4, F64)
    keep = torch.rand(2, 1, 6, 6) > 0.3  # (B, 1, L, S) for the whole sequence
    cache = qkv.KVCache()
    first = qkv.attention_with_cache(
        q[..., :4, :], k[..., :4, :], v[..., :4, :], cache, mask=keep[..., :4, :4]
    )
    second = qkv.attention_with_cache(
        q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], cache, mask=keep[..., 4:, :]
    )
    expected = torch.cat(
        [
            qkv.attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], mask=keep[..., :4, :4]),
            qkv.attention(q[..., 4:, :], k, v, mask=keep[..., 4:, :], backend="reference"),
        ],
        dim=-2,
    )
    torch.testing.assert_close(torch.cat([first, second], -2), expected, atol=1e-12, rtol=0)


def test_weights_of_a_step_span_every_cached_key():
    q, k, v = _tensors(1, 2, 1, 5, 4, 4, F64)
    cache = qkv.KVCache()
    qkv.attention_with_cache(q[..., :3, :], k[..., :3, :], v[..., :3, :], cache, causal=True)
    out, weights = qkv.attention_with_cache(
        q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], cache, causal=True, return_weights=True
    )
    assert weights.shape == (1, 2, 2, 5)
    expected, expected_weights = qkv.attention(q, k, v, causal=True, return_weights=True)
    torch.testing.assert_close(weights, expected_weights[..., 3:, :], atol=1e-12, rtol=0)
    torch.testing.assert_close(out, expected[..., 3:, :], atol=1e-12, rtol=0)


def test_a_rejected_step_leaves_the_cache_as_it_was():
    q, k, v = _tensors(1, 2, 2, 4, 4, 4, torch.float32)
    cache = qkv.KVCache()
    qkv.attention_with_cache(q[..., :3, :], k[..., :3, :], v[..., :3, :], cache)
    bad_mask = torch.ones(1, 2, 1, 7, dtype=torch.bool)  # 7 keys, the cache will hold 4
    with pytest.raises(ValueError, match="mask"):
        qkv.attention_with_cache(q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], cache, mask=bad_mask)
    assert len(cache) == 3
    with pytest.raises(ValueError, match="causal"):
        qkv.attention_with_cache(
            q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], cache, causal="diagonal"
        )
    assert len(cache) == 3
    torch.testing.assert_close(cache.keys, k[..., :3, :], atol=0, rtol=0)


@pytest.mark.parametrize(
    "cache, error, words",
    [
        ("not a cache", TypeError, ["cache", "qkv.KVCache", "str"]),
        (None, TypeError, ["cache", "NoneType"]),
    ],
)
def test_the_cache_argument_is_checked(cache, error, words):
    q, k, v = _tensors(1, 1, 1, 2, 4, 4, torch.float32)
    with pytest.raises(error) as raised:
        qkv.attention_with_cache(q, k, v, cache)
    assert all(word in str(raised.value) for word in words)


def test_new_keys_that_do_not_match_the_cache_name_the_argument():
    q, k, v = _tensors(1, 2, 2, 2, 4, 4, torch.float32)
    cache = qkv.KVCache()
    qkv.attention_with_cache(q, k, v, cache)
    with pytest.raises(ValueError, match=r"k of shape \(1, 2, 2, 8\) does not match the cache"):
        qkv.attention_with_cache(q, torch.randn(1, 2, 2, 8), v, cache)
    with pytest.raises(TypeError, match="cache's dtype"):
        qkv.attention_with_cache(q.double(), k.double(), v.double(), cache)


def test_prepare_counts_nothing_until_commit():
    cache = qkv.KVCache()
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5)
    step = cache.prepare(k, v)
    assert len(cache) == 0 and step.write is not None
    assert step.keys.shape == (1, 2, 3, 4) and step.values.shape == (1, 2, 3, 5)
    step.write.apply()
    cache.commit(step)
    assert len(cache) == 3
    torch.testing.assert_close(cache.values, v, atol=0, rtol=0)
    keys, _ = cache.append(k[..., :1, :], v[..., :1, :])
    assert keys.shape == (1, 2, 4, 4) and len(cache) == 4


def test_gradients_flow_through_every_cached_step():
    q, k, v = (x.requires_grad_() for x in _tensors(1, 2, 1, 5, 4, 4, F64))
    stepped, _ = _in_steps(q, k, v, [2, 1, 2], causal=True, backend="reference")
    grads = torch.autograd.grad(stepped.sum(), (q, k, v))
    expected = torch.autograd.grad(qkv.attention(q, k, v, causal=True).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.skipif(not kernel.ENABLED, reason="QKV_FLASH_KERNEL=0 switches the kernel off")
def test_a_decoding_step_is_one_kernel_call_that_writes_the_cache(monkeypatch):
    assert kernel.load() is not None, "flash's compiled CPU kernel did not build"
    calls = []
    fused = kernel.decode_step
    monkeypatch.setattr(kernel, "decode_step", lambda *a: calls.append(1) or fused(*a))
    q, k, v = _tensors(1, 4, 2, 6, 8, 8, torch.float32)
    with torch.no_grad():
        stepped, cache = _in_steps(q, k, v, [3, 1, 1, 1], causal=True)
    assert len(calls) == 4 and len(cache) == 6
    expected = qkv.attention(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(stepped.double(), expected, atol=1e-5, rtol=1e-5)
