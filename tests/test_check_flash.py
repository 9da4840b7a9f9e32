"""``qkv.check(obj, flash=True)``: each planted flash mistake fails its own check with its cause,
and no false alarm on qkv's flash backend, the reference, torch's SDPA and the right tutorial.
Sizes stay small and the work check counts flops instead of timing (``small_and_untimed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import planted_flash as pf
import pytest
import torch
from torch.nn import functional as F

import qkv
from qkv.checker import CheckError, Report, check, load
from qkv.checker.flash import cost as flash_cost
from qkv.checker.flash.context import FlashContext
from qkv.checker.flash.run import check_flash
from qkv.checker.flash.target import flash_target
from qkv.checker.report import FLASH_CHECK_IDS

TUTORIALS = Path(__file__).resolve().parents[1] / "examples" / "tutorials"


@pytest.fixture(autouse=True)
def small_and_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    pf.small_and_untimed(monkeypatch)


def grade(implementation: Any, skip: tuple[str, ...] = ("memory", "work")) -> Report:
    """Every flash check but ``skip`` (the slow ones, tested on their own below)."""
    return check_flash(flash_target(implementation, "planted", {}), skip)


def qkv_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> Any:
    return qkv.attention(q, k, v, causal=causal, backend="flash", return_lse=True)


def qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> Any:
    return qkv.attention(q, k, v, causal=causal, backend="reference", return_lse=True)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> Any:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


CORRECT = {
    "qkv's flash backend": (qkv_flash, set()),
    "the reference (holds the (L, L) matrix)": (qkv_reference, {"memory"}),
    "torch's SDPA": (sdpa, set()),
    "the right tutorial": (load(f"{TUTORIALS / 'flash_attention.py'}:FlashAttention"), set()),
    "planted_flash.Flash": (pf.Flash(), set()),
}


@pytest.mark.parametrize("name", CORRECT)
def test_no_false_alarm_on_correct_flash_implementations(name: str) -> None:
    implementation, fails = CORRECT[name]
    report = check(implementation, flash=True)
    assert set(report.failed) == fails, report.text()
    assert [r.id for r in report.checks] == list(FLASH_CHECK_IDS)
    assert report["oracle"].status == "pass" and "Dv = 16 ≠ Dk = 32 too" in report["oracle"].detail


def test_what_is_detected_about_how_it_is_called() -> None:
    sdpa_report = check(sdpa, flash=True)
    assert sdpa_report.detected["causal"] == "parameter is_causal; top-left-aligned when Lq ≠ Lk"
    assert sdpa_report.detected["lse"] == "none"
    assert sdpa_report["lse"].status == sdpa_report["fully-masked"].status == "skip"
    tutorial = check(CORRECT["the right tutorial"][0], flash=True, name="flash_attention.py")
    assert tutorial.detected["kind"] == (
        "autograd.Function, called as FlashAttention.apply(q, k, v, is_causal)"
    )
    assert tutorial.detected["lse"].startswith("saved for its backward (1 tensor")
    assert "bottom-right" in tutorial["alignment"].detail
    assert "quadratic" in check(qkv_reference, flash=True)["memory"].detail


# One planted mistake each: (implementation, the one check that fails, words its detail says).
PLANTED = {
    "running sum not rescaled": (pf.NoRescaleOfSum(), "oracle", ["not rescaled", "tiles of 32"]),
    "base-2 lse": (pf.Base2Lse(), "lse", ["base 2", "ln 2"]),
    "exp2 without log2(e)": (pf.Exp2WithoutLog2e(), "oracle", ["2^x", "log₂e"]),
    "scale by the value width": (pf.ScaleByValueWidth(), "oracle", ["1/√16 = 1/√d_v", "1/√32"]),
    "partial key tile dropped": (pf.DropsPartialKeyTile(), "odd-lengths", ["64–66", "partial"]),
    "NaN where a row has no key": (pf.NaNWhereNoKey(), "fully-masked", ["NaN", "0 / 0"]),
    "finite lse where a row has no key": (pf.FiniteLseWhereNoKey(), "fully-masked", ["−inf"]),
    "causal alignment mixed": (pf.MisalignedCausal(), "alignment", ["neither", "same offset"]),
    "causal hides the diagonal": (pf.HidesDiagonal(), "causal", ["hides the diagonal"]),
    "scale missing from dq": (pf.NoScaleInDq(), "backward", ["√32", "missing", "dq"]),
    "D missing from ds": (pf.NoDeltaInBackward(), "backward", ["rowsum(dO ∘ O)"]),
    "softmax in low precision": (pf.LowPrecisionSoftmax(), "dtypes", ["bfloat16", "float32"]),
    "a race in the backward": (pf.RacyBackward(), "determinism", ["more than round-off"]),
}
SECOND = {  # a mistake whose consequence a second check reports, with the cause
    "running sum not rescaled": {"lse", "backward"},
    "exp2 without log2(e)": {"lse", "backward"},
    "base-2 lse": {"backward"},
    "a race in the backward": {"backward"},
}


@pytest.mark.parametrize("mistake", PLANTED)
def test_each_planted_flash_mistake_fails_its_check_and_names_the_cause(mistake: str) -> None:
    implementation, check_id, words = PLANTED[mistake]
    report = grade(implementation)
    assert set(report.failed) == {check_id} | SECOND.get(mistake, set()), report.text()
    for word in words:
        assert word in report[check_id].detail, report[check_id].detail


def test_a_backward_right_for_a_wrong_lse_is_told_apart() -> None:
    detail = grade(pf.Base2Lse())["backward"].detail
    assert "right for what the forward saved" in detail and "see lse" in detail


def test_the_checks_after_a_wrong_output_are_not_judged() -> None:
    report = grade(pf.NoRescaleOfSum())
    for check_id in ("causal", "alignment", "odd-lengths", "fully-masked", "dtypes"):
        assert report[check_id].status == "skip" and "see oracle" in report[check_id].detail


def test_atomic_add_order_is_a_warning() -> None:
    result = grade(pf.KeyTilesInAnyOrder())["determinism"]
    assert result.status == "warn" and "within round-off" in result.detail


def test_memory_that_grows_with_the_square_of_the_length_fails() -> None:
    quadratic = flash_cost.memory(FlashContext(flash_target(pf.DenseBackward(), "dense", {})))
    assert quadratic.status == "fail", quadratic.detail
    assert "the backward holds an (Lq, Lk) matrix" in quadratic.detail
    linear = flash_cost.memory(FlashContext(flash_target(pf.Flash(), "flash", {})))
    assert linear.status == "pass" and "linear in length" in linear.detail


def test_causal_work_that_is_not_skipped_is_a_warning() -> None:
    result = flash_cost.work(FlashContext(flash_target(pf.NoCausalSkip(), "all tiles", {})))
    assert result.status == "warn" and "computed and then masked" in result.detail
    result = flash_cost.work(FlashContext(flash_target(pf.Flash(), "flash", {})))
    assert result.status == "pass" and "skipped" in result.detail


def test_peak_memory_counts_live_storage_once() -> None:
    with flash_cost.PeakMemory() as counter:
        first = torch.empty(1000)  # 4,000 bytes
        view = first[10:]  # no new storage
        del first, view
        second = torch.empty(500)
    assert counter.peak == 4000 and counter.live == 2000
    del second


def test_a_cs336_style_function_with_the_lse_saved_is_found() -> None:
    """The assignment's form: an adapter of no arguments that returns the autograd.Function,
    whose forward(ctx, Q, K, V, is_causal) saves one (B, Lq) log-sum-exp and returns only O,
    and takes three-dim inputs only."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, Q: Any, K: Any, V: Any, is_causal: bool = False) -> Any:
            if Q.dim() != 3:
                raise ValueError("expects (batch, n_queries, d)")
            out, lse = qkv.attention(Q, K, V, causal=is_causal, return_lse=True)
            ctx.save_for_backward(lse, Q, K, V, out)
            return out

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            raise NotImplementedError

    def get_flashattention_autograd_function_pytorch() -> type:
        return Attention

    report = grade(get_flashattention_autograd_function_pytorch)
    assert report["lse"].status == "pass" and "saved for its backward" in report["lse"].detail
    assert "NotImplementedError" in report["backward"].detail


def test_what_it_cannot_call_says_what_to_pass() -> None:
    def needs_block(q: Any, k: Any, v: Any, block: int) -> Any:
        return qkv.attention(q, k, v)

    with pytest.raises(CheckError, match="--forward name=value"):
        check(needs_block, flash=True)
    assert check(needs_block, flash=True, forward={"block": 16})["oracle"].status == "pass"
    with pytest.raises(CheckError, match="--flash checks a function"):
        check(pf.Flash(), flash=True, heads=4)
    with pytest.raises(CheckError, match=r"is an nn\.Module: --flash grades a function f"):
        check(qkv.SelfAttention(8), flash=True)
