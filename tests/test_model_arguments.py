"""What real models add to attention: softcap, sinks, alibi_slopes, window, segments, return_lse
and ``qkv.merge``, against a float64 formula written here from the issue's words, on every
backend, forward and gradients.

Legend: B batch, H heads (Hq query, Hkv key/value), Lq query length, Lk key length, D features.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import TOLERANCE

import qkv
from qkv.backends import flash
from qkv.backends.base import Unsupported
from qkv.backends.flash import kernel as flash_kernel
from qkv.backends.flash import loop as flash_loop
from qkv.canonical import canonical_call

f64 = torch.float64
NEG_INF = -math.inf


def formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: Any = None,
    segments: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, weights, lse) in float64 for q (B, Hq, Lq, D), k, v (B, Hkv, Lk, D), one row at a
    time from the issue's words: capped scores, plus ALiBi and a float mask, over the keys the
    mask, the bottom-right causal rule, the window and the segments allow, and the sink."""
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    shift = lk - lq
    left, right = (window - 1, 0) if isinstance(window, int) else (window or (None, None))
    query_ids, key_ids = (None, None) if segments is None else segments
    outs, weights, lses = [], [], []
    for batch in range(b):
        for head in range(hq):
            kv = head // (hq // hkv)
            for i in range(lq):
                logits, values, cols = [], [], []
                for j in range(lk):
                    allowed = not causal or j <= i + shift
                    if mask is not None:
                        entry = mask.expand(b, hq, lq, lk)[batch, head, i, j]
                        allowed = allowed and (bool(entry) if mask.dtype == torch.bool else True)
                    allowed = allowed and (left is None or j >= i + shift - left)
                    allowed = allowed and (right is None or j <= i + shift + right)
                    if query_ids is not None:
                        allowed = allowed and bool(query_ids[batch, i] == key_ids[batch, j])
                    if not allowed:
                        continue
                    s = (q[batch, head, i] @ k[batch, kv, j]) / math.sqrt(q.shape[-1])
                    if softcap is not None:
                        s = softcap * torch.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s = s - alibi_slopes[head] * abs(i + shift - j)
                    if mask is not None and mask.dtype != torch.bool:
                        s = s + mask.expand(b, hq, lq, lk)[batch, head, i, j]
                    logits.append(s)
                    values.append(v[batch, kv, j])
                    cols.append(j)
                if sinks is not None:
                    logits.append(sinks[head])
                    values.append(torch.zeros_like(v[0, 0, 0]))
                row = torch.zeros(lk, dtype=f64)
                if logits:
                    stacked = torch.stack(logits)
                    lse = torch.logsumexp(stacked, 0)
                    p = torch.exp(stacked - lse)
                    out = (p[:, None] * torch.stack(values)).sum(0)
                    row = row.index_put((torch.tensor(cols, dtype=torch.long),), p[: len(cols)])
                else:
                    lse, out = torch.tensor(NEG_INF, dtype=f64), torch.zeros_like(v[0, 0, 0])
                outs.append(out)
                weights.append(row)
                lses.append(lse)
    return (
        torch.stack(outs).view(b, hq, lq, -1),
        torch.stack(weights).view(b, hq, lq, lk),
        torch.stack(lses).view(b, hq, lq),
    )


def ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def inputs(lq: int = 7, lk: int = 9, hq: int = 4, hkv: int = 2, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=f64)

    return {
        "q": randn(2, hq, lq, 4) * 2,
        "k": randn(2, hkv, lk, 4),
        "v": randn(2, hkv, lk, 3),
        "sinks": randn(hq),
        "alibi_slopes": randn(hq).abs() / 2,
        "mask": torch.rand(2, 1, lq, lk, generator=generator) > 0.25,
        "float mask": randn(2, 1, lq, lk),
        "segments": (  # two documents in batch entry 0, a third one at the end of entry 1
            ids([[int(i >= 3) for i in range(lq)], [2 * (i >= lq - 1) for i in range(lq)]]),
            ids([[int(j >= 4) for j in range(lk)], [2 * (j >= lk - 2) for j in range(lk)]]),
        ),
    }


# Each case: the keyword arguments it passes, and the input tensors among them by name.
CASES: dict[str, dict[str, Any]] = {
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": "sinks"},
    "alibi": {"alibi_slopes": "alibi_slopes"},
    "window int": {"window": 3, "causal": True},
    "window pair": {"window": (2, 1)},
    "window left only": {"window": (1, None), "mask": "mask"},
    "segments": {"segments": "segments"},
    "segments causal": {"segments": "segments", "causal": True},
    "everything": {
        "softcap": 2.0,
        "sinks": "sinks",
        "alibi_slopes": "alibi_slopes",
        "window": (4, 0),
        "segments": "segments",
        "causal": True,
        "mask": "float mask",
    },
    "sinks causal mask": {"sinks": "sinks", "causal": True, "mask": "mask"},
}


def arguments(case: str, tensors: dict[str, Any], grad: bool = False) -> dict[str, Any]:
    kwargs = {}
    for name, value in CASES[case].items():
        value = tensors[value] if isinstance(value, str) else value
        if grad and name in ("sinks", "alibi_slopes"):
            value = value.clone().requires_grad_()
        kwargs[name] = value
    return kwargs


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash's loop with tiles of 2 queries × 3 keys: small inputs cross many tile edges."""
    monkeypatch.setattr(flash_kernel, "ENABLED", False)
    monkeypatch.setattr(flash_loop, "QUERY_TILE", 2)
    monkeypatch.setattr(flash_loop, "KEY_TILE", 3)


def test_formula_is_the_textbook_one_without_extras() -> None:
    t = inputs()
    out, weights, _ = formula(t["q"], t["k"], t["v"], mask=t["mask"], causal=True)
    expected, expected_weights = qkv.attention(
        t["q"], t["k"], t["v"], mask=t["mask"], causal=True, return_weights=True
    )
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(weights, expected_weights, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_the_formula(case: str) -> None:
    t = inputs()
    kwargs = arguments(case, t)
    expected = formula(t["q"], t["k"], t["v"], **kwargs)
    got = qkv.attention(
        t["q"], t["k"], t["v"], return_weights=True, return_lse=True, backend="reference", **kwargs
    )
    for name, a, b in zip(("out", "weights", "lse"), got, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)


def gradients(result: tuple[torch.Tensor, ...], wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    out, lse = result[0], result[-1]
    loss = (out.sin() * torch.linspace(-1, 1, out.shape[-1], dtype=f64)).sum()
    loss = loss + lse.masked_fill(lse == NEG_INF, 0.0).cos().sum()  # lse's gradient too
    return list(torch.autograd.grad(loss, wrt))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_forward_and_gradients_match_the_formula(
    case: str, backend: str, small_tiles: None
) -> None:
    t = inputs()
    q, k, v = (t[name].clone().requires_grad_() for name in "qkv")
    kwargs = arguments(case, t, grad=True)
    learnable = [q, k, v] + [kwargs[n] for n in ("sinks", "alibi_slopes") if n in kwargs]
    expected = formula(q, k, v, **kwargs)
    got = qkv.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    torch.testing.assert_close(got[0], expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[1], expected[2], atol=1e-10, rtol=1e-10)
    for a, b in zip(gradients(got, learnable), gradients((expected[0], expected[2]), learnable)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


SDPA_TAKES = ("window int", "window pair", "window left only", "segments", "segments causal")
SDPA_TAKES += ("alibi",)


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_runs_what_it_can_express_exactly_and_names_the_rest(case: str) -> None:
    t = inputs()
    kwargs = arguments(case, t)
    expected = formula(t["q"], t["k"], t["v"], **kwargs)[0]
    if case in SDPA_TAKES:
        out = qkv.attention(t["q"], t["k"], t["v"], backend="sdpa", **kwargs)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    else:
        with pytest.raises(Unsupported, match="soft-capping or sinks"):
            qkv.attention(t["q"], t["k"], t["v"], backend="sdpa", **kwargs)
    out = qkv.attention(t["q"], t["k"], t["v"], **kwargs)  # auto: falls back where sdpa refuses
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_sdpa_refuses_lse_and_low_precision_alibi() -> None:
    t = inputs()
    with pytest.raises(Unsupported, match="log-sum-exp"):
        qkv.attention(t["q"], t["k"], t["v"], return_lse=True, backend="sdpa")
    q, k, v = (t[name].float() for name in "qkv")
    with pytest.raises(Unsupported, match="ALiBi"):
        qkv.attention(q.half(), k.half(), v.half(), alibi_slopes=t["alibi_slopes"], backend="sdpa")
    slopes = t["alibi_slopes"].float().requires_grad_()
    with pytest.raises(Unsupported, match="ALiBi"):
        qkv.attention(q, k, v, alibi_slopes=slopes, backend="sdpa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_low_precision_computes_in_float32(dtype: torch.dtype, backend: str) -> None:
    t = inputs(lq=20, lk=20)
    kwargs = arguments("everything", t)
    q, k, v = (t[name].to(dtype) for name in "qkv")
    expected = formula(q.double(), k.double(), v.double(), **kwargs)
    out, lse = qkv.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), expected[2], atol=1e-5, rtol=1e-5)


def test_sinks_take_weight_and_a_row_without_keys_stays_zero() -> None:
    t = inputs()
    mask = t["mask"].clone()
    mask[0, :, 2] = False  # query 2 of batch 0 may attend no key
    q = t["q"].clone().requires_grad_()
    out, weights, lse = qkv.attention(
        q, t["k"], t["v"], mask=mask, sinks=t["sinks"], return_weights=True, return_lse=True
    )
    sums = weights.sum(-1)
    assert (sums < 1).all() and (sums[0, :, 2] == 0).all()
    assert (out[0, :, 2] == 0).all() and out.isfinite().all()
    torch.testing.assert_close(lse[0, :, 2], t["sinks"])  # only the sink is left
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert (grad[0, :, 2] == 0).all() and grad.isfinite().all()


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_lse_of_a_row_without_keys_is_minus_infinity(backend: str) -> None:
    t = inputs()
    mask = torch.zeros(1, 1, 7, 9, dtype=torch.bool)
    out, lse = qkv.attention(t["q"], t["k"], t["v"], mask=mask, return_lse=True, backend=backend)
    assert (lse == NEG_INF).all() and (out == 0).all()


def test_return_order_and_shapes_without_head_dim() -> None:
    q, k, v = torch.randn(5, 4, dtype=f64), torch.randn(6, 4, dtype=f64), torch.randn(6, 3)
    out, weights, lse = qkv.attention(q, k, v.double(), return_weights=True, return_lse=True)
    assert out.shape == (5, 3) and weights.shape == (5, 6) and lse.shape == (5,)
    expected = torch.logsumexp(q @ k.T / 2, dim=-1)
    torch.testing.assert_close(lse, expected, atol=1e-12, rtol=1e-12)


# --- merge ------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    lq=st.integers(1, 6),
    lk=st.integers(2, 10),
    cut=st.integers(0, 10),
    density=st.sampled_from([0.0, 0.5, 1.0]),
    backend=st.sampled_from(["reference", "flash"]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_merge_of_two_key_sets_is_attention_over_both(
    lq: int, lk: int, cut: int, density: float, backend: str, with_sinks: bool, seed: int
) -> None:
    cut = min(cut, lk)
    t = inputs(lq, lk, seed=seed)
    q, k, v = t["q"], t["k"], t["v"]
    mask = torch.rand(2, 4, lq, lk) < density
    sinks = t["sinks"] if with_sinks else None
    whole, whole_lse = qkv.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    a = qkv.attention(
        q,
        k[..., :cut, :],
        v[..., :cut, :],
        mask=mask[..., :cut],
        sinks=sinks,
        return_lse=True,
        backend=backend,
    )
    b = qkv.attention(
        q, k[..., cut:, :], v[..., cut:, :], mask=mask[..., cut:], return_lse=True, backend=backend
    )  # the sink joins one of the two sets only
    out, lse = qkv.merge(*a, *b)
    torch.testing.assert_close(out, whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, whole_lse, atol=1e-12, rtol=1e-12)


def test_merge_differentiates_and_checks_shapes() -> None:
    out_a, lse_a = torch.randn(2, 3, 4, dtype=f64, requires_grad=True), torch.randn(2, 3, dtype=f64)
    out_b, lse_b = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 3, dtype=f64)
    assert torch.autograd.gradcheck(lambda a: qkv.merge(a, lse_a, out_b, lse_b)[0], (out_a,))
    with pytest.raises(ValueError, match="lse_a"):
        qkv.merge(out_a, lse_a[:, :2], out_b, lse_b)
    with pytest.raises(TypeError, match="out_b"):
        qkv.merge(out_a, lse_a, out_b.long(), lse_b)


# --- window and segments are masks that flash never forms ---------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    lq=st.integers(0, 12),
    lk=st.integers(0, 12),
    left=st.one_of(st.none(), st.integers(0, 6)),
    right=st.one_of(st.none(), st.integers(0, 6)),
    causal=st.booleans(),
    documents=st.integers(1, 4),
    backend=st.sampled_from(["reference", "flash", "sdpa"]),
    seed=st.integers(0, 2**16),
)
def test_window_and_segments_equal_their_dense_mask(
    lq: int,
    lk: int,
    left: int | None,
    right: int | None,
    causal: bool,
    documents: int,
    backend: str,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 3, dtype=f64, generator=generator) for n in (lq, lk, lk))
    key_ids = torch.randint(0, documents, (2, lk), generator=generator).sort(-1).values
    query_ids = torch.randint(0, documents, (2, lq), generator=generator).sort(-1).values
    rows = torch.arange(lq)[:, None] + lk - lq
    cols = torch.arange(lk)[None, :]
    dense = torch.ones(lq, lk, dtype=torch.bool)
    if left is not None:
        dense &= cols >= rows - left
    if right is not None:
        dense &= cols <= rows + right
    dense = dense & (query_ids[:, :, None] == key_ids[:, None, :])  # (2, Lq, Lk)
    expected = qkv.attention(q, k, v, mask=dense[:, None], causal=causal, backend="reference")
    old = flash_loop.QUERY_TILE, flash_loop.KEY_TILE
    flash_loop.QUERY_TILE, flash_loop.KEY_TILE = 3, 2
    try:
        got = qkv.attention(
            q,
            k,
            v,
            window=(left, right),
            segments=(query_ids, key_ids),
            causal=causal,
            backend=backend if (lq and lk) or backend != "sdpa" else "flash",
        )
    finally:
        flash_loop.QUERY_TILE, flash_loop.KEY_TILE = old
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_int_window_is_the_sliding_window_mask() -> None:
    t = inputs(lq=6, lk=10)
    dense = qkv.sliding_window_mask(6, 10, window=4)
    expected = qkv.attention(t["q"], t["k"], t["v"], mask=dense)
    for backend in ("reference", "flash", "sdpa"):
        got = qkv.attention(t["q"], t["k"], t["v"], window=4, causal=True, backend=backend)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def key_tiles_computed(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> int:
    """How many (query tile, key tile) score blocks flash computes for a 64-token call."""
    monkeypatch.setattr(flash_kernel, "ENABLED", False)
    monkeypatch.setattr(flash_loop, "QUERY_TILE", 8)
    monkeypatch.setattr(flash_loop, "KEY_TILE", 8)
    scores = flash_loop._Tiles.scores
    calls: list[tuple[int, ...]] = []

    def counting(self, q_rows, q0, q1, k0, k1):  # type: ignore[no-untyped-def]
        calls.append((q0, k0))
        return scores(self, q_rows, q0, q1, k0, k1)

    monkeypatch.setattr(flash_loop._Tiles, "scores", counting)
    q = torch.randn(1, 1, 64, 4, dtype=f64)
    qkv.attention(q, q, q, backend="flash", **kwargs)
    return len(calls)


def test_tiles_outside_the_window_or_the_segments_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    causal = key_tiles_computed(monkeypatch, causal=True)
    windowed = key_tiles_computed(monkeypatch, causal=True, window=8)
    segments = torch.arange(64) // 16  # four documents of 16 tokens
    packed = key_tiles_computed(monkeypatch, causal=True, segments=segments)
    assert causal == 8 * 9 // 2  # the lower triangle of 8 × 8 tiles
    assert windowed == 8 + 7  # the diagonal tile and the one before it
    assert packed == 4 * 3  # per document: 2 query tiles, 1 + 2 key tiles


def test_the_compiled_kernel_takes_every_argument_but_segments_in_pieces() -> None:
    """Sinks join after the kernel; soft-capping and ALiBi change each score before its
    exponential; windows and segments in contiguous runs are each row's range of keys. Segment
    ids whose keys are scattered need a comparison per score: the loop. The backward pass
    takes the same calls, but for a gradient through a returned log-sum-exp."""
    q, k, v = (torch.randn(2, 2, 40, 8) for _ in range(3))
    plain = dict(mask=None, causal=True, scale=None, dropout_p=0.0, return_weights=False)
    runs = torch.arange(40) // 7
    takes = (
        {"sinks": torch.randn(2)},
        {"softcap": 5.0},
        {"alibi_slopes": torch.rand(2, 2)},
        {"window": 4},
        {"window": (3, None), "segments": runs},
        {"segments": (runs[None].expand(2, 40), runs.flip(0)[None].expand(2, 40))},
    )
    refuses = ({"segments": runs % 2},)
    for extra in (*takes, *refuses):
        built, _ = canonical_call(q, k, v, **plain, backend="flash", **extra)
        expected = extra in takes and flash_kernel.takes(q, k, v)
        assert flash.runs_compiled(built) == expected, extra
        assert flash.differentiates_compiled(built) == expected, extra  # the same rules
    lse_call, _ = canonical_call(q, k, v, **plain, backend="flash", return_lse=True)
    assert flash.differentiates_compiled(lse_call) == flash_kernel.takes(q, k, v)  # (lse too)


@pytest.fixture
def compiled_kernel() -> None:
    if flash_kernel.load() is None:
        pytest.skip("flash's compiled CPU kernel is unavailable here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", [(700, 700), (5, 900), (300, 1000)], ids=str)
@pytest.mark.parametrize(
    "structure",
    [
        {"causal": True, "window": 100},
        {"window": (37, 5)},
        {"causal": True, "segments": "runs"},
        {"window": (50, None), "segments": "two rows", "sinks": "sinks"},
        {"causal": True, "softcap": 0.7},
        {"causal": True, "softcap": 50.0, "alibi_slopes": "slopes"},
        {"window": (30, 30), "alibi_slopes": "batch slopes", "softcap": 2.0, "scale": -0.5},
    ],
    ids=str,
)
def test_the_compiled_kernel_matches_the_reference_with_every_argument(
    compiled_kernel: None, dtype: torch.dtype, lengths: tuple[int, int], structure: dict
) -> None:
    """Block-sized inputs: query blocks whose rows start and end in different key blocks, and
    the decoding path (5 queries)."""
    lq, lk = lengths
    generator = torch.Generator().manual_seed(lq + lk)
    shapes = ((4, lq), (2, lk), (2, lk))
    q, k, v = (torch.randn(2, h, n, 16, generator=generator).to(dtype) for h, n in shapes)
    runs = torch.arange(lk) // 97
    values = {
        "runs": runs,
        "two rows": torch.stack([runs, torch.arange(lk) // 150]),
        "sinks": torch.randn(4, generator=generator),
        "slopes": torch.rand(4, generator=generator),
        "batch slopes": torch.rand(2, 4, generator=generator),
    }
    kwargs = {name: values.get(x, x) if isinstance(x, str) else x for name, x in structure.items()}
    wide = {
        n: x.double() if x.is_floating_point() else x
        for n, x in kwargs.items()
        if torch.is_tensor(x)
    }
    expected, expected_lse = qkv.attention(
        q.double(),
        k.double(),
        v.double(),
        return_lse=True,
        backend="reference",
        **{**kwargs, **wide},
    )
    built, _ = canonical_call(
        q,
        k,
        v,
        mask=None,
        causal=kwargs.pop("causal", False),
        scale=kwargs.pop("scale", None),
        dropout_p=0.0,
        return_weights=False,
        backend="flash",
        return_lse=True,
        **kwargs,
    )
    assert flash.runs_compiled(built)
    out, _, lse = flash.attention(built)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    finite = expected_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=1e-4, rtol=1e-4)
    assert (lse[~finite] == NEG_INF).all()


# --- KV caches, grouped heads, segment helpers ------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_cached_decoding_with_every_argument_equals_one_pass(backend: str) -> None:
    t = inputs(lq=9, lk=9)
    q, k, v = t["q"], t["k"], t["v"]
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2]).expand(2, 9)
    extra = {
        "softcap": 3.0,
        "sinks": t["sinks"],
        "alibi_slopes": t["alibi_slopes"],
        "window": 4,
        "causal": True,
    }
    whole = qkv.attention(q, k, v, segments=ids, **extra)
    cache = qkv.KVCache()
    steps = []
    for start, end in ((0, 4), (4, 5), (5, 9)):
        steps.append(
            qkv.attention_with_cache(
                q[..., start:end, :],
                k[..., start:end, :],
                v[..., start:end, :],
                cache,
                segments=ids[:, :end],
                backend=backend,
                **extra,
            )
        )
    torch.testing.assert_close(torch.cat(steps, dim=-2), whole, atol=1e-12, rtol=1e-12)


def test_grouped_heads_equal_repeated_heads_with_sinks_and_alibi() -> None:
    t = inputs()
    kwargs = arguments("everything", t)
    grouped = qkv.attention(t["q"], t["k"], t["v"], backend="flash", **kwargs)
    repeated = qkv.attention(
        t["q"],
        t["k"].repeat_interleave(2, dim=1),
        t["v"].repeat_interleave(2, dim=1),
        backend="flash",
        **kwargs,
    )
    torch.testing.assert_close(grouped, repeated, atol=1e-12, rtol=1e-12)


def test_alibi_slopes_per_batch_entry() -> None:
    t = inputs()
    slopes = torch.rand(2, 4, dtype=f64)
    for backend in ("reference", "flash", "sdpa"):
        out = qkv.attention(t["q"], t["k"], t["v"], alibi_slopes=slopes, backend=backend)
        for entry in range(2):
            alone = formula(
                t["q"][entry : entry + 1],
                t["k"][entry : entry + 1],
                t["v"][entry : entry + 1],
                alibi_slopes=slopes[entry],
            )[0]
            torch.testing.assert_close(out[entry : entry + 1], alone, atol=1e-10, rtol=1e-10)


@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=5), padding=st.integers(0, 3))
def test_cu_seqlens_and_segment_ids_convert_both_ways(lengths: list[int], padding: int) -> None:
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = qkv.segments_from_cu_seqlens(cu_seqlens)
    assert ids.tolist() == [n for n, length in enumerate(lengths) for _ in range(length)]
    assert torch.equal(qkv.cu_seqlens_from_segments(ids), cu_seqlens)
    padded = qkv.segments_from_cu_seqlens(cu_seqlens, length=len(ids) + padding)
    assert padded.tolist() == ids.tolist() + [-1] * padding


# --- bad input ----------------------------------------------------------------------------------

Q, K, V = torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 3)
BAD: dict[str, tuple[type[Exception], list[str], dict[str, Any]]] = {
    "softcap zero": (ValueError, ["softcap", "> 0", "0"], {"softcap": 0.0}),
    "softcap str": (TypeError, ["softcap", "float", "str"], {"softcap": "50"}),
    "sinks shape": (ValueError, ["sinks", "(Hq,)", "4", "(2)"], {"sinks": torch.zeros(2)}),
    "sinks int": (TypeError, ["sinks", "floating", "int64"], {"sinks": torch.zeros(4).long()}),
    "alibi shape": (
        ValueError,
        ["alibi_slopes", "(*batch, Hq)", "(3, 4)"],
        {"alibi_slopes": torch.zeros(3, 4)},
    ),
    "window without causal": (ValueError, ["window", "causal=True", "False"], {"window": 3}),
    "window zero": (ValueError, ["window", "positive", "0"], {"window": 0, "causal": True}),
    "window negative side": (ValueError, ["window[left]", ">= 0", "-1"], {"window": (-1, 0)}),
    "window list": (TypeError, ["window", "(left, right)", "[1, 2]"], {"window": [1, 2]}),
    "segments float": (
        TypeError,
        ["segments", "integer", "float32"],
        {"segments": torch.zeros(2, 6)},
    ),
    "segments length": (
        ValueError,
        ["segments", "Lk = 6", "(2, 5)"],
        {"segments": torch.zeros(2, 5, dtype=torch.long)},
    ),
    "segments pair length": (
        ValueError,
        ["segments (query ids)", "Lq = 5", "(2, 6)"],
        {"segments": (torch.zeros(2, 6).long(), torch.zeros(2, 6).long())},
    ),
    "return_lse int": (TypeError, ["return_lse", "bool", "int"], {"return_lse": 1}),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_name_themselves(case: str) -> None:
    error, words, kwargs = BAD[case]
    with pytest.raises(error) as info:
        qkv.attention(Q, K, V, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_segment_helpers_check_their_input() -> None:
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        qkv.segments_from_cu_seqlens(torch.tensor([1, 3]))
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
        qkv.segments_from_cu_seqlens(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="length must be >= cu_seqlens"):
        qkv.segments_from_cu_seqlens(torch.tensor([0, 3]), length=2)
