"""Gradients through score_mod / mask_mod: to q, k, v and to the tensors a score_mod captures
(a learned relative-position table, learned ALiBi slopes, a T5 bucket bias), against the float64
oracle and torch.autograd.gradcheck; deterministic; the compiled tile step agrees."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flex_rules import (
    alibi,
    both,
    causal,
    chain,
    documents,
    oracle,
    relative_bias,
    softcap,
    t5_bias,
)

import qkv
from qkv.backends.flash import mods as flash_mods

B, H, L, D = 2, 2, 300, 8


def learned(name: str, length: int = L) -> tuple[Any, Any, torch.Tensor]:
    """(score_mod, mask_mod, the learned tensor it captures), float64."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (length,), generator=gen).sort().values
    if name == "relative bias":
        table = torch.randn(2 * length - 1, dtype=torch.float64, generator=gen).requires_grad_()
        return relative_bias(table, length), causal, table
    if name == "alibi":
        slopes = torch.rand(H, dtype=torch.float64, generator=gen).requires_grad_()
        return chain(alibi(slopes), softcap(4.0)), both(documents(ids), causal), slopes
    bias = torch.randn(H, 8, dtype=torch.float64, generator=gen).requires_grad_()
    return t5_bias(bias), documents(ids), bias


def tensors(length: int = L, hkv: int = H) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = ((B, H, length, D), (B, hkv, length, D), (B, hkv, length, D))
    return [torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_() for s in shapes]


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("name", ["relative bias", "alibi", "t5 buckets"])
def test_gradients_reach_q_k_v_and_the_captured_tensor(backend: str, name: str) -> None:
    score_mod, mask_mod, captured = learned(name)
    q, k, v = tensors()
    inputs = (q, k, v, captured)
    out, lse = qkv.attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend, return_lse=True
    )
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    grad_lse = torch.randn(lse.shape, dtype=lse.dtype, generator=gen)
    loss = (out * grad_out).sum() + (lse.nan_to_num(neginf=0.0) * grad_lse).sum()
    got = torch.autograd.grad(loss, inputs)
    out_o, lse_o = oracle(q, k, v, score_mod, mask_mod)
    loss_o = (out_o * grad_out).sum() + (lse_o.nan_to_num(neginf=0.0) * grad_lse).sum()
    expected = torch.autograd.grad(loss_o, inputs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert float(got[3].abs().sum()) > 0


def test_gradcheck_on_tiny_sizes() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=gen) for _ in range(3))
    table = torch.randn(9, dtype=torch.float64, generator=gen)
    ids = torch.tensor([0, 0, 1, 1, 1])

    def run(q: Any, k: Any, v: Any, table: Any) -> Any:
        def score_mod(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
            return score * 0.5 + table[qi - kv + 4]

        return qkv.attention(
            q, k, v, score_mod=score_mod, mask_mod=documents(ids), softcap=3.0, backend="flash"
        )

    args = tuple(x.requires_grad_() for x in (q, k, v, table))
    assert torch.autograd.gradcheck(run, args)


def test_gqa_fully_masked_rows_and_determinism() -> None:
    score_mod, _, table = learned("relative bias")

    def late(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (qi >= 10) & (qi >= kv)

    q, k, v = tensors(hkv=1)
    q4 = torch.cat([q, q.flip(1)], dim=1).detach().requires_grad_()
    runs = []
    for _ in range(2):
        out = qkv.attention(q4, k, v, score_mod=score_mod, mask_mod=late, backend="flash")
        runs.append(torch.autograd.grad(out.square().sum(), (q4, k, v, table)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)  # the same computation twice: bit for bit
    dq = runs[0][0]
    assert torch.equal(dq[..., :10, :], torch.zeros_like(dq[..., :10, :]))
    out_o = oracle(q4, k, v, score_mod, late)[0]
    expected = torch.autograd.grad(out_o.square().sum(), (q4, k, v, table))
    for a, b in zip(runs[0], expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_flex_attention_trains_with_a_block_mask() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    score_mod, mask_mod, slopes = learned("alibi")
    q, k, v = tensors()
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu")
    out = qkv.flex_attention(q, k, v, score_mod, block_mask)
    got = torch.autograd.grad(out.sum(), (q, k, v, slopes))
    expected = torch.autograd.grad(oracle(q, k, v, score_mod, mask_mod)[0].sum(), (q, k, v, slopes))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_captured_tensors_are_found_or_the_call_refuses() -> None:
    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(2 * L - 1, dtype=torch.float64))

        def score_mod(self, score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
            return score + self.table[qi - kv + L - 1]

    module = Biased()
    q, k, v = tensors()
    out = qkv.attention(q, k, v, score_mod=module.score_mod, backend="flash")
    out.sum().backward()
    assert module.table.grad is not None and float(module.table.grad.abs().sum()) > 0

    class Holder:  # not callable: qkv does not look inside it
        table = torch.randn(2 * L - 1, dtype=torch.float64, requires_grad=True)

    holder = Holder()

    def hidden(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + holder.table[qi - kv + L - 1]

    with pytest.raises(ValueError, match="not in its closure or globals"):
        qkv.attention(q, k, v, score_mod=hidden, backend="flash")


def test_compiled_tile_step_agrees_with_the_plain_loop() -> None:
    score_mod, mask_mod, _ = learned("t5 buckets", length=200)
    q, k, v = (x.detach().float() for x in tensors(length=200))
    score_mod = t5_bias(torch.randn(H, 8))
    plain = qkv.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="flash")
    with flash_mods.settings(compile="1"):
        compiled = qkv.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="flash")
    torch.testing.assert_close(compiled, plain, atol=1e-5, rtol=1e-5)


def test_the_ported_attention_gym_example_trains(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/flex_alibi_documents.py: ALiBi + document mask via qkv.flex_attention trains
    (loss falls, the learned slopes move) and agrees with torch's forward."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "flex_alibi_documents.py"
    example = runpy.run_path(str(path))
    result = example["main"](steps=12)
    assert result["last"] < result["first"]
    assert result["moved"] > 0
    assert result["difference"] < 1e-5
    assert "qkv.flex_attention vs torch's flex_attention" in capsys.readouterr().out


def test_gradients_with_qkv_arguments_sinks_and_slopes_match_the_reference() -> None:
    score_mod, mask_mod, table = learned("relative bias")
    q, k, v = tensors()
    sinks = torch.randn(H, dtype=torch.float64).requires_grad_()
    slopes = torch.rand(H, dtype=torch.float64).requires_grad_()
    ids = torch.arange(L) // 100
    inputs = (q, k, v, table, sinks, slopes)
    results = []
    for backend in ("flash", "reference"):
        out, lse = qkv.attention(
            q,
            k,
            v,
            score_mod=score_mod,
            mask_mod=mask_mod,
            backend=backend,
            sinks=sinks,
            alibi_slopes=slopes,
            softcap=4.0,
            window=(50, None),
            segments=ids,
            return_lse=True,
        )
        results.append(torch.autograd.grad((out * out).sum() + lse.sum(), inputs))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_score_mod_that_ignores_the_score_passes_no_gradient_through_it() -> None:
    q, k, v = tensors(length=40)
    bias = torch.randn(40, dtype=torch.float64)

    def constant(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return torch.zeros_like(score) + bias[kv]

    for backend in ("flash", "reference"):
        out = qkv.attention(q, k, v, score_mod=constant, mask_mod=causal, backend=backend)
        dq, dv = torch.autograd.grad(out.sum(), (q, v), allow_unused=True)
        assert dq is None or not bool(dq.any())  # the weights do not depend on q
        assert bool(dv.any())
