"""Mask helpers against brute-force definitions, and the tile conversion backends use.

**True means "may attend".** Legend: B batch, Lq query length, Lk key length.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv import masks

sizes = st.integers(0, 9)


def brute_causal(lq: int, lk: int, align: str) -> torch.Tensor:
    offset = lk - lq if align == "bottom-right" else 0
    return torch.tensor(
        [[j <= i + offset for j in range(lk)] for i in range(lq)], dtype=torch.bool
    ).reshape(lq, lk)


@given(lq=sizes, lk=sizes, align=st.sampled_from(["bottom-right", "top-left"]))
def test_causal_mask_matches_definition(lq, lk, align):
    got = qkv.causal_mask(lq, lk, align=align)
    assert got.dtype == torch.bool and got.shape == (lq, lk)
    assert torch.equal(got, brute_causal(lq, lk, align))


def test_causal_mask_defaults():
    assert torch.equal(qkv.causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())
    # bottom-right by default: the last query sees every key
    assert qkv.causal_mask(2, 5)[-1].all() and qkv.causal_mask(2, 5)[0].sum() == 4
    assert qkv.causal_mask(2, 5, align="top-left")[0].sum() == 1
    assert qkv.causal_mask(3, device=torch.device("cpu")).device.type == "cpu"


@given(
    lq=sizes,
    lk=sizes,
    window=st.integers(1, 10),
    align=st.sampled_from(["bottom-right", "top-left"]),
)
def test_sliding_window_matches_definition(lq, lk, window, align):
    offset = lk - lq if align == "bottom-right" else 0
    expected = torch.tensor(
        [[i + offset - window < j <= i + offset for j in range(lk)] for i in range(lq)],
        dtype=torch.bool,
    ).reshape(lq, lk)
    got = qkv.sliding_window_mask(lq, lk, window=window, align=align)
    assert got.dtype == torch.bool and torch.equal(got, expected)
    assert (got.sum(-1) <= window).all()  # at most `window` keys
    assert not (got & ~brute_causal(lq, lk, align)).any()  # and causal


def test_sliding_window_sees_itself_and_window_minus_one_before():
    got = qkv.sliding_window_mask(6, window=3)
    assert got[5].tolist() == [False, False, False, True, True, True]
    assert got[0].tolist() == [True, False, False, False, False, False]
    assert torch.equal(qkv.sliding_window_mask(6, window=6), qkv.causal_mask(6))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32])
def test_padding_mask_from_a_01_mask(dtype):
    x = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).to(dtype)
    got = qkv.padding_mask(x)
    assert got.dtype == torch.bool and got.shape == (3, 1, 1, 3)
    assert torch.equal(got[:, 0, 0], x != 0)


@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=4), extra=st.integers(0, 3))
def test_padding_mask_from_lengths(lengths, extra):
    length = max(lengths, default=0) + extra
    got = qkv.padding_mask(torch.tensor(lengths, dtype=torch.int64), length)
    assert got.dtype == torch.bool and got.shape == (len(lengths), 1, 1, length)
    for b, n in enumerate(lengths):
        assert got[b, 0, 0].tolist() == [j < n for j in range(length)]


def test_padding_mask_broadcasts_against_scores():
    keep = qkv.padding_mask(torch.tensor([2, 4]), 4)  # (B, 1, 1, S)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 4, 8)
    _, weights = qkv.attention(q, k, k, mask=keep, return_weights=True)
    assert torch.equal(weights[0, ..., 2:], torch.zeros(3, 5, 2))
    assert (weights[1] > 0).all()


def test_combine():
    a = torch.tensor([[True, False, True]])
    b = torch.tensor([[True], [False]])
    assert masks.combine(None, None) is None
    assert masks.combine(a, None) is a and masks.combine(None, b) is b
    assert torch.equal(masks.combine(a, b), a & b)
    bias = torch.tensor([[0.5, -1.0, 2.0]])
    mixed = masks.combine(bias, b)
    assert mixed.dtype == torch.float32
    assert mixed.tolist() == [[0.5, -1.0, 2.0], [-math.inf] * 3]
    assert masks.combine(b, bias.double()).dtype == torch.float64
    summed = masks.combine(bias, bias)
    assert torch.equal(summed, 2 * bias)


@given(
    lq=st.integers(0, 7),
    lk=st.integers(0, 7),
    data=st.data(),
    causal=st.sampled_from([False, True, "top-left"]),
    kind=st.sampled_from([None, "bool", "float", "row", "column"]),
)
def test_tiles_are_slices_of_the_whole(lq, lk, data, causal, kind):
    # tile_keep / tile_bias of any (query range, key range) equal that slice of the full mask.
    q0 = data.draw(st.integers(0, lq))
    q1 = data.draw(st.integers(q0, lq))
    k0 = data.draw(st.integers(0, lk))
    k1 = data.draw(st.integers(k0, lk))
    shape = {"row": (2, 1, lk), "column": (lq, 1)}.get(kind, (2, lq, lk))
    keep = torch.rand(shape) < 0.6
    mask = None if kind is None else keep
    if kind == "float":
        mask = torch.randn(shape).masked_fill(~keep, -math.inf)
    offset = masks.causal_offset(causal, lq, lk)
    full = torch.ones(2, lq, lk, dtype=torch.bool)
    if offset is not None:
        full = full & brute_causal(lq, lk, "top-left" if causal == "top-left" else "bottom-right")
    if mask is not None:
        full = full & (mask if mask.dtype == torch.bool else mask != -math.inf)
    tile = masks.tile_keep(mask, offset, q0, q1, k0, k1, torch.device("cpu"))
    expected = full[:, q0:q1, k0:k1]
    if tile is None:
        assert expected.all()
    else:
        assert torch.equal(tile.expand_as(expected), expected)
    bias = masks.tile_bias(mask, q0, q1, k0, k1)
    if kind == "float":
        assert torch.equal(bias.expand_as(expected), mask[:, q0:q1, k0:k1])
    else:
        assert bias is None


# --- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: qkv.causal_mask(-1), ValueError, ["Lq", ">= 0", "-1"]),
        (lambda: qkv.causal_mask(3, -2), ValueError, ["Lk", ">= 0", "-2"]),
        (lambda: qkv.causal_mask(2.5), TypeError, ["Lq", "int", "float"]),
        (lambda: qkv.causal_mask(True), TypeError, ["Lq", "int", "bool"]),
        (lambda: qkv.causal_mask(3, align="bottom"), ValueError, ["align", "top-left", "'bottom'"]),
        (lambda: qkv.sliding_window_mask(3, window=0), ValueError, ["window", "positive", "0"]),
        (lambda: qkv.sliding_window_mask(3, window=1.0), TypeError, ["window", "int", "float"]),
        (lambda: qkv.sliding_window_mask(3, window=2, align=1), ValueError, ["align", "1"]),
        (lambda: qkv.padding_mask([1, 0]), TypeError, ["x", "torch.Tensor", "list"]),
        (lambda: qkv.padding_mask(torch.ones(1, 1, 3)), ValueError, ["x", "1 or 2", "3"]),
        (lambda: qkv.padding_mask(torch.tensor([[1, 2]])), ValueError, ["x", "0 and 1"]),
        (lambda: qkv.padding_mask(torch.ones(2, 2), 2), ValueError, ["length", "None", "2"]),
        (lambda: qkv.padding_mask(torch.tensor([2, 3])), ValueError, ["length", "None"]),
        (
            lambda: qkv.padding_mask(torch.tensor([2, 7]), length=5),
            ValueError,
            ["length=5", "7", "pass length >= 7"],
        ),
        (lambda: qkv.padding_mask(torch.tensor([2, 5]), 4), ValueError, ["x", "[0, 4]", "5"]),
        (lambda: qkv.padding_mask(torch.tensor([-1]), 4), ValueError, ["x", "[0, 4]", "-1"]),
        (lambda: qkv.padding_mask(torch.tensor([2.0]), 4), TypeError, ["x", "integer", "float"]),
        (lambda: qkv.padding_mask(torch.tensor([2]), -1), ValueError, ["length", ">= 0", "-1"]),
        (lambda: qkv.padding_mask(torch.ones(2, 2, dtype=torch.cfloat)), TypeError, ["x"]),
    ],
)
def test_bad_inputs(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)
