"""qkv.varlen_attn: packed sequences, each with its own bottom-right causal diagonal and window,
against a float64 oracle per sequence (forward and gradients), against each sequence run alone
through qkv.attention, and against torch's varlen_attn conventions."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import TOLERANCE
from varlen_oracle import Batch, batch, cumulative, oracle

import qkv
from qkv.varlen import AuxRequest

# Query and key lengths per sequence: a decoding row, an empty query, no keys, more queries than
# keys (its first rows see no key when causal), a chunked prefill, equal lengths crossing a tile.
Q_LENS = [1, 0, 3, 6, 5, 2, 20]
K_LENS = [7, 4, 0, 4, 9, 2, 37]
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.3, -1.0, 2.0, 0.0])

# (varlen_attn's keywords, the oracle's) for each rule
RULES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {"right": 0}),
    "torch-causal": ({"window_size": (-1, 0)}, {"right": 0}),
    "window": ({"window_size": (3, 0)}, {"left": 3, "right": 0}),
    "two-sided": ({"window_size": (2, 1)}, {"left": 2, "right": 1}),
    "softcap": ({"causal": True, "softcap": 2.0}, {"right": 0, "softcap": 2.0}),
    "alibi": ({"alibi_slopes": SLOPES}, {"alibi_slopes": SLOPES}),
    "sinks": ({"causal": True, "sinks": SINKS}, {"right": 0, "sinks": SINKS}),
    "all": (
        {"window_size": (4, 1), "softcap": 3.0, "alibi_slopes": SLOPES, "sinks": SINKS},
        {"left": 4, "right": 1, "softcap": 3.0, "alibi_slopes": SLOPES, "sinks": SINKS},
    ),
}


def run(b: Batch, lse: bool = True, **kwargs: Any) -> Any:
    max_q, max_k = b.bounds
    return qkv.varlen_attn(
        b.query,
        b.key,
        b.value,
        b.cu_seq_q,
        b.cu_seq_k,
        max_q,
        max_k,
        enable_gqa=True,
        return_aux=AuxRequest(lse=lse),
        **kwargs,
    )


# A decoding batch: fewer than 16 query rows in all, the kernel's one-row-at-a-time path.
DECODE_Q_LENS, DECODE_K_LENS = [1, 1, 2, 0, 1], [5, 9, 3, 2, 0]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lengths", ["prefill", "decode"])
def test_forward_matches_the_oracle(
    rule: str, dtype: torch.dtype, lengths: str, kernel_path: str
) -> None:
    ours, theirs = RULES[rule]
    q_lens, k_lens = (Q_LENS, K_LENS) if lengths == "prefill" else (DECODE_Q_LENS, DECODE_K_LENS)
    b = batch(q_lens, k_lens, dtype=dtype)
    out, lse = run(b, **ours)
    expected_out, expected_lse = oracle(b, **theirs)
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == (sum(q_lens), 4, 8)
    assert lse.shape == (4, sum(q_lens))
    torch.testing.assert_close(out.double(), expected_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), expected_lse, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("rule", ["causal", "window", "two-sided", "all"])
def test_gradients_match_the_oracle(rule: str, kernel_path: str) -> None:
    ours, theirs = RULES[rule]
    b = batch(Q_LENS, K_LENS)
    leaves = [x.clone().requires_grad_() for x in (b.query, b.key, b.value)]
    learn = {
        name: ours[name].clone().requires_grad_()
        for name in ("alibi_slopes", "sinks")
        if name in ours
    }
    out = qkv.varlen_attn(
        *leaves, b.cu_seq_q, b.cu_seq_k, *b.bounds, enable_gqa=True, **{**ours, **learn}
    )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    mine = torch.autograd.grad(out, [*leaves, *learn.values()], grad)
    exact = [x.detach().double().requires_grad_() for x in (*leaves, *learn.values())]
    named = dict(zip(learn, exact[3:]))
    expected, _ = oracle(b, query=exact[0], key=exact[1], value=exact[2], **{**theirs, **named})
    theirs_grads = torch.autograd.grad(expected, exact, grad.double())
    for got, want in zip(mine, theirs_grads):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_gradient_through_the_log_sum_exp(kernel_path: str) -> None:
    """lse is differentiable too, with out in one loss, sinks and ALiBi (the kernel's backward
    takes lse's gradient)."""
    b = batch(Q_LENS, K_LENS)
    query = b.query.clone().requires_grad_()
    sinks = torch.randn(b.query.shape[1]).requires_grad_()
    out, lse = qkv.varlen_attn(
        query,
        b.key,
        b.value,
        b.cu_seq_q,
        b.cu_seq_k,
        *b.bounds,
        enable_gqa=True,
        causal=True,
        alibi_slopes=SLOPES,
        sinks=sinks,
        return_aux=AuxRequest(lse=True),
    )
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    loss = (out * weights).sum() + lse.nan_to_num(neginf=0.0).sum()
    mine = torch.autograd.grad(loss, (query, sinks))
    exact, exact_sinks = b.query.double().requires_grad_(), sinks.double().detach().requires_grad_()
    out_64, lse_64 = oracle(b, query=exact, right=0, alibi_slopes=SLOPES, sinks=exact_sinks)
    loss_64 = (out_64 * weights.double()).sum() + lse_64.nan_to_num(neginf=0.0).sum()
    want = torch.autograd.grad(loss_64, (exact, exact_sinks))
    for got, expected in zip(mine, want, strict=True):
        torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype, kernel_path: str) -> None:
    b = batch(Q_LENS, K_LENS, dtype=dtype)
    out, _ = run(b, causal=True, alibi_slopes=SLOPES, softcap=4.0)
    expected, _ = oracle(b, right=0, alibi_slopes=SLOPES, softcap=4.0)
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_rows_without_keys_give_zero() -> None:
    """k_len 0, and causal rows before the first key (q_len > k_len): 0 output, lse −inf."""
    b = batch([3, 4], [0, 2])
    out, lse = run(b, causal=True)
    assert torch.equal(out[:5], torch.zeros_like(out[:5]))  # sequence 0, then rows 0, 1 of 1
    assert bool((lse[:, :5] == -math.inf).all()) and bool(lse[:, 5:].isfinite().all())
    assert bool(out[5:].abs().sum(dim=-1).gt(0).all())


def test_seqused_k_uses_the_first_keys() -> None:
    b = batch([2, 3], [6, 5])
    used = torch.tensor([4, 0], dtype=torch.int32)
    out = qkv.varlen_attn(
        b.query,
        b.key,
        b.value,
        b.cu_seq_q,
        b.cu_seq_k,
        3,
        6,
        causal=True,
        enable_gqa=True,
        seqused_k=used,
    )
    cut = torch.cat([b.key[:4], b.key[6:6]]), torch.cat([b.value[:4], b.value[6:6]])
    expected = qkv.varlen_attn(
        b.query, *cut, b.cu_seq_q, cumulative([4, 0]), 3, 6, causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out, expected)


@st.composite
def packed_batches(draw: st.DrawFn) -> tuple[Batch, tuple[int, int]]:
    n = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    k_lens = draw(st.lists(st.integers(0, 24), min_size=n, max_size=n))
    window = (draw(st.sampled_from([-1, 0, 2, 5])), draw(st.sampled_from([-1, 0, 3])))
    return batch(q_lens, k_lens, seed=draw(st.integers(0, 99))), window


@given(packed_batches())
def test_a_packed_call_equals_each_sequence_alone(case: tuple[Batch, tuple[int, int]]) -> None:
    """Property: sequence i of a varlen call is qkv.attention on sequence i alone, causal and
    windows aligned bottom-right (qkv's window: (left, right), None unbounded)."""
    b, window = case
    out = run(b, lse=False, window_size=window)
    left, right = (None if side == -1 else side for side in window)
    q0 = k0 = 0
    for lq, lk in zip(b.q_lens, b.k_lens):
        q, k, v = (
            x.transpose(0, 1)
            for x in (b.query[q0 : q0 + lq], b.key[k0 : k0 + lk], b.value[k0 : k0 + lk])
        )
        alone = qkv.attention(q, k, v, window=None if window == (-1, -1) else (left, right))
        torch.testing.assert_close(out[q0 : q0 + lq], alone.transpose(0, 1), atol=1e-5, rtol=1e-5)
        q0, k0 = q0 + lq, k0 + lk


def test_torch_conventions_on_meta_tensors() -> None:
    """torch's own varlen_attn (its shape rules run on meta tensors): out (T_q, H_q, D) and lse
    (H_q, T_q) float32, as ours; the GQA refusal says enable_gqa as ours does."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    b = batch([3, 5], [4, 6])
    meta = [x.to("meta") for x in (b.query, b.key, b.value, b.cu_seq_q, b.cu_seq_k)]
    out_t, lse_t = varlen.varlen_attn(
        *meta, 5, 6, enable_gqa=True, return_aux=varlen.AuxRequest(lse=True)
    )
    out, lse = qkv.varlen_attn(
        b.query,
        b.key,
        b.value,
        b.cu_seq_q,
        b.cu_seq_k,
        5,
        6,
        enable_gqa=True,
        return_aux=varlen.AuxRequest(lse=True),
    )
    assert out.shape == out_t.shape and lse.shape == lse_t.shape and lse.dtype == lse_t.dtype
    for f in (varlen.varlen_attn, qkv.varlen_attn):
        with pytest.raises(ValueError, match="enable_gqa"):
            f(
                *(
                    [*meta[:3], *meta[3:]]
                    if f is varlen.varlen_attn
                    else [b.query, b.key, b.value, b.cu_seq_q, b.cu_seq_k]
                ),
                5,
                6,
            )


def test_torch_window_sentinels() -> None:
    """(-1, 0) is torch's causal (is_causal = window_size == (-1, 0)); -1 on both sides is full
    attention; (W, 0) sees the W keys before each query's own and its own."""
    b = batch([4], [9])
    full = run(b, lse=False)
    torch.testing.assert_close(run(b, lse=False, window_size=(-1, -1)), full)
    torch.testing.assert_close(
        run(b, lse=False, window_size=(-1, 0)), run(b, lse=False, causal=True)
    )
    expected, _ = oracle(b, left=2, right=0)
    torch.testing.assert_close(
        run(b, lse=False, window_size=(2, 0)).double(), expected, atol=1e-5, rtol=1e-5
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn runs on CUDA only")
def test_same_results_as_torch_on_cuda() -> None:
    from torch.nn.attention.varlen import varlen_attn

    b = batch([5, 1, 33], [5, 40, 70], hq=4, hkv=4, d=64, dv=64, dtype=torch.float16)
    for window in [(-1, -1), (-1, 0), (8, 0)]:
        cuda = [x.cuda() for x in (b.query, b.key, b.value, b.cu_seq_q, b.cu_seq_k)]
        theirs = varlen_attn(*cuda, 33, 70, window_size=window).cpu()
        ours = run(b, lse=False, window_size=window)
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)


def test_paged_calls_refuse_gradients() -> None:
    cache = qkv.PagedKVCache(4, 4, 2, 8)
    b = batch([2], [3])
    cache.append("a", b.key, b.value)
    query = b.query.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        qkv.varlen_attn(
            query,
            cache.keys,
            cache.values,
            b.cu_seq_q,
            None,
            2,
            3,
            enable_gqa=True,
            seqused_k=cache.lengths(),
            block_table=cache.block_table(),
        )


def _bad(**change: Any) -> dict[str, Any]:
    b = batch([2, 3], [4, 5])
    call = {
        "query": b.query,
        "key": b.key,
        "value": b.value,
        "cu_seq_q": b.cu_seq_q,
        "cu_seq_k": b.cu_seq_k,
        "max_q": 3,
        "max_k": 5,
        "enable_gqa": True,
    }
    return {**call, **change}


I32 = torch.int32


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (_bad(cu_seq_q=torch.tensor([1, 2, 5], dtype=I32)), ValueError, "cu_seq_q must start at 0"),
        (
            _bad(cu_seq_k=torch.tensor([0, 6, 4, 9], dtype=I32)),
            ValueError,
            r"cu_seq_k must never decrease, got cu_seq_k\[1\] = 6 > cu_seq_k\[2\] = 4",
        ),
        (_bad(cu_seq_q=torch.tensor([0.0, 2.0, 5.0])), TypeError, "cu_seq_q must be an int32"),
        (
            _bad(cu_seq_q=torch.tensor([0, 2, 4], dtype=I32)),
            ValueError,
            r"cu_seq_q\[-1\] must equal T_q \(query.shape\[0\]\) = 5, got 4",
        ),
        (_bad(cu_seq_k=torch.tensor([0, 9], dtype=I32)), ValueError, "same length N"),
        (_bad(max_q=2), ValueError, "max_q = 2, but sequence 1 has 3 queries"),
        (_bad(max_k=4), ValueError, "max_k = 4, but sequence 1 has 5 keys"),
        (_bad(enable_gqa=False), ValueError, "H_q=4 and H_kv=2; set enable_gqa=True"),
        (_bad(query=torch.zeros(5, 4)), ValueError, "query must have 3 dimensions"),
        (_bad(key=torch.zeros(9, 2, 7)), ValueError, "query and key must share D"),
        (
            _bad(value=torch.zeros(9, 2, 8, dtype=torch.float64)),
            TypeError,
            "share one dtype.*value=torch.float64",
        ),
        (_bad(window_size=(-2, 0)), ValueError, r"window_size\[0\] must be an int >= 0, or -1"),
        (
            _bad(seqused_k=torch.tensor([5, 1], dtype=I32)),
            ValueError,
            r"seqused_k\[0\] = 5 exceeds sequence 0's 4 keys",
        ),
        (_bad(cu_seq_k=None), ValueError, "cu_seq_k must be given"),
        (_bad(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have one value per"),
        (_bad(return_aux=True), TypeError, "return_aux must be None or an AuxRequest"),
    ],
)
def test_errors_name_the_argument(call: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        qkv.varlen_attn(**call)


def test_the_varlen_benchmark_runs_and_agrees() -> None:
    """``qkv bench --varlen`` at a small size: lengths spread as said, both calls agree."""
    from qkv.bench import varlen as bench

    assert bench.lengths(16) == sorted(bench.lengths(16))
    assert bench.lengths(16)[0] == 64 and bench.lengths(16)[-1] == 4096
    result = bench.varlen_benchmark(heads=2, dim=8, repeats=1, sequences=3, shortest=4, longest=40)
    assert result["lengths"] == [4, 13, 40] and result["max_abs_difference"] < 1e-5
    assert result["speedup"] > 0


def test_empty_batches() -> None:
    """No sequences at all, and queries with no keys anywhere (T_k = 0): empty output, or zeros
    with lse −inf and a zero gradient."""
    none = torch.zeros(1, dtype=torch.int32)
    out, lse = qkv.varlen_attn(
        torch.zeros(0, 4, 8),
        torch.zeros(0, 2, 8),
        torch.zeros(0, 2, 8),
        none,
        none,
        0,
        0,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    query = torch.randn(3, 4, 8, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    out, lse = qkv.varlen_attn(
        query,
        torch.zeros(0, 2, 8),
        torch.zeros(0, 2, 8),
        cu_q,
        cu_k,
        3,
        0,
        enable_gqa=True,
        causal=True,
        return_aux=AuxRequest(lse=True),
    )
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    assert query.grad is not None and torch.equal(query.grad, torch.zeros_like(query))


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), max_size=6),
    st.sampled_from([None, 0, 1, 4, 100]),
    st.sampled_from([None, 0, 2]),
)
def test_each_query_token_s_row_of_sequence_keys_and_position(
    lengths: list[tuple[int, int]], left: int | None, right: int | None
) -> None:
    """Property: the kernel's per-token rows (flash's sequences.rows) hold, for each packed query
    token in order, its sequence, the keys [lo, hi) its window lets it see among its
    sequence's keys (hi ≥ lo) and its bottom-right position, as the definition gives them."""
    from qkv.backends.flash.sequences import Packing, VarlenRules, rows

    q_lens, k_lens = [lq for lq, _ in lengths], [lk for _, lk in lengths]
    q_start = [sum(q_lens[:i]) for i in range(len(q_lens))]
    packing = Packing(q_start, q_lens, [0] * len(q_lens), k_lens, None)
    got = rows(packing, VarlenRules(1.0, left, right, None, None, None))
    expected = []
    for s, (lq, lk) in enumerate(lengths):
        for t in range(lq):
            p = lk - lq + t
            lo = 0 if left is None else max(p - left, 0)
            hi = lk if right is None else min(lk, p + right + 1)
            expected.append([s, min(lo, lk), max(hi, lo), p])
    assert got.dtype == torch.long and got.tolist() == expected
