"""score_mod / mask_mod and qkv.flex_attention, forward: agreement with torch's FlexAttention
(eager, CPU) and with a float64 oracle on attention-gym's rules, the combination with qkv's own
arguments, block skipping, and the errors."""

from __future__ import annotations

import warnings
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
    prefix_lm,
    relative_bias,
    seeded_inputs,
    sliding_window,
    softcap,
    t5_bias,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import TOLERANCE
from torch.nn.attention import flex_attention as torch_flex

import qkv
from qkv.backends.base import Unsupported
from qkv.backends.flash import mods as flash_mods

B, H, L, D = 2, 3, 333, 16  # odd length: two query tiles, a short last one


def gym_rules(
    length: int = L, heads: int = H, dtype: torch.dtype = torch.float64
) -> dict[str, tuple[Any, Any]]:
    """name -> (score_mod, mask_mod) of attention-gym's examples, tables in ``dtype``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4, (length,), generator=gen).sort().values
    slopes = torch.rand(heads, generator=gen, dtype=torch.float64).to(dtype)
    table = torch.randn(2 * length - 1, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(heads, 8, generator=gen, dtype=torch.float64).to(dtype)
    return {
        "causal": (None, causal),
        "sliding window": (None, sliding_window(40)),
        "prefix-LM": (None, prefix_lm(50)),
        "documents": (None, documents(ids)),
        "alibi": (alibi(slopes), causal),
        "softcap": (softcap(2.0), None),
        "relative bias": (relative_bias(table, length), None),
        "t5 buckets": (t5_bias(bias), None),
        "combination": (chain(alibi(slopes), softcap(3.0)), both(documents(ids), causal)),
    }


def inputs(dtype: torch.dtype = torch.float64, hkv: int = H, length: int = L) -> list[Any]:
    return seeded_inputs(((B, H, length, D), (B, hkv, length, D), (B, hkv, length, D)), dtype)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():  # torch's eager FlexAttention warns that it is unfused
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("name", list(gym_rules()))
def test_flex_attention_agrees_with_torch_and_the_oracle(name: str) -> None:
    score_mod, mask_mod = gym_rules()[name]
    q, k, v = inputs()
    block_mask = None
    if mask_mod is not None:
        block_mask = torch_flex.create_block_mask(mask_mod, None, None, L, L, device="cpu")
    out, lse = qkv.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    theirs = torch_flex.flex_attention(q, k, v, score_mod, block_mask)
    expected, expected_lse = oracle(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, theirs, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, expected_lse, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
@pytest.mark.parametrize("name", ["documents", "relative bias", "combination"])
def test_attention_takes_mods_on_every_backend_that_can(backend: str, name: str) -> None:
    score_mod, mask_mod = gym_rules()[name]
    q, k, v = inputs()
    out = qkv.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend)
    torch.testing.assert_close(out, oracle(q, k, v, score_mod, mask_mod)[0], atol=1e-10, rtol=0)


def test_sdpa_refuses_mods_with_the_reason() -> None:
    q, k, v = inputs(length=8)
    with pytest.raises(Unsupported, match="score_mod or mask_mod"):
        qkv.attention(q, k, v, mask_mod=causal, backend="sdpa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_and_gqa(dtype: torch.dtype) -> None:
    score_mod, mask_mod = gym_rules(heads=6, dtype=torch.float32)["combination"]
    q, k, v = inputs(dtype, hkv=3)
    q = torch.cat([q, q.flip(1)], dim=1)  # 6 query heads over 3 key/value heads
    out = qkv.flex_attention(
        q,
        k,
        v,
        score_mod,
        torch_flex.create_block_mask(mask_mod, None, None, L, L, "cpu"),
        enable_gqa=True,
    )
    assert out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    expected = oracle(q, k, v, score_mod, mask_mod)[0]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_fully_masked_rows_give_zero_and_lse_minus_inf() -> None:
    q, k, v = inputs(length=300)

    def late(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (qi >= 20) & (kv <= qi)

    for backend in ("reference", "flash"):
        out, lse = qkv.attention(q, k, v, mask_mod=late, backend=backend, return_lse=True)
        assert torch.equal(out[..., :20, :], torch.zeros_like(out[..., :20, :]))
        assert bool((lse[..., :20] == float("-inf")).all())
        assert bool(out.isfinite().all())


def test_order_score_mod_then_softcap_alibi_mask_and_every_rule_combines() -> None:
    """score_mod sees the scaled score; qkv's softcap, ALiBi, float mask, window, segments,
    sinks and causal rule apply to what it returns (flash == reference == the formula)."""
    q, k, v = inputs(length=300)
    table = torch.randn(599, dtype=torch.float64)
    score_mod = relative_bias(table, 300)
    ids = torch.arange(300) // 100
    slopes, sinks = torch.rand(H, dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    bias = torch.randn(300, 300, dtype=torch.float64)
    kwargs: dict[str, Any] = {
        "softcap": 5.0,
        "alibi_slopes": slopes,
        "mask": bias,
        "window": 64,
        "causal": True,
        "segments": ids,
        "sinks": sinks,
        "return_lse": True,
    }
    mask_mod = prefix_lm(10)
    ref = qkv.attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="reference", **kwargs
    )
    got = qkv.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="flash", **kwargs)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)

    # The documented order, written out: softcap(score_mod(s)) + ALiBi + float mask.
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    s = q @ k.transpose(-2, -1) / D**0.5 + table[i - j + 299]
    s = 5.0 * torch.tanh(s / 5.0) - slopes[:, None, None] * (i - j).abs() + bias
    keep = (j <= i) & (j > i - 64) & (ids[i] == ids[j]) & ((j < 10) | (i >= j))
    s = torch.cat(
        [s.masked_fill(~keep, float("-inf")), sinks[:, None, None].expand(B, H, 300, 1)], -1
    )
    expected = torch.softmax(s, -1)[..., :300] @ v
    torch.testing.assert_close(ref[0], expected, atol=1e-10, rtol=1e-10)


def test_block_skipping_evaluates_fewer_tiles_and_changes_nothing() -> None:
    q, k, v = inputs(length=1500)
    ids = torch.arange(1500) // 150  # 10 documents
    calls = []

    def counted(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        calls.append(kv.numel())
        return score * 1.5

    mask_mod = documents(ids)
    skipped = qkv.attention(q, k, v, score_mod=counted, mask_mod=mask_mod, backend="flash")
    looked_at = sum(calls)
    calls.clear()
    with flash_mods.settings(skip=False):
        every = qkv.attention(q, k, v, score_mod=counted, mask_mod=mask_mod, backend="flash")
    torch.testing.assert_close(skipped, every, atol=1e-12, rtol=0)
    assert looked_at * 2 < sum(calls)


def test_occupancy_is_found_once_for_a_repeated_mask_mod() -> None:
    q, k, v = inputs(length=600)
    calls = []

    def counted(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        calls.append(1)
        return qi >= kv

    qkv.attention(q, k, v, mask_mod=counted, backend="flash")
    first = len(calls)
    calls.clear()
    qkv.attention(q, k, v, mask_mod=counted, backend="flash")
    assert 0 < len(calls) < first  # the second call evaluates only the tiles it runs


def test_block_mask_sparsity_is_authoritative() -> None:
    """Blocks a BlockMask leaves out stay masked, full blocks are not masked, as torch's
    compiled kernels do (its eager CPU path evaluates the mask_mod densely instead)."""
    q, k, v = inputs(length=256)
    block_mask = torch_flex.create_block_mask(causal, None, None, 256, 256, "cpu", BLOCK_SIZE=64)
    kv_num = block_mask.kv_num_blocks.clone()
    kv_num[..., 2] = 0  # query block 2 loses its partial (diagonal) block
    edited = torch_flex.BlockMask.from_kv_blocks(
        kv_num,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=64,
        mask_mod=causal,
    )
    out = qkv.flex_attention(q, k, v, block_mask=edited)
    blocks = edited.to_dense()[0, 0].bool().repeat_interleave(64, 0).repeat_interleave(64, 1)

    def listed(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return blocks[qi, kv] & (qi >= kv)

    torch.testing.assert_close(out, oracle(q, k, v, None, listed)[0], atol=1e-10, rtol=1e-10)
    assert not torch.allclose(out, oracle(q, k, v, None, causal)[0])


def test_errors_say_what_went_wrong() -> None:
    q, k, v = inputs(length=300)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"score_mod": lambda s, b, h, i, j: s.sum(-1)}, ValueError, "one value per score"),
        ({"score_mod": lambda s, b, h, i, j: i - j}, TypeError, "floating tensor"),
        ({"score_mod": lambda s, b, h, i, j: 0.5}, TypeError, "must return a tensor"),
        ({"mask_mod": lambda b, h, i, j: True}, TypeError, "must return a tensor"),
        (
            {"score_mod": lambda s, b, h, i, j: s - s.amax(-1, keepdim=True)},
            ValueError,
            "not elementwise",
        ),
        ({"score_mod": lambda s, b, h, i, j: s.cumsum(-2)}, ValueError, "not elementwise"),
        ({"mask_mod": lambda b, h, i, j: (i - j).float()}, TypeError, "bool"),
        ({"score_mod": lambda s, b, h: s}, TypeError, "5 positional arguments"),
        ({"mask_mod": 3}, TypeError, "callable"),
    ]
    for backend in ("reference", "flash"):
        for kwargs, error, message in cases:
            with pytest.raises(error, match=message):
                qkv.attention(q, k, v, backend=backend, **kwargs)
    block_mask = torch_flex.create_block_mask(causal, None, None, 256, 256, "cpu")
    with pytest.raises(ValueError, match="made for lengths"):
        qkv.flex_attention(q, k, v, block_mask=block_mask)
    with pytest.raises(ValueError, match="enable_gqa"):
        qkv.flex_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(TypeError, match="BlockMask"):
        qkv.flex_attention(q, k, v, block_mask=torch.ones(300, 300, dtype=torch.bool))


def test_the_tile_mods_use_the_loops_query_tile() -> None:
    from qkv.backends.flash import loop

    assert flash_mods.QUERY_TILE == loop.QUERY_TILE


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_empty_sequences_and_several_batch_dims(backend: str) -> None:
    def doubled(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score * 2

    for lq, lk in ((0, 5), (5, 0), (0, 0)):
        q, k, v = torch.randn(1, 2, lq, 4), torch.randn(1, 2, lk, 4), torch.randn(1, 2, lk, 4)
        out = qkv.attention(q, k, v, score_mod=doubled, mask_mod=causal, backend=backend)
        assert out.shape == (1, 2, lq, 4) and not bool(out.any())
    # b counts the batch dims flattened: (3, 2) batch entries are b = 0 ... 5
    q, k, v = (torch.randn(3, 2, 2, 70, 4, dtype=torch.float64) for _ in range(3))
    per_entry = torch.randn(6, dtype=torch.float64)

    def by_entry(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + per_entry[b] * (qi - kv)

    out = qkv.attention(q, k, v, score_mod=by_entry, mask_mod=causal, backend=backend)
    flat = oracle(*(x.reshape(6, 2, 70, 4) for x in (q, k, v)), by_entry, causal)[0]
    torch.testing.assert_close(out, flat.view(3, 2, 2, 70, 4), atol=1e-10, rtol=1e-10)


@settings(deadline=None)
@given(
    lq=st.integers(1, 300),
    lk=st.integers(1, 600),
    hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    count=st.integers(1, 6),
    causal_too=st.booleans(),
)
def test_flash_equals_the_reference_for_any_sizes(
    lq: int, lk: int, hkv: int, groups: int, count: int, causal_too: bool
) -> None:
    """Property: flash's tiles (skipped, trimmed, full, partial) give the reference's dense
    answer, for any lengths, heads and grouping, forward and log-sum-exp, in float64."""
    gen = torch.Generator().manual_seed(lq * 1000 + lk)
    q = torch.randn(1, hkv * groups, lq, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, lk, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    ids = torch.randint(0, count, (max(lq, lk),), generator=gen).sort().values
    table = torch.randn(lq + lk, generator=gen, dtype=torch.float64)
    score_mod = relative_bias(table, lk)
    mask_mod = both(documents(ids), causal) if causal_too else documents(ids)
    kwargs: dict[str, Any] = {"score_mod": score_mod, "mask_mod": mask_mod, "return_lse": True}
    flash = qkv.attention(q, k, v, backend="flash", **kwargs)
    reference = qkv.attention(q, k, v, backend="reference", **kwargs)
    for a, b in zip(flash, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
