"""The plain decoding lane (``dispatch.plain_decoding``, ``plain_decoding_step``): ``qkv.attention``
and ``qkv.attention_with_cache`` (a ``KVCache``) send a decoding call with nothing but causal and
scale straight to flash's decoding kernel. It must be the call the whole path (checks, a
``Call``, ``choose``, flash) would make: the same backend, the same bits, the same cache; and
every call it is not sure of must take the whole path.
Legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D features.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import TOLERANCE, oracle

import qkv
from qkv.backends import dispatch, flash
from qkv.backends.flash import kernel
from qkv.canonical import canonical_call
from qkv.masks import CAUSAL_VALUES


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if kernel.load() is None:
        pytest.skip("flash's compiled kernel is not available")


def _whole_path(q: Any, k: Any, v: Any, causal: Any, scale: Any, backend: str) -> torch.Tensor:
    """What ``qkv.attention`` returns without the lane, and a check that "auto" gives the call
    to flash's compiled kernel, as the lane claims."""
    call, _ = canonical_call(
        q, k, v, mask=None, causal=causal, scale=scale, dropout_p=0.0,
        return_weights=False, backend=backend,
    )  # fmt: skip
    assert dispatch.choose(call) == "flash" and flash.runs_compiled(call)
    out, _, _ = dispatch.run(call, backend)
    return out


@given(
    batch=st.sampled_from([(), (2,), (2, 1)]),
    heads=st.sampled_from([(1, 1), (4, 4), (8, 2), (6, 1)]),
    lq=st.integers(1, 15),
    lk=st.integers(1, 130),
    dims=st.sampled_from([(64, 64), (8, 5), (33, 80), (128, 128)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    causal=st.sampled_from(CAUSAL_VALUES),
    scale=st.sampled_from([None, 0.3]),
    backend=st.sampled_from(["auto", "flash"]),
    seed=st.integers(0, 2**16),
)
def test_the_lane_gives_the_whole_paths_bits_and_the_oracles_numbers(
    batch: tuple[int, ...],
    heads: tuple[int, int],
    lq: int,
    lk: int,
    dims: tuple[int, int],
    dtype: torch.dtype,
    causal: Any,
    scale: float | None,
    backend: str,
    seed: int,
) -> None:
    (hq, hkv), (d, dv) = heads, dims
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, hq, lq, d, generator=generator).to(dtype)
    k = torch.randn(*batch, hkv, lk, d, generator=generator).to(dtype)
    v = torch.randn(*batch, hkv, lk, dv, generator=generator).to(dtype)
    lane = dispatch.plain_decoding(q, k, v, causal, scale, backend)
    assert lane is not None
    whole = _whole_path(q, k, v, causal, scale, backend)
    assert lane.dtype == whole.dtype == dtype and lane.shape == whole.shape
    assert torch.equal(lane, whole)  # one kernel function, one call: the same bits
    assert torch.equal(qkv.attention(q, k, v, causal=causal, scale=scale, backend=backend), lane)
    expected, _ = oracle(q, k, v, causal=causal, scale=scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(lane.double(), expected, atol=atol, rtol=rtol)


def test_a_static_caches_valid_prefix_a_view_takes_the_lane() -> None:
    """A static cache hands the kernel a view of its first keys (rows contiguous, heads apart)."""
    q = torch.randn(2, 8, 1, 64)
    k, v = torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    keys, values = k.narrow(-2, 0, 203), v.narrow(-2, 0, 203)
    lane = dispatch.plain_decoding(q, keys, values, True, None, "auto")
    assert lane is not None and not keys.is_contiguous()
    assert torch.equal(
        lane, _whole_path(q, keys.contiguous(), values.contiguous(), True, None, "auto")
    )


class _Tagged(torch.Tensor):
    """A tensor subclass: its operations may mean something else, so it takes the whole path."""


def _decoding(
    dtype: torch.dtype = torch.float32, device: str = "cpu", **change: Any
) -> dict[str, Any]:
    """A plain decoding call's arguments (GQA 8/2, one query of 16 features, 40 keys), with
    ``change``."""

    def tensor(*shape: int) -> torch.Tensor:
        return (
            torch.randn(*shape).to(dtype) if device == "cpu" else torch.empty(*shape, device=device)
        )

    call = dict(
        q=tensor(1, 8, 1, 16), k=tensor(1, 2, 40, 16), v=tensor(1, 2, 40, 16),
        causal=True, scale=None, backend="auto",
    )  # fmt: skip
    return {**call, **change}


REFUSED = {
    "float16": _decoding(torch.float16),
    "float64": _decoding(torch.float64),
    "the meta device": _decoding(device="meta"),
    "16 queries": _decoding(q=torch.randn(1, 8, 16, 16)),
    "a head dim only on q": _decoding(k=torch.randn(40, 16), v=torch.randn(40, 16)),
    "k and v of other heads": _decoding(v=torch.randn(1, 1, 40, 16)),
    "a batch to broadcast": _decoding(q=torch.randn(3, 8, 1, 16)),
    "no keys": _decoding(k=torch.randn(1, 2, 0, 16), v=torch.randn(1, 2, 0, 16)),
    "no features": _decoding(q=torch.randn(1, 8, 1, 0), k=torch.randn(1, 2, 40, 0)),
    "Hq not a multiple of Hkv": _decoding(q=torch.randn(1, 3, 1, 16)),
    "another Dk": _decoding(k=torch.randn(1, 2, 40, 8)),
    "a subclass": _decoding(q=torch.randn(1, 8, 1, 16).as_subclass(_Tagged)),
    "gradients": _decoding(q=torch.randn(1, 8, 1, 16, requires_grad=True)),
    "backend sdpa": _decoding(backend="sdpa"),
    "backend reference": _decoding(backend="reference"),
    "an int scale": _decoding(scale=1),
    "a NaN scale": _decoding(scale=float("nan")),
    "an unknown causal": _decoding(causal="diagonal"),
    "a tensor causal": _decoding(causal=torch.tensor(True)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_calls_the_lane_is_not_sure_of_take_the_whole_path(case: str) -> None:
    assert dispatch.plain_decoding(**REFUSED[case]) is None


def test_without_the_compiled_kernel_nothing_takes_the_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernel, "ENABLED", False)
    assert dispatch.plain_decoding(**_decoding()) is None


def test_bad_decoding_arguments_still_get_the_whole_paths_errors() -> None:
    with pytest.raises(ValueError, match="causal"):
        qkv.attention(**_decoding(causal="diagonal"))
    with pytest.raises(ValueError, match="scale"):
        qkv.attention(**_decoding(scale=float("nan")))
    with pytest.raises(ValueError, match="feature size Dk"):
        qkv.attention(**_decoding(k=torch.randn(1, 2, 40, 8)))


@pytest.mark.parametrize(
    "given",
    [{}, {"scale": 0.5, "causal": "top-left", "backend": "flash"},  # (the lane is asked)
     {"mask": torch.ones(40, dtype=torch.bool)}, {"dropout_p": 0.5}, {"return_weights": True},
     {"return_lse": True}, {"softcap": 5.0}, {"window": 8}, {"sinks": torch.zeros(8)}],
)  # fmt: skip
def test_a_call_with_more_than_causal_and_scale_never_reaches_the_lane(
    given: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[Any, ...]] = []

    def lane(*args: Any) -> None:
        asked.append(args)  # (None: the whole path runs the call)

    monkeypatch.setattr(dispatch, "plain_decoding", lane)
    torch.manual_seed(0)
    result = qkv.attention(**{**_decoding(), **given})  # (dropout: sdpa or the reference)
    out = result[0] if isinstance(result, tuple) else result  # (weights or lse asked for)
    plain = set(given) <= {"scale", "causal", "backend"}
    assert len(asked) == plain and out.shape == (1, 8, 1, 16)


def test_a_traced_decoding_call_is_recorded() -> None:
    call = _decoding()
    with qkv.trace() as recorded:
        out = qkv.attention(**call)
    assert len(recorded.records) == 1
    assert torch.equal(recorded.records[0].out, out)


def _cache(prefix: tuple[torch.Tensor, torch.Tensor]) -> qkv.KVCache:
    cache = qkv.KVCache()
    cache.append(*prefix)
    return cache


@given(
    heads=st.sampled_from([(4, 4), (8, 2), (3, 1)]),
    cached=st.integers(1, 70),
    lq=st.integers(1, 15),
    dims=st.sampled_from([(16, 16), (33, 20)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    causal=st.sampled_from(CAUSAL_VALUES),
    seed=st.integers(0, 2**16),
)
def test_a_kv_cache_step_in_the_lane_writes_and_attends_as_the_whole_path(
    heads: tuple[int, int],
    cached: int,
    lq: int,
    dims: tuple[int, int],
    dtype: torch.dtype,
    causal: Any,
    seed: int,
) -> None:
    (hq, hkv), (d, dv) = heads, dims
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    prefix = (tensor(2, hkv, cached, d), tensor(2, hkv, cached, dv))
    q, k_new, v_new = tensor(2, hq, lq, d), tensor(2, hkv, lq, d), tensor(2, hkv, lq, dv)
    lane_cache, whole_cache = _cache(prefix), _cache(prefix)
    step = lane_cache.prepare(k_new, v_new)
    lane = dispatch.plain_decoding_step(q, step.write, causal, None, "auto")
    assert lane is not None
    lane_cache.commit(step)
    step = whole_cache.prepare(k_new, v_new)
    call, _ = canonical_call(
        q, step.keys, step.values, mask=None, causal=causal, scale=None, dropout_p=0.0,
        return_weights=False, backend="auto",
    )  # fmt: skip
    assert dispatch.preference(call)[0] == "flash" and flash.why_not(call) is None
    assert kernel.decode_step_takes(q, k_new, v_new)  # (flash fuses the write: the lane's call)
    whole, _, _ = dispatch.run(call, "auto", step.write)
    whole_cache.commit(step)
    assert lane.dtype == dtype and torch.equal(lane, whole)
    assert len(lane_cache) == len(whole_cache) == cached + lq
    assert torch.equal(lane_cache.keys, whole_cache.keys)
    assert torch.equal(lane_cache.values, whole_cache.values)
    keys, values = (torch.cat([prefix[0], k_new], -2), torch.cat([prefix[1], v_new], -2))
    expected, _ = oracle(q, keys, values, causal=causal)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(lane.double(), expected, atol=atol, rtol=rtol)


def test_a_kv_cache_step_the_lane_is_not_sure_of_takes_the_whole_path() -> None:
    prefix = (torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16))
    q, k_new, v_new = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    step = _cache(prefix).prepare(k_new, v_new)
    assert dispatch.plain_decoding_step(q[0], step.write, True, None, "auto") is None  # 3 dims
    assert dispatch.plain_decoding_step(q, None, True, None, "auto") is None  # concatenated
    assert dispatch.plain_decoding_step(q.half(), step.write, True, None, "auto") is None
    assert dispatch.plain_decoding_step(q, step.write, True, None, "sdpa") is None
    with torch.enable_grad():  # a step that records gradients concatenates: no write
        grad_step = _cache(prefix).prepare(k_new.requires_grad_(), v_new)
    assert grad_step.write is None


def test_a_rejected_kv_cache_step_leaves_the_cache_as_it_was() -> None:
    cache = _cache((torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)))
    q, k_new, v_new = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="causal"):
        qkv.attention_with_cache(q, k_new, v_new, cache, causal="diagonal")
    assert len(cache) == 10
    out = qkv.attention_with_cache(q, k_new, v_new, cache, causal=True)
    assert len(cache) == 11 and out.shape == (1, 8, 1, 16)


def test_attention_with_cache_takes_the_lane_for_a_plain_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = (torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 24))
    q, k_new, v_new = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 24)
    lane_step, taken = dispatch.plain_decoding_step, []

    def spy(*args: Any) -> torch.Tensor | None:
        out = lane_step(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(dispatch, "plain_decoding_step", spy)
    lane_cache = _cache(prefix)
    lane = qkv.attention_with_cache(q, k_new, v_new, lane_cache, causal=True)
    monkeypatch.setattr(dispatch, "plain_decoding_step", lambda *args: None)
    whole_cache = _cache(prefix)
    whole = qkv.attention_with_cache(q, k_new, v_new, whole_cache, causal=True)
    assert taken == [True]
    assert isinstance(lane, torch.Tensor) and isinstance(whole, torch.Tensor)
    assert torch.equal(lane, whole) and len(lane_cache) == len(whole_cache) == 40
    assert torch.equal(lane_cache.keys, whole_cache.keys)
    assert torch.equal(lane_cache.values, whole_cache.values)
