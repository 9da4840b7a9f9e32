"""``qkv.attention`` against the float64 oracle, rule by rule of the contract, on every backend.

Each test runs once per backend ("reference", "sdpa", "flash", "auto"). A backend may refuse a call
only with ``Unsupported`` and only for a reason it documents (``oracle.may_refuse``); a backend that
is not installed is skipped. Legend: B batch, H heads, Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import TOLERANCE, assert_close, attend, oracle, require
from strategies import DTYPES, attention_cases, broadcast_shapes_of

import qkv
from qkv.backends.base import Unsupported

f64 = torch.float64


def randn(*shape: int, dtype: torch.dtype = f64, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


def check(backend: str, q, k, v, **kwargs) -> torch.Tensor | None:
    """Run ``backend`` and compare its output with the oracle's, then its (out, weights) where it
    returns weights. Returns the output (None if the backend refused the call)."""
    expected_out, expected_weights = oracle(
        q,
        k,
        v,
        mask=kwargs.get("mask"),
        causal=kwargs.get("causal", False),
        scale=kwargs.get("scale"),
    )
    out = attend(backend, q, k, v, **kwargs)
    if out is not None:
        assert out.dtype == q.dtype
        assert_close(out, expected_out, q.dtype)
    got = attend(backend, q, k, v, return_weights=True, **kwargs)
    if got is not None:
        assert got[0].dtype == got[1].dtype == q.dtype
        assert_close(got[0], expected_out, q.dtype)
        assert_close(got[1], expected_weights, q.dtype)
    return out


# --- the oracle itself --------------------------------------------------------------------------


def loop_oracle(q, k, v, allowed, scale):
    """Attention of one head, one query at a time, the way it is written on paper."""
    out = torch.zeros(q.shape[0], v.shape[-1], dtype=f64)
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if allowed[i][j]]
        if not keys:
            continue
        scores = [float(q[i] @ k[j]) * scale for j in keys]
        top = max(scores)
        exps = [math.exp(s - top) for s in scores]
        for j, e in zip(keys, exps):
            out[i] += e / sum(exps) * v[j]
    return out


def test_oracle_matches_softmax_by_hand():
    # "The cat sat": scores 0.5, 2.1, 1.3 give weights of about 0.122, 0.606, 0.272.
    q = torch.tensor([[1.0]], dtype=f64)
    k = torch.tensor([[0.5], [2.1], [1.3]], dtype=f64)
    _, weights = oracle(q, k, torch.eye(3, dtype=f64), scale=1.0)
    exps = [math.exp(s) for s in (0.5, 2.1, 1.3)]
    assert weights[0].tolist() == pytest.approx([e / sum(exps) for e in exps], abs=1e-15)
    assert weights[0].tolist() == pytest.approx([0.122, 0.606, 0.272], abs=1e-3)


def test_oracle_matches_loops_with_mask_causal_and_groups():
    q, k, v = randn(4, 5, 3), randn(2, 7, 3), randn(2, 7, 2)  # 4 query heads, 2 kv heads
    mask = torch.rand(4, 5, 7) < 0.6
    out, _ = oracle(q, k, v, mask=mask, causal="bottom-right", scale=0.7)
    for h in range(4):
        allowed = [[bool(mask[h, i, j]) and j <= i + 2 for j in range(7)] for i in range(5)]
        torch.testing.assert_close(out[h], loop_oracle(q[h], k[h // 2], v[h // 2], allowed, 0.7))


# --- shapes, broadcasting and heads -------------------------------------------------------------

LAYOUTS = {
    "(Lq, D)": ((5, 4), (7, 4), (7, 4)),
    "(B, Lq, D)": ((2, 5, 4), (2, 7, 4), (2, 7, 4)),
    "(B, H, Lq, D)": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4)),
    "batch broadcast": ((2, 1, 3, 5, 4), (1, 4, 3, 7, 4), (4, 3, 7, 4)),
    "k and v broadcast": ((2, 3, 5, 4), (2, 3, 7, 4), (1, 3, 7, 6)),
    "q without heads": ((5, 4), (2, 3, 7, 4), (2, 3, 7, 4)),
    "k without heads": ((2, 3, 5, 4), (7, 4), (7, 4)),
    "3-d q, k without heads": ((3, 5, 4), (7, 4), (7, 4)),
    "grouped heads": ((2, 6, 5, 4), (2, 2, 7, 4), (2, 2, 7, 4)),
    "multi-query": ((2, 4, 5, 4), (2, 1, 7, 4), (2, 1, 7, 4)),
    "grouped 3-d": ((6, 5, 4), (3, 7, 4), (3, 7, 4)),
    "Dv != Dk": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 9)),
    "Lq > Lk": ((1, 2, 9, 4), (1, 2, 3, 4), (1, 2, 3, 4)),
    "length 1": ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_match_oracle(backend, layout):
    q_shape, k_shape, v_shape = LAYOUTS[layout]
    q, k, v = randn(*q_shape), randn(*k_shape), randn(*v_shape)
    check(backend, q, k, v)  # the oracle's shape is (*batch, Hq, Lq, Dv), or (Lq, Dv)


def test_grouped_heads_are_repeat_interleave(backend):
    q, k, v = randn(2, 6, 5, 4), randn(2, 2, 7, 4), randn(2, 2, 7, 3)
    grouped = attend(backend, q, k, v)
    repeated = attend(backend, q, k.repeat_interleave(3, -3), v.repeat_interleave(3, -3))
    torch.testing.assert_close(grouped, repeated, atol=1e-12, rtol=1e-12)
    # The other layout (kv head j serves query heads j, j+Hkv, ...) must give something else.
    tiled = attend(backend, q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))
    assert not torch.allclose(grouped, tiled)


# --- masks ----------------------------------------------------------------------------------------

SCORES = (2, 3, 4, 5)  # (B, H, Lq, Lk)
MASK_SHAPES = broadcast_shapes_of(SCORES)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_every_broadcast_shape_of_mask(backend, kind, shape):
    q, k, v = randn(2, 3, 4, 6), randn(2, 3, 5, 6), randn(2, 3, 5, 6)
    keep = torch.rand(shape) < 0.6
    mask = keep if kind == "bool" else randn(*shape).masked_fill(~keep, -math.inf)
    check(backend, q, k, v, mask=mask)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 1), (1, 7), (5, 7)], ids=str)
def test_mask_shapes_without_heads(backend, shape):
    q, k, v = randn(5, 3), randn(7, 3), randn(7, 2)
    check(backend, q, k, v, mask=torch.rand(shape) < 0.7)


def test_bool_mask_true_means_may_attend(backend):
    q, k, v = randn(1, 1, 1, 4), randn(1, 1, 3, 4), randn(1, 1, 3, 2)
    only_middle = torch.tensor([False, True, False])
    out = attend(backend, q, k, v, mask=only_middle)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 1])


def test_float_mask_is_added_to_scaled_scores(backend):
    q, k, v = randn(1, 2, 3, 4), randn(1, 2, 6, 4), randn(1, 2, 6, 5)
    bias = randn(2, 3, 6)
    out = check(backend, q, k, v, mask=bias, scale=0.5)
    if out is not None:  # adding the bias to k's scores by hand gives the same
        shifted = oracle(q, k, v, scale=0.5, mask=bias)[0]
        assert not torch.allclose(out, oracle(q, k, v, scale=0.5)[0])
        assert_close(out, shifted, f64)


@pytest.mark.parametrize("causal", [True, "bottom-right", "top-left"])
@pytest.mark.parametrize("lengths", [(5, 5), (3, 7), (7, 3), (1, 6), (6, 1)], ids=str)
def test_causal_alignments(backend, causal, lengths):
    lq, lk = lengths
    q, k, v = randn(2, 2, lq, 4), randn(2, 2, lk, 4), randn(2, 2, lk, 3)
    check(backend, q, k, v, causal=causal)


def test_causal_bottom_right_is_the_cache_alignment(backend):
    # The last 2 queries of a 5-token sequence attend exactly like the full causal pass.
    q, k, v = randn(1, 2, 5, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 3)
    full = attend(backend, q, k, v, causal=True)
    tail = attend(backend, q[..., 3:, :], k, v, causal="bottom-right")
    torch.testing.assert_close(tail, full[..., 3:, :], atol=1e-12, rtol=1e-12)
    top_left = attend(backend, q[..., 3:, :], k, v, causal="top-left")
    assert not torch.allclose(top_left, full[..., 3:, :])


@pytest.mark.parametrize("causal", ["bottom-right", "top-left"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_and_causal_combine(backend, causal, kind):
    q, k, v = randn(2, 2, 6, 4), randn(2, 2, 4, 4), randn(2, 2, 4, 3)
    keep = torch.rand(2, 1, 6, 4) < 0.5
    mask = keep if kind == "bool" else randn(2, 1, 6, 4).masked_fill(~keep, -math.inf)
    check(backend, q, k, v, mask=mask, causal=causal)


# --- scale ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.0, 0.3, 1.0, -1.5, 4])
def test_scale(backend, scale):
    q, k, v = randn(2, 3, 5, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 4)
    check(backend, q, k, v, scale=scale)


def test_default_scale_is_inverse_sqrt_of_query_size(backend):
    q, k, v = randn(1, 2, 4, 9), randn(1, 2, 5, 9), randn(1, 2, 5, 3)
    default = attend(backend, q, k, v)
    torch.testing.assert_close(default, attend(backend, q, k, v, scale=1 / 3), rtol=0, atol=0)
    assert not torch.allclose(default, attend(backend, q, k, v, scale=1.0))


# --- dropout --------------------------------------------------------------------------------------


def dropout_inputs(draws: int):
    """The same (Lq=3, Lk=6) problem repeated ``draws`` times along the batch dim, v = identity,
    so each output row is that row's dropped weights."""
    q, k = randn(1, 1, 3, 4), randn(1, 1, 6, 4)
    v = torch.eye(6, dtype=f64)[None, None]
    return q.expand(draws, 1, 3, 4), k.expand(draws, 1, 6, 4), v.expand(draws, 1, 6, 6)


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_drops_weights_and_scales_survivors(backend, p):
    q, k, v = dropout_inputs(draws=4000)
    dropped = attend(backend, q, k, v, dropout_p=p)
    if dropped is None:
        return
    weights = oracle(q[:1], k[:1], v[:1])[1]  # (1, 1, 3, 6)
    kept = dropped != 0
    # Survivors are the weights scaled by 1 / (1 - p), exactly up to rounding.
    scaled = (weights / (1 - p)).expand_as(dropped)
    torch.testing.assert_close(dropped[kept], scaled[kept], atol=1e-12, rtol=1e-12)
    # Each weight is dropped with probability p (5 standard deviations over 72,000 draws).
    n = dropped.numel()
    assert abs((~kept).sum().item() / n - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Different draws drop different weights.
    assert not torch.equal(kept[0], kept[1]) or not torch.equal(kept[1], kept[2])


def test_dropout_preserves_the_expectation(backend):
    p, draws = 0.3, 4000
    q, k = randn(1, 2, 3, 4).expand(draws, 2, 3, 4), randn(1, 2, 5, 4).expand(draws, 2, 5, 4)
    v = randn(1, 2, 5, 3).expand(draws, 2, 5, 3)
    out = attend(backend, q, k, v, dropout_p=p, causal=True)
    if out is None:
        return
    expected, weights = oracle(q[:1], k[:1], v[:1], causal=True)
    # Var of one output = sum_j w_j^2 v_j^2 p / (1 - p); the mean of `draws` is 5 sigma close.
    variance = torch.einsum("...qk,...kd->...qd", weights**2, v[:1] ** 2) * p / (1 - p)
    sigma = (variance / draws).sqrt()
    assert ((out.mean(0, keepdim=True) - expected).abs() <= 5 * sigma + 1e-12).all()
    assert out.std(0).max() > 0.05  # and the draws really differ


def test_dropout_returns_weights_before_dropout(backend):
    q, k, v = dropout_inputs(draws=50)
    got = attend(backend, q, k, v, dropout_p=0.5, return_weights=True)
    if got is None:
        return
    out, weights = got
    assert_close(weights, oracle(q, k, v)[1], f64)  # no zeros, no 1 / (1 - p)
    assert (out == 0).any()  # while the output used dropped weights


def test_dropout_zero_is_deterministic(backend):
    q, k, v = randn(2, 2, 5, 4), randn(2, 2, 6, 4), randn(2, 2, 6, 4)
    first = check(backend, q, k, v, dropout_p=0.0)
    assert torch.equal(first, attend(backend, q, k, v, dropout_p=0.0))


def test_dropout_keeps_fully_masked_rows_zero(backend):
    q, k, v = dropout_inputs(draws=20)
    mask = torch.tensor([True, False, True])[:, None]  # (Lq, 1): the middle query sees nothing
    out = attend(backend, q, k, v, mask=mask, dropout_p=0.4)
    if out is not None:
        assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
        assert not out.isnan().any()


# --- return_weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["(Lq, D)", "(B, H, Lq, D)", "grouped heads", "batch broadcast"])
def test_return_weights(backend, layout):
    q_shape, k_shape, v_shape = LAYOUTS[layout]
    q, k, v = randn(*q_shape), randn(*k_shape), randn(*v_shape)
    got = attend(backend, q, k, v, causal=True, return_weights=True)
    if got is None:
        return
    out, weights = got
    expected_out, expected_weights = oracle(q, k, v, causal=True)
    assert weights.shape == (*out.shape[:-1], k.shape[-2])  # (*B, Hq, Lq, Lk)
    assert_close(out, expected_out, f64)
    assert_close(weights, expected_weights, f64)


def test_weights_rows_sum_to_one_or_zero(backend):
    q, k, v = randn(2, 2, 6, 4), randn(2, 2, 4, 4), randn(2, 2, 4, 4)
    mask = torch.rand(2, 2, 6, 4) < 0.4
    got = attend(backend, q, k, v, mask=mask, return_weights=True)
    if got is None:
        return
    sums = got[1].sum(-1)
    has_key = mask.any(-1)
    torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
    assert torch.equal(sums[~has_key], torch.zeros_like(sums[~has_key]))
    assert (~has_key).any() and has_key.any()


# --- fully masked rows, empty inputs -------------------------------------------------------------


def fully_masked_cases():
    """(name, kwargs, which query rows have no key) for a (B=2, H=2, Lq=6, Lk=4) problem."""
    bool_mask = torch.ones(2, 1, 6, 4, dtype=torch.bool)
    bool_mask[:, :, 1] = False
    bool_mask[1, :, 4] = False
    float_mask = torch.zeros(2, 1, 6, 4).masked_fill(~bool_mask, -math.inf)
    rows = (~bool_mask.any(-1)).expand(2, 2, 6)
    causal_rows = torch.tensor([True, True, False, False, False, False]).expand(2, 2, 6)
    return {
        "bool mask": ({"mask": bool_mask}, rows),
        "float mask": ({"mask": float_mask}, rows),
        "bottom-right, Lq > Lk": ({"causal": True}, causal_rows),
        "mask and causal": ({"mask": bool_mask, "causal": True}, rows | causal_rows),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(fully_masked_cases()))
def test_fully_masked_rows_give_exact_zeros(backend, dtype, case):
    kwargs, empty_rows = fully_masked_cases()[case]
    if "mask" in kwargs and kwargs["mask"].is_floating_point():
        kwargs = {**kwargs, "mask": kwargs["mask"].to(dtype)}
    q, k, v = (randn(2, 2, n, 4, dtype=dtype, requires_grad=True) for n in (6, 4, 4))
    out = attend(backend, q, k, v, **kwargs)
    if out is None:
        return
    assert torch.equal(out[empty_rows], torch.zeros_like(out[empty_rows]))
    assert not out.isnan().any()
    assert_close(out.detach(), oracle(q, k, v, **kwargs)[0], dtype)
    # Gradient: rows without keys give q no gradient, and no gradient is NaN. (Gradient values
    # are compared with the oracle's in test_property_gradients_match_oracle.)
    out.backward(torch.ones_like(out))
    assert torch.equal(q.grad[empty_rows], torch.zeros_like(q.grad[empty_rows]))
    for grad in (q.grad, k.grad, v.grad):
        assert grad.isfinite().all()

    weights = attend(backend, q, k, v, return_weights=True, **kwargs)
    if weights is not None:
        assert torch.equal(weights[1][empty_rows], torch.zeros_like(weights[1][empty_rows]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_rows_masked_gives_zero_everything(backend, dtype):
    q, k, v = (randn(1, 2, n, 4, dtype=dtype, requires_grad=True) for n in (3, 5, 5))
    out = attend(backend, q, k, v, mask=torch.zeros(3, 5, dtype=torch.bool))
    if out is None:
        return
    out.backward(randn(*out.shape, dtype=dtype))
    for tensor in (out, q.grad, k.grad, v.grad):
        assert torch.equal(tensor, torch.zeros_like(tensor))


@pytest.mark.parametrize("lengths", [(0, 5), (5, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_empty_sequences(backend, lengths, causal):
    lq, lk = lengths
    q, k, v = (randn(2, 3, n, 4, requires_grad=True) for n in (lq, lk, lk))
    out = attend(backend, q, k, v, causal=causal)
    if out is None:
        return
    assert out.shape == (2, 3, lq, 4)
    assert torch.equal(out, torch.zeros_like(out))  # no keys: zeros, not NaN
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and not k.grad.isnan().any()
    got = attend(backend, q, k, v, causal=causal, return_weights=True)
    if got is not None:
        assert got[1].shape == (2, 3, lq, lk) and torch.equal(got[0], out)


@pytest.mark.parametrize("shapes", [((0, 3, 5, 4), (0, 3, 6, 4)), ((0, 5, 4), (0, 6, 4))], ids=str)
def test_empty_batch_or_heads(backend, shapes):
    q_shape, k_shape = shapes
    q, k, v = randn(*q_shape), randn(*k_shape), randn(*k_shape[:-1], 2)
    out = attend(backend, q, k, v, causal=True)
    if out is not None:
        assert out.shape == (*q_shape[:-1], 2)


# --- NaN and Inf ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["causal", "bool mask", "float mask"])
def test_nan_in_a_key_reaches_exactly_the_rows_that_may_attend_it(backend, how):
    lq, lk, bad = 5, 5, 2
    q, k, v = randn(1, 2, lq, 4), randn(1, 2, lk, 4), randn(1, 2, lk, 3)
    k[0, 1, bad, 0] = math.nan  # head 1, key 2
    keep = torch.ones(lq, lk, dtype=torch.bool).tril()
    keep[4, bad] = False  # query 4 may not attend the bad key either
    kwargs = {
        "causal": {"causal": True},
        "bool mask": {"mask": keep},
        "float mask": {"mask": torch.zeros(lq, lk, dtype=f64).masked_fill(~keep, -math.inf)},
    }[how]
    out = attend(backend, q, k, v, **kwargs)
    if out is None:
        return
    if how == "causal":
        keep[4, bad] = True
    touched = keep[:, bad]
    assert out[0, 1, touched].isnan().all()  # never silently replaced
    clean = k.nan_to_num(0.0)
    assert_close(out[0, 1, ~touched], oracle(q, clean, v, **kwargs)[0][0, 1, ~touched], f64)
    assert_close(out[0, 0], oracle(q, clean, v, **kwargs)[0][0, 0], f64)  # the other head


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_query_reaches_only_its_row(backend, value):
    q, k, v = randn(1, 1, 4, 3), randn(1, 1, 6, 3), randn(1, 1, 6, 2)
    q[0, 0, 2, 1] = value
    out = attend(backend, q, k, v)
    assert not out[0, 0, 2].isfinite().any()
    assert_close(out[0, 0, [0, 1, 3]], oracle(q, k, v)[0][0, 0, [0, 1, 3]], f64)


def test_non_finite_query_without_keys_still_gives_zero(backend):
    q, k, v = randn(1, 1, 3, 2), randn(1, 1, 4, 2), randn(1, 1, 4, 2)
    q[0, 0, 1, 0] = math.nan
    mask = torch.tensor([True, False, True])[:, None]  # query 1 may attend no key
    out = attend(backend, q, k, v, mask=mask)
    if out is not None:
        assert torch.equal(out[0, 0, 1], torch.zeros(2, dtype=f64))
        assert out[0, 0, [0, 2]].isfinite().all()


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_value_reaches_the_outputs_that_use_it(backend, value):
    q, k, v = randn(1, 1, 4, 3), randn(1, 1, 6, 3), randn(1, 1, 6, 2)
    v[0, 0, 3, 1] = value
    out = attend(backend, q, k, v)
    assert not out[..., 1].isfinite().any()  # every query may attend key 3
    assert_close(out[..., 0], oracle(q, k, v)[0][..., 0], f64)  # the other feature is clean


@pytest.mark.parametrize(
    "case", ["bad key, causal", "bad key, top-left", "bad key, mask", "grouped", "bad query"]
)
def test_sdpa_off_the_cpu_spreads_non_finite_values_as_qkv_does_without_a_host_sync(
    monkeypatch, case
):
    # Off the CPU, sdpa must not ask whether q and k are finite (bool() of a device tensor stalls
    # the device): it runs on cleaned inputs and puts NaN into exactly the rows qkv's semantics do.
    from qkv.backends import sdpa

    monkeypatch.setattr(sdpa, "SYNC_FREE", True)
    hq = 4 if case == "grouped" else 2
    q, k, v = randn(2, hq, 5, 4), randn(2, 2, 7, 4), randn(2, 2, 7, 3)
    keep = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)
    keep[1] = False  # query 1 may attend nothing
    keep[4, 3] = False
    kwargs = {
        "bad key, causal": {"causal": True},
        "bad key, top-left": {"causal": "top-left"},
        "bad key, mask": {"mask": keep},
        "grouped": {"mask": torch.zeros(5, 7, dtype=f64).masked_fill(~keep, -math.inf)},
        "bad query": {"mask": keep},
    }[case]
    if case == "bad query":
        q[1, 0, 1, 2] = math.inf  # a row without keys: still 0
        q[1, 1, 2, 0] = math.nan
    else:
        k[0, 1, 3, 2] = math.nan  # key 3 of key/value head 1
    expected = qkv.attention(q, k, v, backend="reference", **kwargs)

    def no_sync(self: torch.Tensor) -> bool:
        raise AssertionError("sdpa asked the device for a value")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    out = qkv.attention(q, k, v, backend="sdpa", **kwargs)
    monkeypatch.undo()
    assert out.isnan().any()  # the case plants a value that reaches some row
    assert torch.equal(out.isnan(), expected.isnan())
    assert_close(out.nan_to_num(0.0), expected.nan_to_num(0.0), f64)


# --- float16 / bfloat16 ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("options", ["plain", "causal", "float mask", "grouped"])
def test_low_precision_matches_oracle(backend, dtype, options):
    q, k = randn(2, 4, 33, 16, dtype=dtype), randn(2, 4, 40, 16, dtype=dtype)
    v = randn(2, 4, 40, 8, dtype=dtype)
    kwargs = {
        "plain": {},
        "causal": {"causal": True},
        "float mask": {"mask": randn(4, 33, 40, dtype=dtype)},
        "grouped": {"causal": "top-left"},
    }[options]
    if options == "grouped":
        k, v = k[:, :2], v[:, :2]
    check(backend, q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_scores_are_float32(backend, dtype):
    # Two keys whose scores, 520.25 and 520, are exact in float32 but one float16/bfloat16 value
    # (520): rounded scores would give out = (v0 + v1) / 2 = 0 instead of tanh(0.125) ≈ 0.124.
    # exp(520) also overflows float16: the row maximum must be subtracted in float32.
    q = torch.tensor([[1.0, 1.0]], dtype=dtype)
    k = torch.tensor([[512.0, 8.25], [512.0, 8.0]], dtype=dtype)
    v = torch.tensor([[1.0], [-1.0]], dtype=dtype)
    out = check(backend, q, k, v, scale=1.0)
    if out is not None:
        assert float(out) == pytest.approx(math.tanh(0.125), abs=2e-3)


# --- torch's own scaled_dot_product_attention, where semantics coincide ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "options", ["plain", "bool mask", "float mask", "is_causal", "gqa", "scale", "Dv != Dk"]
)
def test_matches_torch_sdpa(backend, dtype, options):
    hkv = 2 if options == "gqa" else 4
    dv = 5 if options == "Dv != Dk" else 8
    q, k = randn(2, 4, 7, 8, dtype=dtype), randn(2, hkv, 9, 8, dtype=dtype)
    v = randn(2, hkv, 9, dv, dtype=dtype)
    ours: dict = {}
    theirs: dict = {}
    if options == "bool mask":
        ours["mask"] = theirs["attn_mask"] = torch.rand(2, 1, 7, 9) < 0.7
        ours["mask"][..., 0] = True  # torch's result for a fully masked row differs by version
    elif options == "float mask":
        ours["mask"] = theirs["attn_mask"] = randn(2, 4, 7, 9, dtype=dtype)
    elif options == "is_causal":
        ours["causal"], theirs["is_causal"] = "top-left", True
    elif options == "gqa":
        theirs["enable_gqa"] = True
    elif options == "scale":
        ours["scale"] = theirs["scale"] = 0.25
    got = attend(backend, q, k, v, **ours)
    expected = F.scaled_dot_product_attention(q, k, v, **theirs)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=10 * atol, rtol=10 * rtol)


# --- gradients ------------------------------------------------------------------------------------

GRAD_CASES = {
    "plain": ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), {}),
    "bool mask, causal": (
        (2, 1, 3, 4),
        (2, 1, 5, 4),
        (2, 1, 5, 2),
        {
            "mask": torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]]).bool(),
            "causal": True,
        },
    ),
    "float mask": ((1, 2, 3, 4), (1, 2, 4, 4), (1, 2, 4, 3), {"mask": "float"}),
    "grouped": ((1, 4, 3, 2), (1, 2, 4, 2), (1, 2, 4, 3), {"causal": "top-left"}),
    "Lq > Lk": ((1, 1, 5, 3), (1, 1, 2, 3), (1, 1, 2, 3), {"causal": True, "scale": 0.9}),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck_float64(backend, case):
    q_shape, k_shape, v_shape, kwargs = GRAD_CASES[case]
    q, k, v = (randn(*s, requires_grad=True) for s in (q_shape, k_shape, v_shape))
    if kwargs.get("mask") == "float":
        kwargs = {**kwargs, "mask": randn(q_shape[-2], k_shape[-2])}
    require(backend)
    if attend(backend, q, k, v, **kwargs) is None:
        return
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kwargs), (q, k, v)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_oracle(backend, dtype):
    q, k, v = (
        randn(2, h, n, 8, dtype=dtype, requires_grad=True) for h, n in ((4, 6), (2, 9), (2, 9))
    )
    kwargs = {"mask": torch.rand(2, 1, 6, 9) < 0.7, "causal": True}
    out = attend(backend, q, k, v, **kwargs)
    if out is None:
        return
    grad_out = randn(*out.shape, dtype=dtype)
    ours = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(oracle(q, k, v, **kwargs)[0], (q, k, v), grad_out.double())
    atol, rtol = TOLERANCE[dtype]
    for got, want in zip(ours, expected):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.double(), atol=4 * atol, rtol=4 * rtol)


def test_gradgradcheck_reference():
    q, k, v = (randn(1, 2, n, 3, requires_grad=True) for n in (3, 4, 4))
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]).bool()
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: qkv.attention(q, k, v, mask=mask, backend="reference"), (q, k, v)
    )


# --- refusals -------------------------------------------------------------------------------------


def test_sdpa_refuses_weights_clearly():
    q = randn(1, 1, 2, 2)
    with pytest.raises(Unsupported, match='backend="reference"'):
        qkv.attention(q, q, q, return_weights=True, backend="sdpa")


def test_auto_gives_weights_and_handles_empty():
    q, k = randn(1, 2, 3, 2), randn(1, 2, 0, 2)
    out, weights = qkv.attention(q, k, k, return_weights=True)
    assert out.shape == (1, 2, 3, 2) and weights.shape == (1, 2, 3, 0)


# --- properties over random shapes ---------------------------------------------------------------


@settings(max_examples=150)
@given(case=attention_cases(), dtype=st.sampled_from(DTYPES))
def test_property_matches_oracle(backend, case, dtype):
    q, k, v, mask = case.tensors(dtype)
    check(backend, q, k, v, mask=mask, **case.kwargs())


@given(case=attention_cases(masks=False))
def test_property_keys_are_a_set(backend, case):
    # Without a mask or causal rule, shuffling the keys together with their values changes nothing.
    q, k, v, _ = case.tensors()
    order = torch.randperm(k.shape[-2], generator=torch.Generator().manual_seed(case.seed))
    out = attend(backend, q, k, v, scale=case.scale)
    if out is not None:
        shuffled = attend(backend, q, k[..., order, :], v[..., order, :], scale=case.scale)
        torch.testing.assert_close(shuffled, out, atol=1e-10, rtol=1e-10)


@settings(max_examples=50)
@given(case=attention_cases())
def test_property_gradients_match_oracle(backend, case):
    q, k, v, mask = case.tensors()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attend(backend, q, k, v, mask=mask, **case.kwargs())
    if out is None:
        return
    grad_out = torch.randn(out.shape, dtype=f64)
    ours = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
    expected = oracle(q, k, v, mask=mask, **case.kwargs())[0]
    theirs = torch.autograd.grad(expected, (q, k, v), grad_out, allow_unused=True)
    for got, want in zip(ours, theirs):  # None: no path from an empty input to the output
        got = torch.zeros_like(want) if got is None else got
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
