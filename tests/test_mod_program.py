"""score_mod / mask_mod programs on flash's compiled kernel (``program.py``, ``program_call.py``,
``program.h``): the same result as the eager mods on the exact path in float64, the exact path
for a mod the program cannot express, and a wrong program caught by the first-tile proof."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import qkv
from qkv.backends.flash import kernel, program, program_call

pytestmark = pytest.mark.skipif(not kernel.available(), reason="flash's kernel is not built")

H, D = 4, 16
IDS = torch.arange(600) * 5 // 600  # 5 documents over 600 positions
TABLE = torch.randn(H, 2 * 600 - 1, generator=torch.Generator().manual_seed(3))
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
BUCKET_BIAS = torch.randn(H, 32, generator=torch.Generator().manual_seed(4))


def _t5(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
    distance = (qi - kv).clamp(min=0)
    far = 8 + (torch.log(distance.float().clamp(min=1) / 8) / math.log(16) * 8).long().clamp(max=7)
    return score + BUCKET_BIAS[h, torch.where(distance < 8, distance, far)]


SCORE_MODS = {
    "softcap": lambda s, b, h, qi, kv: 20.0 * torch.tanh(s / 20.0),
    "alibi": lambda s, b, h, qi, kv: s - SLOPES[h] * (qi - kv).abs(),
    "relative table": lambda s, b, h, qi, kv: s + TABLE[h, qi - kv + 599],
    "t5 buckets": _t5,
    "rows and parity": lambda s, b, h, qi, kv: torch.where((qi // 7) % 3 == 1, s * 2, s - b - 1.5),
}
MASK_MODS = {
    "documents": lambda b, h, qi, kv: IDS[qi] == IDS[kv],
    "window": lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 70),
    "rows only": lambda b, h, qi, kv: (qi % 5 != 2) & (kv >= 0),
    "heads": lambda b, h, qi, kv: (h == 0) | ~(kv % 3 == 0),
}
TOLERANCE = {torch.float32: 64 * torch.finfo(torch.float32).eps, torch.bfloat16: 0.03}


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call ran on a program (True) or the exact path (False)."""
    seen: list[bool] = []
    forward = program_call.forward

    def spy(*args: Any) -> Any:
        result = forward(*args)
        seen.append(result is not None)
        return result

    monkeypatch.setattr(program_call, "forward", spy)
    return seen


def _inputs(b: int, lq: int, lk: int, hkv: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(lq * 7 + lk)
    shapes = [(b, H, lq, D), (b, hkv, lk, D), (b, hkv, lk, D)]
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """The float64 loop with the eager mods (the program switched off)."""
    saved = program_call.ENABLED
    program_call.ENABLED = False
    try:
        return qkv.attention(q.double(), k.double(), v.double(), backend="flash", **kwargs)
    finally:
        program_call.ENABLED = saved


def _check(
    ran: list[bool], shapes: tuple[int, int, int, int], dtype: torch.dtype, **mods: Any
) -> None:
    q, k, v = _inputs(*shapes, dtype)
    out, lse = qkv.attention(q, k, v, backend="flash", return_lse=True, **mods)
    assert ran[-1], "the call did not run on the program"
    expected, expected_lse = _exact(q, k, v, return_lse=True, **mods)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(SCORE_MODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mods_equal_the_exact_path(ran: list[bool], name: str, dtype: torch.dtype) -> None:
    _check(ran, (2, 200, 333, 2), dtype, score_mod=SCORE_MODS[name], causal=name == "alibi")


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mods_equal_the_exact_path(ran: list[bool], name: str) -> None:
    _check(ran, (1, 300, 600, 4), torch.float32, mask_mod=MASK_MODS[name])


def test_both_mods_gqa_bfloat16(ran: list[bool]) -> None:
    mods = {"score_mod": SCORE_MODS["relative table"], "mask_mod": MASK_MODS["documents"]}
    _check(ran, (1, 257, 257, 1), torch.bfloat16, **mods)


def test_rows_the_mask_empties_give_zero(ran: list[bool]) -> None:
    q, k, v = _inputs(1, 130, 130, H, torch.float32)
    out, lse = qkv.attention(
        q, k, v, backend="flash", return_lse=True, mask_mod=lambda b, h, qi, kv: qi >= 50
    )
    assert ran[-1]
    assert bool((out[:, :, :50] == 0).all()) and bool(torch.isneginf(lse[:, :, :50]).all())
    assert bool(out.isfinite().all())


def test_block_mask_through_flex_attention(ran: list[bool]) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _inputs(1, 384, 384, H, torch.float32)
    mask = MASK_MODS["window"]
    block_mask = create_block_mask(mask, None, None, 384, 384, device="cpu")
    out = qkv.flex_attention(q, k, v, SCORE_MODS["softcap"], block_mask)
    assert ran[-1]
    expected = _exact(q, k, v, score_mod=SCORE_MODS["softcap"], mask_mod=mask)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_a_mod_without_a_program_takes_the_exact_path(ran: list[bool]) -> None:
    def waves(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + torch.sin(qi.float())  # sin: not an instruction of the program

    with pytest.raises(program.Unsupported):
        program.lower(waves, True, [])
    q, k, v = _inputs(1, 64, 64, H, torch.float32)
    out = qkv.attention(q, k, v, backend="flash", score_mod=waves)
    assert ran == [False]
    expected = _exact(q, k, v, score_mod=waves)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_a_wrong_program_is_caught_by_the_proof(
    ran: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    lower = program.lower

    def planted(*args: Any) -> program.Code:
        code = lower(*args)
        return program.Code(code.ops, code.constants + 0.5, code.result)  # a constant off

    monkeypatch.setattr(program_call, "lower", planted)

    def shifted(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score - 0.25 * (qi - kv).abs()

    q, k, v = _inputs(1, 64, 100, H, torch.float32)
    with pytest.warns(UserWarning, match="differs from the mod"):
        out = qkv.attention(q, k, v, backend="flash", score_mod=shifted)
    assert ran == [False]
    expected = _exact(q, k, v, score_mod=shifted)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_block_states_of_a_mask() -> None:
    def diagonal(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (qi >= kv) & (qi - kv < 128)

    states = program_call.mask_states(diagonal, (1, 2, 300, 400))
    assert states.shape == (3, 4)
    empty, partial, full = program_call.EMPTY, program_call.PARTIAL, program_call.FULL
    assert states[1].tolist() == [partial, partial, empty, empty]
    assert states[2].tolist() == [empty, partial, partial, empty]
    assert states[0, 0] == partial and states[0, 1:].tolist() == [empty] * 3
    assert full not in states.tolist()


# --- the backward pass on the programs ---------------------------------------------------------

GRADIENT_CASES = {
    "softcap": ({"score_mod": SCORE_MODS["softcap"]}, (1, 200, 333, 2)),
    "alibi causal": ({"score_mod": SCORE_MODS["alibi"], "causal": True}, (2, 150, 150, 4)),
    "frozen table, documents": (
        {"score_mod": SCORE_MODS["relative table"], "mask_mod": MASK_MODS["documents"]},
        (1, 300, 600, 1),
    ),
    "t5 buckets, window": ({"score_mod": _t5, "mask_mod": MASK_MODS["window"]}, (1, 257, 257, 2)),
    "parity, empty rows": (
        {"score_mod": SCORE_MODS["rows and parity"], "mask_mod": MASK_MODS["rows only"]},
        (1, 130, 77, 4),
    ),
    # a derivative of one number (-0.75) for every pair: the backward pass runs no tangents
    "scaled and negated, causal": (
        {
            "score_mod": lambda score, b, h, qi, kv: 2.0 - score * 0.75 + (qi - kv) / 64,
            "causal": True,
        },
        (1, 300, 300, 2),
    ),
}


@pytest.fixture
def ran_backward(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each backward pass ran on the programs (True) or the exact path (False)."""
    seen: list[bool] = []
    backward = program_call.backward

    def spy(*args: Any) -> Any:
        result = backward(*args)
        seen.append(result is not None)
        return result

    monkeypatch.setattr(program_call, "backward", spy)
    return seen


def _gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "flash", **mods: Any
) -> list[torch.Tensor]:
    """out and the gradients of q, k, v of a fixed function of out and lse."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = qkv.attention(q, k, v, backend=backend, return_lse=True, **mods)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    loss = (out * weights).sum() + torch.where(lse.isfinite(), lse, 0).sum() * 0.1
    loss.backward()
    return [out.detach(), *(x.grad for x in (q, k, v))]  # type: ignore[misc]


def _exact_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mods: Any) -> Any:
    saved = program_call.ENABLED
    program_call.ENABLED = False
    try:
        return _gradients(q.double(), k.double(), v.double(), **mods)
    finally:
        program_call.ENABLED = saved


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradients_equal_the_exact_path_and_autograd(
    ran: list[bool], ran_backward: list[bool], name: str
) -> None:
    mods, shapes = GRADIENT_CASES[name]
    q, k, v = _inputs(*shapes, torch.float32)
    got = _gradients(q, k, v, **mods)
    assert ran[-1] and ran_backward == [True], "the call did not run on the programs"
    tol = 4 * TOLERANCE[torch.float32]
    for expected in (
        _exact_gradients(q, k, v, **mods),
        _gradients(q.double(), k.double(), v.double(), backend="reference", **mods),
    ):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)
    if name == "parity, empty rows":  # rows 2, 7, … see no key: 0 gradient
        assert bool((got[1][:, :, 2::5] == 0).all())


def test_gradients_gqa_bfloat16(ran: list[bool], ran_backward: list[bool]) -> None:
    mods = {"score_mod": SCORE_MODS["softcap"], "mask_mod": MASK_MODS["documents"]}
    q, k, v = _inputs(1, 257, 300, 1, torch.bfloat16)
    got = _gradients(q, k, v, **mods)
    assert ran[-1] and ran_backward == [True]
    for a, b in zip(got, _exact_gradients(q, k, v, **mods), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, atol=0.05, rtol=0.05)


def test_a_learned_table_takes_the_exact_path(ran: list[bool]) -> None:
    table = TABLE.clone().requires_grad_()

    def learned(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + table[h, qi - kv + 599]

    q, k, v = _inputs(1, 100, 100, H, torch.float32)
    qkv.attention(q, k, v, backend="flash", score_mod=learned).sum().backward()
    assert ran == [False]
    assert table.grad is not None and bool(table.grad.abs().sum() > 0)


def test_a_wrong_derivative_is_caught_by_the_proof(
    ran: list[bool], ran_backward: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = kernel.load()

    class Planted:  # the kernel, its programs' derivative off by a half
        def __getattr__(self, name: str) -> Any:
            return getattr(module, name)

        def evaluate_program(self, *args: Any) -> Any:
            got, keep, slope = module.evaluate_program(*args)
            return got, keep, slope * 1.5

    monkeypatch.setattr(program_call.kernel, "load", lambda: Planted())

    def capped(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return 15.0 * torch.tanh(score / 15.0)

    q, k, v = _inputs(1, 64, 100, H, torch.float32)
    with pytest.warns(UserWarning, match="score_mod's derivative"):
        got = _gradients(q, k, v, score_mod=capped)
    assert ran == [False] and ran_backward == []
    tol = 4 * TOLERANCE[torch.float32]
    for a, b in zip(got, _exact_gradients(q, k, v, score_mod=capped), strict=True):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)
