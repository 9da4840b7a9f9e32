"""``qkv check`` names what is wrong: each planted mistake fails its own check with its cause,
and every named scale is recognised, for any head count."""

from __future__ import annotations

import math

import planted
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qkv
from qkv.checker import Report, check, tutorials
from qkv.checker.diagnose import SCALES


def failed(report: Report) -> set[str]:
    return set(report.failed)


PLANTED = {
    "wrong scale": (planted.WrongScale, "scale", ["1/√32", "d_model", "1/√8"]),
    "no scale": (planted.NoScale, "scale", ["no scale", "1/√8"]),
    "scale after softmax": (planted.ScaleAfterSoftmax, "scale", ["after the softmax"]),
    "softmax over the wrong axis": (planted.SoftmaxOverQueries, "oracle", ["wrong axis", "dim=-1"]),
    "tiny mask fill": (planted.TinyMaskFill, "padding", ["1e-20", "-inf"]),
    "positive mask fill": (planted.PositiveMaskFill, "padding", ["large positive", "-inf"]),
    "heads split without transpose": (
        planted.SplitWithoutTranspose,
        "oracle",
        ["split", "transpose"],
    ),
    "heads merged without transpose": (
        planted.MergeWithoutTranspose,
        "oracle",
        ["merged", "transpose"],
    ),
    "causal mask hides the diagonal": (
        planted.CausalHidesDiagonal,
        "causal",
        ["diagonal", "j <= i"],
    ),
    "causal mask flipped": (planted.CausalFlipped, "causal", ["flipped", "future"]),
    "causal flag ignored": (planted.CausalIgnored, "causal", ["no effect", "future"]),
    "dropout in eval": (planted.DropoutInEval, "dropout", ["eval mode", "training=self.training"]),
    "dropout in eval at the default rate": (
        planted.DropoutByDefault,
        "dropout",
        ["eval mode", "dropout=0.1 (its default)", "training=self.training"],
    ),
    "NaN on a fully padded row": (planted.NaNOnFullyPadded, "fully-masked", ["NaN", "0/0"]),
    "batch mixing": (planted.BatchMixing, "batch", ["changing item 1 changes item 0", "mix"]),
    "padding broadcast over queries": (
        planted.PaddingOverQueries,
        "padding",
        ["queries", "(B, 1, 1, L)"],
    ),
    "crash on an empty sequence": (planted.CrashOnEmpty, "empty", ["L = 0 raised", "max"]),
}


@pytest.mark.parametrize("defect", PLANTED)
def test_each_planted_mistake_fails_its_check_and_names_the_cause(defect: str) -> None:
    implementation, check_id, words = PLANTED[defect]
    report = check(implementation)
    result = report[check_id]
    assert result.status == "fail", report.text()
    for word in words:
        assert word in result.detail, result.detail
    assert not report.ok


def test_the_causal_mask_mistakes_fail_only_with_causal_and_tiny_fills_leak_there_too() -> None:
    assert failed(check(planted.CausalHidesDiagonal)) == {"causal"}
    assert failed(check(planted.CausalFlipped)) == {"causal"}
    assert {"causal", "padding"} <= failed(check(planted.TinyMaskFill))


@given(
    heads=st.sampled_from([1, 2, 4]),
    size=st.sampled_from([4, 8]),
    causal=st.booleans(),
    bias=st.booleans(),
)
def test_qkv_self_attention_of_any_shape_passes(
    heads: int, size: int, causal: bool, bias: bool
) -> None:
    report = check(qkv.SelfAttention(heads * size, heads, bias=bias, causal=causal))
    assert report.ok, report.text()
    assert f"{heads} head(s) of size {size}" in report["scale"].detail


@given(heads=st.sampled_from([2, 4, 8]), size=st.sampled_from([4, 8]))
def test_a_d_model_scale_is_named_for_any_heads(heads: int, size: int) -> None:
    class Layer(planted.WrongScale):
        def __init__(self) -> None:
            super().__init__(heads * size, heads)

    detail = check(Layer)["scale"].detail
    assert f"1/√{heads * size} = 1/√d_model" in detail and f"1/√{size} = 1/√d_k" in detail


def test_a_wrong_scale_is_named_whatever_it_is() -> None:
    report = tutorials.check_example(
        tutorials.example("tutorial_004_single_token.py", "SelfAttention")
    )
    assert "1/√32 = 1/√d_in" in report["scale"].detail
    assert "1/√24" in report["scale"].detail


@given(name=st.sampled_from([n for n in SCALES if n not in ("head", "d_in", "d_v")]))
def test_any_named_scale_in_a_function_is_diagnosed(name: str) -> None:
    value = SCALES[name][0](8, 32, 8, 32)  # heads of size 8, four of them

    def scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, scale=value, backend="reference")

    report = check(scaled)
    assert failed(report) == {"oracle", "scale"}, report.text()
    assert SCALES[name][1].split(" ")[0].format(D=8, E=32) in report["scale"].detail


def test_an_unnamed_scale_is_measured() -> None:
    def scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, scale=0.05, backend="reference")

    detail = check(scaled)["scale"].detail
    assert "0.05" in detail and "1/√8" in detail


def test_a_function_scaled_by_the_value_width_is_named() -> None:
    """With Dv = Dk the two scales agree; the probe with values of width 16 tells them apart."""

    def scaled_by_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(v.size(-1))
        return torch.softmax(scores, dim=-1) @ v

    report = check(scaled_by_values)
    assert failed(report) == {"oracle", "scale"}, report.text()
    assert "1/√16 = 1/√d_v" in report["scale"].detail and "1/√8 = 1/√d_k" in report["scale"].detail
    assert "Dv = 16" in report["oracle"].detail
    assert "Dv = 16 (≠ Dk) too" in check(qkv.attention)["scale"].detail


class KeyValueWidths(nn.Module):
    """Key and value widths of its own (d_k, d_v per head), scaled by one of them."""

    def __init__(self, d_model: int, d_k: int, d_v: int, n_heads: int = 4, by: str = "d_k"):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.by = n_heads, d_k, d_v, by
        self.w_q = nn.Linear(d_model, n_heads * d_k)
        self.w_k = nn.Linear(d_model, n_heads * d_k)
        self.w_v = nn.Linear(d_model, n_heads * d_v)
        self.w_o = nn.Linear(n_heads * d_v, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (
            w(x).view(batch, length, self.heads, size).transpose(1, 2)
            for w, size in ((self.w_q, self.d_k), (self.w_k, self.d_k), (self.w_v, self.d_v))
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(getattr(self, self.by))
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
        return self.w_o(out.reshape(batch, length, self.heads * self.d_v))


def test_a_module_with_its_own_value_width_is_probed_with_another() -> None:
    wrong = check(KeyValueWidths, init={"by": "d_v"})
    assert failed(wrong) == {"oracle", "scale"}, wrong.text()
    detail = wrong["scale"].detail
    assert "Built with d_v=16" in detail and "1/√16 = 1/√d_v" in detail
    right = check(KeyValueWidths)
    assert right.ok, right.text()
    assert "built with d_v=16 (≠ Dk) too" in right["scale"].detail
