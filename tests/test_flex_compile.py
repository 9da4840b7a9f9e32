"""score_mod / mask_mod inside torch.compile: a function calling ``qkv.attention`` with mods
(each backend that takes them) or ``qkv.flex_attention`` with a BlockMask compiles with
``fullgraph=True`` and no graph break (``torch._dynamo.utils.counters``, as tests/test_compile.py
counts them); out, lse and the gradients of q, k, v and of the tensors the score_mod captures
equal eager's at float32's tolerance. The mods include one written for one score at a time
(``torch.dot`` of gathered rows), one that empties rows, and results that broadcast.
Compiled with the "aot_eager" backend (dynamo's trace and AOT autograd without inductor's code
generation, which costs seconds per graph)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from oracle import TOLERANCE
from torch._dynamo.utils import counters
from torch.nn.attention import flex_attention as torch_flex

import qkv

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 40, 30, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _learned() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(q, k, v) and the captured tensors (a relative-position table, rotary rows), float32."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, D), (LQ + LK,), (B, HQ, LQ, 4)]
    made = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    return made[:3], made[3:]


def _mods(captured: list[torch.Tensor]) -> dict[str, tuple[Any, Any]]:
    table, rope_q = captured
    rope_k = torch.randn(B, 1, LK, 4, generator=torch.Generator().manual_seed(1))

    def relative(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.where(q_idx % 7 == 3, -math.inf, score + table[q_idx - kv_idx + LK])

    def rotary(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # one score at a time
        return score + torch.dot(rope_q[b, h, q_idx], rope_k[b, 0, kv_idx])

    return {
        "relative bias, emptied rows, causal-or-batch": (
            relative,
            lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (b == 1),
        ),
        "rotary dot, per-query mask": (rotary, lambda b, h, q_idx, kv_idx: q_idx < 25),
        "per-head score, noop_mask": (
            lambda score, b, h, q_idx, kv_idx: score * (h + 1).to(score.dtype),
            torch_flex.noop_mask,
        ),
    }


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _compare(fn: Callable[..., Any], tensors: list[torch.Tensor], sources: list[Any]) -> None:
    """``fn`` compiled whole equals ``fn`` eager: outputs and the gradients of ``sources``."""
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*tensors), fn(*tensors)
    assert _graph_breaks() == 0
    atol, rtol = TOLERANCE[torch.float32]
    gen = torch.Generator().manual_seed(2)
    cotangents = [torch.randn(w.shape, generator=gen) for w in want]
    got_grads = torch.autograd.grad(got, sources, cotangents, allow_unused=True)
    want_grads = torch.autograd.grad(want, sources, cotangents, allow_unused=True)
    for g, w in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("backend", "name"),
    list(zip(["flash", "auto", "reference"], list(_mods(_learned()[1])), strict=True)),
)
def test_attention_with_mods_compiles_whole(backend: str, name: str) -> None:
    tensors, captured = _learned()
    score_mod, mask_mod = _mods(captured)[name]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        out, lse = qkv.attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend, return_lse=True
        )
        return out, torch.where(lse.isfinite(), lse, 0.0)  # (−inf on the emptied rows)

    _compare(fn, tensors, [*tensors, *captured])


def test_flex_attention_with_a_block_mask_compiles_whole() -> None:
    tensors, captured = _learned()
    score_mod, mask_mod = _mods(captured)["relative bias, emptied rows, causal-or-batch"]
    block_mask = torch_flex.create_block_mask(mask_mod, B, HQ, LQ, LK, device="cpu")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        out = qkv.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        return (out,)

    _compare(fn, tensors, [*tensors, *captured])
