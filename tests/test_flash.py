"""The flash backend's own machinery: tiles, its forward/backward kernel API, memory.

The contract itself (masks, causal rules, dtypes, NaN, empty inputs...) is checked for every
backend, flash included, in test_functional.py. Here: tile boundaries and skipped tiles, the
log-sum-exp, ``backward`` against autograd, the block-split property ring attention relies on,
gradcheck, memory that stays below one score matrix, and the rule "auto" follows.
Legend: B batch, H heads, Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import TOLERANCE, oracle
from torch.profiler import ProfilerActivity, profile

import qkv
from qkv.backends import dispatch, flash
from qkv.backends.base import Call, Unsupported
from qkv.backends.flash import kernel as flash_kernel
from qkv.backends.flash import loop as flash_loop

f64 = torch.float64


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash's PyTorch loop for every call, never the compiled kernel."""
    monkeypatch.setattr(flash_kernel, "ENABLED", False)


@pytest.fixture
def tiny_tiles(loop: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop with tiles of 5 queries × 7 keys, so small inputs cross many tile boundaries."""
    monkeypatch.setattr(flash, "QUERY_TILE", 5)
    monkeypatch.setattr(flash, "KEY_TILE", 7)


def randn(*shape: int, dtype: torch.dtype = f64) -> torch.Tensor:
    return torch.randn(shape, dtype=f64).to(dtype)


def reference_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """(*B, Hq, Lq) log-sum-exp of the scaled, masked scores, in float64 (−inf: no key)."""
    k = k.double().repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q.double() @ k.transpose(-2, -1) * scale
    lq, lk = scores.shape[-2:]
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.double()
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal_offset is not None:
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + causal_offset
    if mask is not None:
        keep = keep & (mask if mask.dtype == torch.bool else mask != -math.inf)
    return scores.masked_fill(~keep, -math.inf).logsumexp(dim=-1)


# --- tiles -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lq, lk", [(1, 1), (5, 7), (6, 8), (13, 29), (29, 13), (11, 0)])
@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_sizes_that_are_not_multiples_of_the_tile(
    tiny_tiles: None, lq: int, lk: int, causal: bool | str, mask_kind: str | None
) -> None:
    q, k, v = randn(2, 4, lq, 6), randn(2, 2, lk, 6), randn(2, 2, lk, 3)  # grouped heads, Dv≠Dk
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, lq, lk) > 0.4
        mask[..., 0, :] = False  # a row with no key
    elif mask_kind == "float":
        mask = randn(lq, lk).masked_fill(torch.rand(lq, lk) < 0.4, -math.inf)
    out = qkv.attention(q, k, v, mask=mask, causal=causal, backend="flash")
    expected, _ = oracle(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("lq, lk", [(17, 17), (9, 23), (23, 9)])
@pytest.mark.parametrize("causal", [True, "top-left"])
def test_causal_tiles_above_the_diagonal_are_skipped(
    tiny_tiles: None, monkeypatch: pytest.MonkeyPatch, lq: int, lk: int, causal: bool | str
) -> None:
    computed: list[tuple[int, int, int, int]] = []
    scores = flash_loop._Tiles.scores

    def recording(self, q_rows, q0, q1, k0, k1):  # type: ignore[no-untyped-def]
        computed.append((q0, q1, k0, k1))
        return scores(self, q_rows, q0, q1, k0, k1)

    monkeypatch.setattr(flash_loop._Tiles, "scores", recording)
    q, k, v = randn(1, 2, lq, 4), randn(1, 2, lk, 4), randn(1, 2, lk, 4)
    out = qkv.attention(q, k, v, causal=causal, backend="flash")
    torch.testing.assert_close(out, oracle(q, k, v, causal=causal)[0], atol=1e-12, rtol=1e-12)

    offset = lk - lq if causal is True else 0
    allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + offset  # (Lq, Lk)
    covered = torch.zeros(lq, lk, dtype=torch.bool)
    for q0, q1, k0, k1 in computed:
        assert allowed[q0:q1, k0:k1].any(), f"tile {(q0, q1, k0, k1)} lies above the diagonal"
        covered[q0:q1, k0:k1] = True
    assert bool((covered | ~allowed).all()), "an allowed pair was never computed"
    whole = math.ceil(lq / 5) * math.ceil(lk / 7)
    assert len(computed) < whole, "no tile was skipped"


def test_decoding_one_query_is_a_single_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    scores = flash_loop._Tiles.scores
    monkeypatch.setattr(
        flash_loop._Tiles, "scores", lambda self, *a: calls.append(a[1:]) or scores(self, *a)
    )
    q, k, v = randn(2, 8, 1, 16), randn(2, 2, 3000, 16), randn(2, 2, 3000, 16)
    out = qkv.attention(q, k, v, causal=True, backend="flash")
    assert calls == [(0, 1, 0, 3000)]
    torch.testing.assert_close(out, oracle(q, k, v, causal=True)[0], atol=1e-12, rtol=1e-12)


def test_grouped_heads_do_not_copy_keys_and_values() -> None:
    q, k, v = randn(2, 8, 3, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4)
    heads = flash_loop._Heads.of(q, k, v, scale=0.5)
    assert heads.k.data_ptr() == k.data_ptr() and heads.k.shape == (4, 5, 4)
    assert heads.v.data_ptr() == v.data_ptr() and heads.v.shape == (4, 5, 4)
    assert heads.q.shape == (4, 4, 3, 4)  # (N, g, Lq, Dk)


# --- the kernel API ----------------------------------------------------------------------------


def with_offset(mask: torch.Tensor | None, offset: int | None, lq: int, lk: int) -> torch.Tensor:
    """``mask`` and the causal rule ``j <= i + offset`` as one mask (for the oracle)."""
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if offset is not None:
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + offset
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -math.inf)


@pytest.mark.parametrize(
    "offset, mask_kind", [(None, "bool"), (0, "bool"), (3, "float"), (-2, None)]
)
def test_forward_returns_out_and_the_log_sum_exp(
    tiny_tiles: None, offset: int | None, mask_kind: str | None
) -> None:
    lq, lk = 9, 12
    q, k, v = randn(2, 4, lq, 5), randn(2, 2, lk, 5), randn(2, 2, lk, 3)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(lq, lk) > 0.3
        mask[4] = False
    elif mask_kind == "float":
        mask = randn(2, 4, lq, lk).masked_fill(torch.rand(2, 4, lq, lk) < 0.3, -math.inf)
        mask[1, 2, 6] = -math.inf
    with torch.enable_grad():
        out, lse = flash.forward(
            q.requires_grad_(), k, v, scale=0.3, causal_offset=offset, mask=mask
        )
    assert not out.requires_grad and not lse.requires_grad  # no graph is built
    expected_lse = reference_lse(q, k, scale=0.3, causal_offset=offset, mask=mask)
    torch.testing.assert_close(lse, expected_lse, atol=1e-12, rtol=1e-12)
    expected, _ = oracle(q, k, v, mask=with_offset(mask, offset, lq, lk), scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    empty = torch.isneginf(lse)
    assert bool(empty.any()), "the case should have a row with no key"
    assert bool((out[empty] == 0).all())  # rows with no key are exactly 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_computes_low_precision_in_float32(loop: None, dtype: torch.dtype) -> None:
    q, k, v = randn(1, 2, 20, 8, dtype=dtype), randn(1, 2, 20, 8, dtype=dtype), randn(1, 2, 20, 8)
    out, lse = flash.forward(q, k, v.to(dtype), scale=0.35)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    expected = oracle(q, k, v.to(dtype), scale=0.35)[0]
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offset", [None, 0, 4])
def test_backward_matches_autograd_of_the_oracle(tiny_tiles: None, offset: int | None) -> None:
    lq, lk = 11, 15
    q, k, v = randn(2, 6, lq, 5), randn(2, 3, lk, 5), randn(2, 3, lk, 4)
    mask = torch.rand(2, 1, lq, lk) > 0.3
    mask[0, 0, 3] = False  # a row with no key gets zero gradient
    grad_out = randn(2, 6, lq, 4)
    out, lse = flash.forward(q, k, v, scale=0.4, causal_offset=offset, mask=mask)
    dq, dk, dv = flash.backward(
        q, k, v, out, grad_out, lse, scale=0.4, causal_offset=offset, mask=mask
    )

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected_out, _ = oracle(*leaves, mask=with_offset(mask, offset, lq, lk), scale=0.4)
    torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=1e-12)
    expected = torch.autograd.grad(expected_out, leaves, grad_out)
    for got, want in zip((dq, dk, dv), expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert bool((dq[0, :, 3] == 0).all())


@pytest.mark.parametrize("offset", [None, 0, 6])
@pytest.mark.parametrize("split", [1, 6, 13])
def test_key_blocks_merge_by_lse_and_their_gradients_add_up(
    tiny_tiles: None, offset: int | None, split: int
) -> None:
    """Ring attention's contract: attention over keys [0, s) and [s, Lk) separately, merged by
    their log-sum-exps, is attention over all keys; ``backward`` of each block, given the final
    out and lse, gives that block's dk/dv, and the blocks' dq add up to the full dq."""
    lq, lk = 10, 14
    q, k, v = randn(1, 4, lq, 6), randn(1, 2, lk, 6), randn(1, 2, lk, 5)
    mask = torch.rand(lq, lk) > 0.25
    mask[2, :] = False
    grad_out = randn(1, 4, lq, 5)
    full_out, full_lse = flash.forward(q, k, v, scale=0.5, causal_offset=offset, mask=mask)
    full = flash.backward(
        q, k, v, full_out, grad_out, full_lse, scale=0.5, causal_offset=offset, mask=mask
    )

    blocks = [(0, split), (split, lk)]
    parts = []
    for k0, k1 in blocks:
        block_offset = None if offset is None else offset - k0  # key j of the block is k0 + j
        parts.append((k0, k1, block_offset))
    outs, lses = [], []
    for k0, k1, block_offset in parts:
        out, lse = flash.forward(
            q,
            k[..., k0:k1, :],
            v[..., k0:k1, :],
            scale=0.5,
            causal_offset=block_offset,
            mask=mask[:, k0:k1],
        )
        outs.append(out)
        lses.append(lse)
    lse = torch.logaddexp(*lses)
    finite = torch.isfinite(lse)[..., None]
    merged = sum(
        torch.where(finite, o * torch.exp(part - lse)[..., None], 0.0)
        for o, part in zip(outs, lses)
    )
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(merged, full_out, atol=1e-12, rtol=1e-12)

    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for k0, k1, block_offset in parts:
        dq_part, dk_part, dv_part = flash.backward(
            q,
            k[..., k0:k1, :],
            v[..., k0:k1, :],
            full_out,
            grad_out,
            full_lse,
            scale=0.5,
            causal_offset=block_offset,
            mask=mask[:, k0:k1],
        )
        dq += dq_part
        dks.append(dk_part)
        dvs.append(dv_part)
    torch.testing.assert_close(dq, full[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat(dks, dim=-2), full[1], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat(dvs, dim=-2), full[2], atol=1e-12, rtol=1e-12)


def test_backward_broadcasts_gradients_back_to_the_input_shapes() -> None:
    q, k, v = randn(3, 2, 4, 5), randn(1, 2, 6, 5), randn(1, 2, 6, 5)  # k, v broadcast over B
    out, lse = flash.forward(q, k, v, scale=0.4)
    dq, dk, dv = flash.backward(q, k, v, out, torch.ones_like(out), lse, scale=0.4)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(oracle(*leaves, scale=0.4)[0].sum(), leaves)
    for got, want in zip((dq, dk, dv), expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# --- autograd ------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(tiny_tiles: None, causal: bool) -> None:
    q = randn(1, 4, 8, 3).requires_grad_()
    k = randn(1, 2, 9, 3).requires_grad_()
    v = randn(1, 2, 9, 2).requires_grad_()
    mask = torch.rand(8, 9) > 0.3
    mask[5] = False

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, mask=mask, causal=causal, backend="flash")

    assert torch.autograd.gradcheck(attend, (q, k, v))


def test_autograd_saves_only_inputs_out_and_lse() -> None:
    q, k, v = (randn(1, 2, 300, 8).requires_grad_() for _ in range(3))
    out = qkv.attention(q, k, v, causal=True, backend="flash")
    saved = out.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(1, 2, 300, 8)] * 4 + [(1, 2, 300)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_are_finite_and_zero_for_rows_without_keys(
    dtype: torch.dtype,
) -> None:
    q, k, v = (randn(1, 2, 6, 4, dtype=dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out = qkv.attention(q, k, v, mask=mask, backend="flash")
    out.float().sum().backward()
    assert out.dtype == dtype and q.grad is not None and q.grad.dtype == dtype
    assert bool(torch.isfinite(q.grad).all()) and bool((q.grad[:, :, 2] == 0).all())
    assert bool((out[:, :, 2] == 0).all())


# --- memory --------------------------------------------------------------------------------------


def _peak_live_bytes(run: object) -> int:
    """Peak bytes of CPU tensors alive at once while ``run()`` executes (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()  # type: ignore[operator]
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_causal_forward_backward_never_holds_a_score_matrix() -> None:
    """At T = 2048 one (H, T, T) float32 score matrix is 32 MiB; flash's whole forward and
    backward pass stays below a quarter of that. The same measurement sees the reference
    backend's score matrices, so it can fail."""
    t, heads = 2048, 2
    q, k, v = (torch.randn(1, heads, t, 16, requires_grad=True) for _ in range(3))
    score_matrix = heads * t * t * 4

    def step(backend: str) -> None:
        qkv.attention(q, k, v, causal=True, backend=backend).sum().backward()

    assert _peak_live_bytes(lambda: step("flash")) < score_matrix / 4
    assert _peak_live_bytes(lambda: step("reference")) > score_matrix


# --- entry points and "auto" ---------------------------------------------------------------------


def test_refusals_say_why() -> None:
    q = randn(1, 2, 3, 4)
    with pytest.raises(Unsupported, match="dropout"):
        qkv.attention(q, q, q, dropout_p=0.1, backend="flash")
    with pytest.raises(Unsupported, match="weights"):
        qkv.attention(q, q, q, return_weights=True, backend="flash")
    learned = torch.zeros(3, 3, dtype=f64, requires_grad=True)
    with pytest.raises(Unsupported, match="float mask"):
        qkv.attention(q, q, q, mask=learned, backend="flash")


def _call(lq: int, lk: int, dtype: torch.dtype = torch.float32, **kwargs: object) -> Call:
    q, k = torch.randn(1, 2, lq, 4, dtype=dtype), torch.randn(1, 2, lk, 4, dtype=dtype)
    fields = {"mask": None, "causal_offset": None, "scale": 0.5, "dropout_p": 0.0}
    fields.update({"return_weights": False, **kwargs})
    return Call(q, k, k, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call, expected",
    [
        (_call(1, 300, causal_offset=299), "flash"),  # decoding against a cache
        (_call(64, 300, mask=torch.ones(64, 300, dtype=torch.bool)), "flash"),
        (_call(1, 300, torch.float64), "sdpa"),  # one query in float64: not the kernel's dtype
        (_call(300, 300, mask=torch.ones(300, 300, dtype=torch.bool)), "sdpa"),  # many queries
        (_call(300, 300, torch.float64, causal_offset=0), "sdpa"),  # not the kernel's dtype
        (_call(100, 800, causal_offset=700), "flash"),  # few queries for the keys
        (_call(0, 5), "flash"),  # empty: sdpa refuses
        (_call(1, 300, causal_offset=299, dropout_p=0.1), "sdpa"),  # flash refuses dropout
        (_call(1, 300, causal_offset=299, return_weights=True), "reference"),
    ],
)
def test_auto_rule(call: Call, expected: str) -> None:
    assert dispatch.choose(call) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "lq, lk, causal_offset",
    [(300, 300, 0), (1024, 1024, None), (100, 300, 200), (1, 300, None), (4, 300, None)],
)
def test_auto_picks_the_compiled_kernel_for_calls_without_a_mask_or_gradients(
    kernel: object,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    lq: int,
    lk: int,
    causal_offset: int | None,
) -> None:
    call = _call(lq, lk, dtype, causal_offset=causal_offset)
    assert dispatch.choose(call) == "flash"
    learning = _call(lq, lk, dtype, causal_offset=causal_offset)
    learning.q.requires_grad_()
    assert dispatch.choose(learning) == "flash"  # the kernel runs the backward pass too
    masked = _call(lq, lk, dtype, causal_offset=causal_offset, mask=torch.ones(lq, lk) == 1)
    masked.q.requires_grad_()
    if lq > 64:  # (few queries under a mask go to flash's loop)
        assert dispatch.choose(masked) == "sdpa"  # under a mask the backward is flash's loop
    monkeypatch.setattr(flash_kernel, "ENABLED", False)
    assert dispatch.choose(call) == "sdpa"  # flash's loop is slower than torch's kernel here
    assert dispatch.choose(learning) == "sdpa"


@pytest.mark.parametrize(
    "lq, lk, dtype, units, tiles",
    [
        (300, 300, torch.float32, "sdpa", "flash"),  # 2 heads × 300 × 300: under 2^20 scores
        (64, 64, torch.float16, "sdpa", "flash"),
        (64, 8192, torch.float32, "sdpa", "flash"),  # 2^20 scores, not a whole query block
        (64, 8192, torch.bfloat16, "flash", "sdpa"),  # few queries for their keys, widened
        (64, 512, torch.float16, "sdpa", "sdpa"),
        (128, 4096, torch.float32, "flash", "flash"),
        (8, 64, torch.float32, "flash", "flash"),  # decoding: always the kernel
        (8, 8192, torch.bfloat16, "flash", "flash"),
    ],
)
@pytest.mark.parametrize("build", ["matrix units", "brgemm", "tiles"])
def test_auto_decides_calls_without_a_rule_per_build(
    kernel: object,
    monkeypatch: pytest.MonkeyPatch,
    build: str,
    lq: int,
    lk: int,
    dtype: torch.dtype,
    units: str,
    tiles: str,
) -> None:
    """No mask and no causal rule: flash's kernel only where it was measured to be faster on
    that class of build (bfloat16 matrix units; AVX-512 with oneDNN's products; the kernel's own
    register tiles, with float16/bfloat16 widened)."""
    monkeypatch.setattr(flash_kernel, "matrix_units", lambda: build == "matrix units")
    monkeypatch.setattr(flash_kernel, "cached_products", lambda: build.replace(" units", ""))
    expected = {"matrix units": units, "brgemm": "flash", "tiles": tiles}[build]
    assert dispatch.choose(_call(lq, lk, dtype)) == expected
    assert dispatch.choose(_call(lq, lk, dtype, causal_offset=0)) == "flash"  # causal: always


@settings(max_examples=15, deadline=None)
@given(
    lq=st.integers(0, 12),
    lk=st.integers(0, 12),
    query_tile=st.integers(1, 6),
    key_tile=st.integers(1, 6),
    causal=st.sampled_from([False, True, "top-left"]),
)
def test_any_tiling_gives_the_same_answer(
    lq: int, lk: int, query_tile: int, key_tile: int, causal: bool | str
) -> None:
    q, k, v = randn(2, 2, lq, 3), randn(2, 1, lk, 3), randn(2, 1, lk, 2)
    mask = torch.rand(2, 2, lq, lk) > 0.3
    expected, _ = oracle(q, k, v, mask=mask, causal=causal)
    old = flash_loop.QUERY_TILE, flash_loop.KEY_TILE
    flash_loop.QUERY_TILE, flash_loop.KEY_TILE = query_tile, key_tile
    try:
        out = qkv.attention(q, k, v, mask=mask, causal=causal, backend="flash")
    finally:
        flash_loop.QUERY_TILE, flash_loop.KEY_TILE = old
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


# --- the compiled CPU kernel -------------------------------------------------------------------
# It must compute what the loop computes. The loop in float64 (checked against the oracle above
# and in test_functional.py) is the reference here; the kernel gets the same inputs in float32,
# float16 or bfloat16.


@pytest.fixture
def kernel() -> object:
    """The compiled kernel module; building it is part of the test environment's set-up."""
    if os.environ.get("QKV_FLASH_KERNEL") == "0":
        pytest.skip("QKV_FLASH_KERNEL=0 switches the compiled kernel off")
    module = flash_kernel.load()
    assert module is not None, "flash's compiled CPU kernel did not build (see the warning)"
    return module


def by_the_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash.forward's PyTorch loop in float64."""
    old, flash_kernel.ENABLED = flash_kernel.ENABLED, False
    try:
        return flash.forward(
            q.double(), k.double(), v.double(), scale=scale, causal_offset=causal_offset
        )
    finally:
        flash_kernel.ENABLED = old


def compiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash.forward on the compiled kernel (failing if the call went to the loop)."""
    result = flash_kernel.forward(q, k, v, scale, causal_offset)
    assert result is not None, "this call should run on the compiled kernel"
    return result


def kernel_tolerances(kernel: object, dtype: torch.dtype) -> tuple[float, float]:
    """The kernel's tolerances against the float64 loop for out and lse.

    float32 and float16 run in float32 throughout: 1e-5. bfloat16 with bfloat16 products rounds
    the weights to bfloat16 for the product with the values (2^-8 relative in out, below one
    unit in the last place of the bfloat16 output), and computes them, and so their sum, with
    a cheaper 2^x that is within 7.5e-5 relative (1e-4 in lse).
    """
    low = dtype == torch.bfloat16 and flash_kernel.bfloat16_products()
    return (2.0**-8, 1e-4) if low else (1e-5, 1e-5)


def assert_close_to_the_loop(
    kernel: object,
    dtype: torch.dtype,
    out: torch.Tensor,
    lse: torch.Tensor,
    expected_out: torch.Tensor,
    expected_lse: torch.Tensor,
) -> None:
    """The kernel's out and lse against the float64 loop's, within kernel_tolerances."""
    out_tolerance, lse_tolerance = kernel_tolerances(kernel, dtype)
    torch.testing.assert_close(out.double(), expected_out, atol=out_tolerance, rtol=out_tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=lse_tolerance, rtol=lse_tolerance)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (2,), (2, 1)]),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    lq=st.sampled_from([1, 2, 5, 15, 16, 17, 100, 300]),  # below 16: the decoding path
    lk=st.integers(1, 700),
    dk=st.integers(1, 80),
    dv=st.integers(1, 80),
    offset=st.sampled_from([None, "bottom-right", "top-left", "random"]),
    # Up to |scale| · sqrt(Dk) = 4.5 standard deviations of scores: float32 scores then hold
    # 1e-5 (at 0.9 and Dk = 71, torch's own float32 kernel errs by up to 8e-6 as well).
    scale=st.sampled_from([0.125, 0.5, -0.3]),
    broadcast_kv=st.booleans(),
)
def test_kernel_matches_the_loop_in_float64(
    kernel: object,
    batch: tuple[int, ...],
    hkv: int,
    groups: int,
    lq: int,
    lk: int,
    dk: int,
    dv: int,
    offset: str | None,
    scale: float,
    broadcast_kv: bool,
) -> None:
    kv_batch = (*batch[:-1], 1) if batch and broadcast_kv else batch
    q = randn(*batch, hkv * groups, lq, dk, dtype=torch.float32)
    k = randn(*kv_batch, hkv, lk, dk, dtype=torch.float32)
    v = randn(*kv_batch, hkv, lk, dv, dtype=torch.float32)
    causal_offset = {
        None: None,
        "bottom-right": lk - lq,
        "top-left": 0,
        "random": int(torch.randint(-lq, lk + 1, ())),
    }[offset]
    out, lse = compiled(q, k, v, scale=scale, causal_offset=causal_offset)
    expected_out, expected_lse = by_the_loop(q, k, v, scale=scale, causal_offset=causal_offset)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal_offset", [None, 0, 700 - 600])
def test_kernel_in_low_precision(kernel: object, dtype: torch.dtype, causal_offset: int) -> None:
    q, k, v = (randn(2, 4, 600, 64, dtype=dtype), randn(2, 2, 700, 64, dtype=dtype),
               randn(2, 2, 700, 48, dtype=dtype))  # fmt: skip
    out, lse = compiled(q, k, v, scale=0.125, causal_offset=causal_offset)
    expected_out, expected_lse = by_the_loop(q, k, v, scale=0.125, causal_offset=causal_offset)
    assert_close_to_the_loop(kernel, dtype, out, lse, expected_out, expected_lse)
    final = qkv.attention(q, k, v, causal=False, backend="flash") if causal_offset is None else None
    if final is not None:  # the output in the input dtype: within the contract's tolerance
        assert final.dtype == dtype
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(final.double(), oracle(q, k, v)[0], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("jump", [2.0, 12.0, 200.0])
@pytest.mark.parametrize("causal_offset", [None, 0])
def test_kernel_follows_scores_that_jump_between_key_blocks(
    kernel: object, dtype: torch.dtype, jump: float, causal_offset: int | None
) -> None:
    # A row's first key block sets its running maximum m. Keys from 1024 on score `jump`
    # base-2 units higher than the keys before them (around 0, where float32 scores are
    # precise). By 2, m stays where it is and the new keys weigh about 4 each (a small share of
    # a row of 1024 keys weighing about 1); by 12, m moves up and the earlier weights still
    # count; by 200, m moves up by more than float32's range (against the old m the new
    # weights would overflow).
    lq, lk, d = 1600, 1600, 32
    scale = d**-0.5
    q = 1 + 0.1 * randn(1, 2, lq, d, dtype=torch.float32)
    k = 0.1 * randn(1, 2, lk, d, dtype=torch.float32)
    k[..., :1024, :] -= jump / (d * scale * math.log2(math.e))
    v = randn(1, 2, lk, 24, dtype=torch.float32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    exponents = (q.double() @ k.double().transpose(-1, -2)) * scale * math.log2(math.e)
    rise = exponents[..., 1024:, 1024] - exponents[..., 1024:, :512].amax(-1)
    if jump > 8:
        assert bool((rise > 8).all()), "the construction should move every row's m from 1024"
    else:
        assert bool(((rise > 1) & (rise < 3)).all()), "the new keys should weigh 2 to 8"
    out, lse = compiled(q, k, v, scale=scale, causal_offset=causal_offset)
    expected_out, expected_lse = by_the_loop(q, k, v, scale=scale, causal_offset=causal_offset)
    # Rows from 1024 see the jump. (Causally, earlier rows see only scores around −jump, where
    # float32 scores themselves are off by |score| · 2^-24: not what this test is about.)
    rows = slice(1024, None) if causal_offset == 0 else slice(None)
    assert_close_to_the_loop(
        kernel,
        dtype,
        out[..., rows, :],
        lse[..., rows],
        expected_out[..., rows, :],
        expected_lse[..., rows],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_weights_stay_bounded_when_scores_climb_block_by_block(
    kernel: object, dtype: torch.dtype
) -> None:
    # Every key block scores 6 base-2 units above the one before, all its keys alike: each new
    # maximum is a small share of the row's sum so far, so m may stay where it is for a while,
    # but not for 22 blocks, where the newest weights against the first block's m would be
    # 2^126 each and their sum would overflow float32.
    blocks, d, scale = 22, 8, 8**-0.5
    q = torch.ones(1, 1, 16, d)
    step = 6 / (d * scale * math.log2(math.e))  # one block's rise, as a key entry
    k = (step * torch.arange(blocks * 512).div(512, rounding_mode="floor")).repeat(d, 1).T
    k = k.reshape(1, 1, blocks * 512, d)
    v = randn(1, 1, blocks * 512, d, dtype=torch.float32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse = compiled(q, k, v, scale=scale, causal_offset=None)
    expected_out, expected_lse = by_the_loop(q, k, v, scale=scale, causal_offset=None)
    assert bool(out.isfinite().all()), "the sum of the weights overflowed"
    assert_close_to_the_loop(kernel, dtype, out, lse, expected_out, expected_lse)


def test_kernel_is_as_accurate_as_torch_on_peaked_bfloat16_rows(kernel: object) -> None:
    # Score spread 3: most rows are dominated by a few keys. Where a new maximum carries much of
    # a row's weight m moves up to it, so the largest weight is exactly 1, which bfloat16 holds
    # without rounding; a reference m that let weights grow past 1 in such rows made the output
    # about 1.5x less accurate than torch's here.
    d = 64
    q, k = (randn(1, 8, 1024, d, dtype=torch.float32) * 3**0.5 for _ in range(2))
    q, k, v = q.bfloat16(), k.bfloat16(), randn(1, 8, 1024, d, dtype=torch.bfloat16)
    expected, _ = by_the_loop(q, k, v, scale=d**-0.5, causal_offset=0)
    out, _ = compiled(q, k, v, scale=d**-0.5, causal_offset=0)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = (out.bfloat16().double() - expected).abs().max()
    theirs = (torch_out.double() - expected).abs().max()
    assert ours <= 1.1 * theirs, f"kernel {float(ours):.4f} against torch's {float(theirs):.4f}"


# The edge cases below run on both of the kernel's paths: query blocks (16 queries or more) and
# decoding (fewer).


@pytest.mark.parametrize("lq", [64, 1])
def test_kernel_restores_the_callers_floating_point_mode(kernel: object, lq: int) -> None:
    # The kernel flushes results below 2^-126 to zero while it runs; the caller's thread must
    # get its subnormal numbers back afterwards.
    tiny = torch.tensor(1e-38, dtype=torch.float32)
    assert float(tiny * 1e-3) != 0.0
    q, k, v = (randn(1, 1, length, 8, dtype=torch.float32) for length in (lq, 64, 64))
    compiled(q, k, v, scale=1.0, causal_offset=None)
    assert float(tiny * 1e-3) != 0.0


@pytest.mark.parametrize("lq, lk", [(40, 25), (6, 2)])
def test_kernel_rows_without_keys_are_zero_with_lse_minus_infinity(
    kernel: object, lq: int, lk: int
) -> None:
    q, k, v = (randn(1, 2, length, 8, dtype=torch.float32) for length in (lq, lk, lk))
    out, lse = compiled(q, k, v, scale=0.3, causal_offset=lk - lq)
    empty = lq - lk  # query i sees keys j <= i - empty
    assert bool((out[..., :empty, :] == 0).all()) and bool(torch.isneginf(lse[..., :empty]).all())
    assert bool(torch.isfinite(out[..., empty:, :]).all())
    assert bool(torch.isfinite(lse[..., empty:]).all())


@pytest.mark.parametrize("lq, causal_offset, nan_row", [(40, 0, 3), (4, 8, 0)])
def test_kernel_propagates_nan(kernel: object, lq: int, causal_offset: int, nan_row: int) -> None:
    q, k, v = (randn(1, 1, length, 8, dtype=torch.float32) for length in (lq, 40, 40))
    q[0, 0, nan_row, 0] = math.nan  # one query row
    k[0, 0, 10, 0] = math.nan  # one key: every row that sees it
    out, _ = compiled(q, k, v, scale=0.3, causal_offset=causal_offset)
    rows_nan = out.isnan().any(dim=-1)[0, 0]
    expected = torch.arange(lq) + causal_offset >= 10
    expected[nan_row] = True
    assert torch.equal(rows_nan, expected)


@pytest.mark.parametrize("lq, lk, causal_offset", [(300, 300, 0), (3, 3000, None)])
def test_kernel_gives_the_same_bits_on_one_and_two_threads(
    kernel: object, lq: int, lk: int, causal_offset: int | None
) -> None:
    q, k, v = (randn(2, 3, length, 40, dtype=torch.float32) for length in (lq, lk, lk))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compiled(q, k, v, scale=0.2, causal_offset=causal_offset)
        torch.set_num_threads(2)
        two = compiled(q, k, v, scale=0.2, causal_offset=causal_offset)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_kernel_forward_feeds_the_backward(kernel: object) -> None:
    q, k, v = (randn(1, 2, 64, 16, dtype=torch.float32).requires_grad_() for _ in range(3))
    out = qkv.attention(q, k, v, causal=True, backend="flash")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    expected_out = qkv.attention(q64, k64, v64, causal=True, backend="reference")
    expected = torch.autograd.grad(expected_out.square().sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "why, call",
    [
        ("a mask", lambda q: flash.forward(q, q, q, scale=1.0, mask=torch.ones(32, 32) > 0)),
        ("float64", lambda q: flash.forward(q.double(), q.double(), q.double(), scale=1.0)),
        ("empty", lambda q: flash.forward(q[..., :0], q[..., :0], q, scale=1.0)),
    ],
)
def test_calls_the_kernel_does_not_take_run_on_the_loop(
    kernel: object, monkeypatch: pytest.MonkeyPatch, why: str, call: object
) -> None:
    went_to_loop = []
    monkeypatch.setattr(flash_loop, "_Heads", _Recording(flash_loop._Heads, went_to_loop))
    call(randn(1, 2, 32, 8, dtype=torch.float32))  # type: ignore[operator]
    assert went_to_loop, why
    went_to_loop.clear()
    flash.forward(*(randn(1, 2, 32, 8, dtype=torch.float32) for _ in range(3)), scale=1.0)
    assert not went_to_loop, "a plain float32 call should run on the kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lq, causal_offset", [(1, None), (3, 7 + 100 - 3), (5, 3)])
def test_kernel_decodes_from_a_cache_buffer_as_it_lies(
    kernel: object, dtype: torch.dtype, lq: int, causal_offset: int | None
) -> None:
    # A KV cache hands out views of a larger buffer: rows of a head are contiguous, but heads
    # (and batch entries) are a capacity apart. The decoding path reads them in place.
    buffer_k, buffer_v = randn(2, 2, 200, 24, dtype=dtype), randn(2, 2, 200, 40, dtype=dtype)
    k, v = buffer_k[..., 7 : 7 + 100, :], buffer_v[..., 7 : 7 + 100, :]
    q = randn(2, 6, lq, 24, dtype=dtype)  # grouped heads: 3 per key/value head
    out, lse = compiled(q, k, v, scale=0.2, causal_offset=causal_offset)
    expected_out, expected_lse = by_the_loop(q, k, v, scale=0.2, causal_offset=causal_offset)
    # Decoding multiplies in float32 in every dtype, bfloat16 values widened as they are read.
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


class _Recording:
    """Stands in for flash_loop._Heads and notes each time the loop starts."""

    def __init__(self, heads: type, calls: list[int]) -> None:
        self.heads, self.calls = heads, calls

    def of(self, *args: object) -> object:
        self.calls.append(1)
        return self.heads.of(*args)  # type: ignore[attr-defined]
