"""Every mod FlexAttention accepts, on every backend that takes mods and in qkv.flex_attention:
the mods of torch's own FlexAttention tests (``flex_mods``) and of attention-gym (``flex_gym``),
and results of every broadcast shape (``BROADCAST``), against torch's eager ``flex_attention``
in float64 (its forward is the meaning) and, for the gradients of q, k, v and the captured
tensors, against a float64 autograd of the same mods (``flex_rules.oracle``). Lengths are not
multiples of the loop's tiles (256 queries), Lq ≠ Lk both ways, with grouped-query heads; rows
emptied by a score_mod or a mask_mod give 0, lse −inf and 0 gradient. Planted mistakes (an
occupancy that ignores a broadcast axis, an emptied row turned into NaN) make the checks fail.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from flex_gym import gym_cases
from flex_mods import (
    Case,
    Sizes,
    torch_captured,
    torch_decoding,
    torch_inline_masks,
    torch_inline_scores,
    torch_lists,
)
from flex_rules import oracle, seeded_inputs
from oracle import TOLERANCE
from torch.nn.attention import flex_attention as torch_flex

import qkv
from qkv.backends.flash import mods as flash_mods

B, D = 2, 8
# (Lq, Lk, Hq, Hkv): two query tiles against a short key range, and the other way round
GEOMETRIES = [(300, 37, 2, 1), (37, 300, 2, 2)]
BACKENDS = ["reference", "flash", "auto"]


def _broadcast(s: Sizes) -> dict[str, Case]:
    """Results of every shape FlexAttention broadcasts: 0-dim, per query, per key, per head,
    per batch entry, for score_mod and mask_mod (those that empty rows included)."""
    per_head, per_batch, per_query = s.randn(s.heads), s.randn(s.batch), s.randn(s.n)
    return {
        "0-dim score": Case(lambda sc, b, h, q, kv: torch.full((), 0.5, dtype=sc.dtype), None),
        "per-query score": Case(lambda sc, b, h, q, kv: per_query[q].to(sc.dtype), None),
        "per-key score": Case(lambda sc, b, h, q, kv: (kv % 5).to(sc.dtype) * 0.3, None),
        "per-head score": Case(lambda sc, b, h, q, kv: per_head[h].to(sc.dtype), None),
        "per-batch score": Case(lambda sc, b, h, q, kv: per_batch[b].to(sc.dtype), None),
        "score -inf rows": Case(
            lambda sc, b, h, q, kv: torch.where(q % 7 == 3, -float("inf"), sc), None
        ),
        "noop_mask": Case(None, torch_flex.noop_mask),
        "0-dim False mask": Case(None, lambda b, h, q, kv: b.new_zeros((), dtype=torch.bool)),
        "per-query mask": Case(None, lambda b, h, q, kv: q < 150),
        "per-key mask": Case(None, lambda b, h, q, kv: kv % 3 != 0),
        "per-head mask": Case(None, lambda b, h, q, kv: h != 1),
        "per-batch mask": Case(None, lambda b, h, q, kv: b == 0),
        "per-batch-and-head mask": Case(None, lambda b, h, q, kv: (b + h) % 3 != 1),
    }


def all_cases(s: Sizes) -> dict[str, Case]:
    return {
        **_broadcast(s),
        **torch_lists(s),
        **torch_captured(s),
        **torch_inline_scores(s),
        **torch_inline_masks(s),
        **torch_decoding(s),
        **gym_cases(s),
    }


NAMES = list(all_cases(Sizes(B, 2, 300, 37)))


def inputs(lq: int, lk: int, hq: int, hkv: int, dtype: torch.dtype = torch.float64) -> Any:
    return seeded_inputs(((B, hq, lq, D), (B, hkv, lk, D), (B, hkv, lk, D)), dtype)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():  # torch's eager FlexAttention warns that it is unfused
        warnings.simplefilter("ignore", UserWarning)
        yield


def torch_eager(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any) -> Any:
    """(out, lse) of torch's eager flex_attention: what ``torch_flex.flex_attention`` runs on the
    CPU (its higher-order operator's dense implementation), without the dynamo trace it wraps
    around each new mod (a second per mod); ``test_torch_eager_is_torchs_flex_attention``
    shows they agree. Its lse is in base 2."""
    from torch._higher_order_ops.flex_attention import flex_attention as operator

    if block_mask is None:
        block_mask = torch_flex._create_empty_block_mask(q, k)
    score_mod = score_mod or (lambda score, b, h, q_idx, kv_idx: score)
    options = {"PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "OUTPUT_LOGSUMEXP": True}
    scale = q.shape[-1] ** -0.5
    out, lse, *_ = operator(q, k, v, score_mod, block_mask.as_tuple(), scale, options, (), ())
    return out, lse * math.log(2.0)


def test_torch_eager_is_torchs_flex_attention() -> None:
    lq, lk, hq, hkv = GEOMETRIES[0]
    cases = all_cases(Sizes(B, hq, lq, lk))
    q, k, v = inputs(lq, lk, hq, hkv)
    score_mod = cases["torch all_bias"].score_mod  # (one call: dynamo traces each new mod)
    mask_mod = cases["gym doc_mask_mod causal"].mask_mod
    block_mask = torch_flex.create_block_mask(mask_mod, B, hq, lq, lk, device="cpu")
    want = torch_flex.flex_attention(
        q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True
    )
    got = torch_eager(q, k, v, score_mod, block_mask)
    assert got[1].isinf().any()  # (rows that the documents and causality empty)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def check_forward(name: str, geometry: tuple[int, int, int, int]) -> None:
    """qkv.flex_attention and qkv.attention on each backend equal torch's eager flex_attention
    (out and lse, float64); AssertionError naming the path otherwise."""
    lq, lk, hq, hkv = geometry
    case = all_cases(Sizes(B, hq, lq, lk))[name]
    q, k, v = inputs(lq, lk, hq, hkv)
    block_mask = None
    if case.mask_mod is not None:
        block_mask = torch_flex.create_block_mask(case.mask_mod, B, hq, lq, lk, device="cpu")
    gqa = hq != hkv
    want = torch_eager(q, k, v, case.score_mod, block_mask)
    got = {
        "flex_attention": qkv.flex_attention(
            q, k, v, case.score_mod, block_mask, enable_gqa=gqa, return_lse=True
        )
    }
    for backend in BACKENDS:
        got[backend] = qkv.attention(
            q,
            k,
            v,
            score_mod=case.score_mod,
            mask_mod=case.mask_mod,
            backend=backend,
            return_lse=True,
        )
    atol, rtol = TOLERANCE[torch.float64]
    for path, (out, lse) in got.items():
        where = f"{name} on {path}, (Lq, Lk, Hq, Hkv) = {geometry}"
        assert not out.isnan().any(), f"NaN output: {where}"
        torch.testing.assert_close(
            out, want[0], atol=atol, rtol=rtol, msg=lambda m, where=where: f"{where}: {m}"
        )
        torch.testing.assert_close(
            lse, want[1], atol=atol, rtol=rtol, msg=lambda m, where=where: f"{where}: {m}"
        )


@pytest.mark.parametrize("name", NAMES)
def test_every_mod_equals_torchs_flex_attention(name: str) -> None:
    """The broadcast shapes both ways round; the ported mods one way each, in turn."""
    index = NAMES.index(name)
    both = index < len(_broadcast(Sizes(B, 2, 300, 37)))
    for geometry in GEOMETRIES if both else [GEOMETRIES[index % 2]]:
        check_forward(name, geometry)


def check_gradients(
    name: str, geometry: tuple[int, int, int, int], paths: list[str], dtype: torch.dtype
) -> None:
    """Gradients of q, k, v and the captured tensors through out and lse (random cotangents,
    also on rows with nothing left) equal the float64 oracle's, on each of ``paths``."""
    lq, lk, hq, hkv = geometry
    atol, rtol = TOLERANCE[dtype]
    for path in paths:
        case = all_cases(Sizes(B, hq, lq, lk, learned=True))[name]
        tensors = [x.requires_grad_() for x in inputs(lq, lk, hq, hkv, dtype)]
        sources = [*tensors, *case.learned]
        want = oracle(*tensors, case.score_mod, case.mask_mod)
        got = _call(path, tensors, case)
        gen = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
        used = [i for i, w in enumerate(want) if w.requires_grad]  # (lse of a constant score)
        expected = torch.autograd.grad(
            [want[i] for i in used], sources, [cotangents[i] for i in used], allow_unused=True
        )
        grads = torch.autograd.grad(
            [got[i] for i in used],
            sources,
            [cotangents[i].to(got[i].dtype) for i in used],
            allow_unused=True,
        )
        for label, g, e in zip(["q", "k", "v", "captured"] * 2, grads, expected, strict=False):
            if e is None:
                continue
            where = f"d{label} of {name} on {path} ({dtype}, (Lq, Lk, Hq, Hkv) = {geometry})"
            assert g is not None and not g.isnan().any(), f"missing or NaN: {where}"
            torch.testing.assert_close(
                g.double(),
                e.double(),
                atol=atol,
                rtol=rtol,
                msg=lambda m, where=where: f"{where}: {m}",
            )


def _call(path: str, tensors: list[torch.Tensor], case: Case) -> Any:
    q, k, v = tensors
    if path != "flex_attention":
        return qkv.attention(
            q,
            k,
            v,
            score_mod=case.score_mod,
            mask_mod=case.mask_mod,
            backend=path,
            return_lse=True,
        )
    block_mask = None
    if case.mask_mod is not None:
        lq, lk = q.shape[-2], k.shape[-2]
        block_mask = torch_flex.create_block_mask(case.mask_mod, B, q.shape[1], lq, lk, "cpu")
    return qkv.flex_attention(q, k, v, case.score_mod, block_mask, enable_gqa=True, return_lse=True)


@pytest.mark.parametrize("name", NAMES)
def test_every_mod_differentiates_like_a_float64_autograd(name: str) -> None:
    index = NAMES.index(name)
    paths = ["flash", "reference"] + (["auto", "flex_attention"] if index % 3 == 0 else [])
    check_gradients(name, GEOMETRIES[(index + 1) % 2], paths, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast_results_in_float32_and_bfloat16(dtype: torch.dtype) -> None:
    for name in _broadcast(Sizes(B, 2, 300, 37)):
        check_gradients(name, GEOMETRIES[0], ["flash", "reference"], dtype)


def test_a_planted_occupancy_that_ignores_a_broadcast_axis_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flash's block occupancy that reads only the first batch entry and head of a mask_mod's
    result: the per-batch mask's second batch entry then attends keys it may not."""
    columns = flash_mods._columns

    def first_only(keep: torch.Tensor, keys: int) -> Any:
        return columns(keep[:1, :1] if keep.dim() == 4 else keep, keys)

    check_forward("per-batch mask", GEOMETRIES[0])  # (as it is: passes)
    monkeypatch.setattr(flash_mods, "_columns", first_only)
    with pytest.raises(AssertionError, match="per-batch mask on"):
        check_forward("per-batch mask", GEOMETRIES[0])


def test_a_planted_nan_for_a_row_a_score_mod_empties_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reference backend without the pairs a score_mod blocks (−inf) in its keep-mask: a row
    the score_mod empties is then softmax of −inf only, NaN."""
    check_forward("score -inf rows", GEOMETRIES[0])  # (as it is: passes)
    monkeypatch.setattr(qkv.mods, "kept", lambda scores: torch.ones_like(scores, dtype=torch.bool))
    with pytest.raises(AssertionError, match="NaN output: score -inf rows on reference"):
        check_forward("score -inf rows", GEOMETRIES[0])
