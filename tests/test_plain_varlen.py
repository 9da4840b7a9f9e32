"""The plain varlen lane (``flash.varlen.plain``): ``qkv.varlen_attn`` sends a decoding call with
nothing but its lengths, causal and scale (pages through a block table, or packed keys) straight
to the kernel, which makes the whole path's checks of the lengths and the block table as tests.
It must give the whole path's bits, and every call it is not sure of (a failed check, any other
argument) must take the whole path, which raises or runs it.
Legend: N sequences, T_q query tokens, P pages of page_size, Hq/Hkv heads, D features.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import TOLERANCE
from varlen_oracle import batch, oracle

import qkv
from qkv.backends.flash import kernel
from qkv.backends.flash import varlen as flash_varlen
from qkv.varlen import AuxRequest


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if kernel.load() is None:
        pytest.skip("flash's compiled kernel is not available")


def _pool(b: Any, page_size: int, table_dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """b's keys and values in a pool whose pages lie in a shuffled order, with a table whose
    entries past each sequence's pages are out of the pool (-1 or P + 3: never read, so never
    checked)."""
    generator = torch.Generator().manual_seed(seed)
    held = [(n + page_size - 1) // page_size for n in b.k_lens]
    pages, width = sum(held) + 2, max(held, default=0) + 1
    order = torch.randperm(pages, generator=generator).tolist()
    shape = (pages, page_size, *b.key.shape[1:])
    pool_k = torch.randn(shape, dtype=b.key.dtype, generator=generator)
    pool_v = torch.randn(*shape[:-1], b.value.shape[-1], generator=generator).to(b.value.dtype)
    table = torch.full((len(b.k_lens), width), -1, dtype=torch.long)
    table[:, -1] = pages + 3
    starts = b.cu_seq_k.tolist()
    for i, n in enumerate(b.k_lens):
        for t in range(n):
            page = order.pop() if t % page_size == 0 else int(table[i, t // page_size])
            table[i, t // page_size] = page
            pool_k[page, t % page_size] = b.key[starts[i] + t]
            pool_v[page, t % page_size] = b.value[starts[i] + t]
    return {
        "key": pool_k,
        "value": pool_v,
        "seqused_k": torch.tensor(b.k_lens, dtype=table_dtype),
        "block_table": table.to(table_dtype),
    }


def _call(b: Any, pool: dict[str, Any], **rules: Any) -> tuple[list[Any], dict[str, Any]]:
    args = [b.query, pool["key"], pool["value"], b.cu_seq_q, None, max(b.q_lens), max(b.k_lens)]
    extras = {"seqused_k": pool["seqused_k"], "block_table": pool["block_table"]}
    return args, {**extras, "enable_gqa": True, **rules}


def _whole_path(args: list[Any], kwargs: dict[str, Any]) -> Any:
    with mock.patch.object(flash_varlen, "plain", return_value=None):
        return qkv.varlen_attn(*args, **kwargs)


def _lane(args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    rules = {"scale": kwargs.get("scale"), "causal": kwargs.get("causal", False)}
    return flash_varlen.plain(
        *args, kwargs.get("seqused_k"), kwargs.get("block_table"),
        enable_gqa=kwargs["enable_gqa"], **rules,
    )  # fmt: skip


@given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 70)), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (4, 4), (8, 2), (6, 1)]),
    dims=st.sampled_from([(64, 64), (8, 5), (33, 80)]),
    page_size=st.sampled_from([1, 4, 16, 17]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    table_dtype=st.sampled_from([torch.int32, torch.int64]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_the_lane_gives_the_whole_paths_bits_and_the_oracles_numbers(
    lengths: list[tuple[int, int]],
    heads: tuple[int, int],
    dims: tuple[int, int],
    page_size: int,
    dtype: torch.dtype,
    table_dtype: torch.dtype,
    causal: bool,
    scale: float | None,
    seed: int,
) -> None:
    q_lens, k_lens = [lq for lq, _ in lengths], [lk for _, lk in lengths]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    b = batch(q_lens, k_lens, *heads, *dims, dtype=dtype, seed=seed)
    pool = _pool(b, page_size, table_dtype, seed)
    args, kwargs = _call(b, pool, causal=causal, scale=scale)
    _assert_the_lane_runs_the_whole_path(b, args, kwargs)


def _assert_the_lane_runs_the_whole_path(b: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """A plain call on b: the lane runs it (not None), giving ``varlen_attn``'s and the whole
    path's bits, and the float64 oracle's numbers within the dtype's tolerance."""
    lane = _lane(args, kwargs)
    dtype, causal, scale = b.query.dtype, kwargs.get("causal", False), kwargs.get("scale")
    assert lane is not None and lane.dtype == dtype  # a plain call: the lane runs it
    assert torch.equal(qkv.varlen_attn(*args, **kwargs), lane)
    assert torch.equal(_whole_path(args, kwargs), lane)
    expected, _ = oracle(b, right=0 if causal else None, scale=scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(lane.double(), expected, atol=atol, rtol=rtol)


def _plain_case() -> tuple[Any, dict[str, Any]]:
    b = batch([1, 2, 1], [9, 20, 4], 4, 2, 8, 8)
    return b, _pool(b, 4, torch.int32, 0)


# Calls whose lengths or table the whole path rejects: the lane must refuse each (then the whole
# path raises). (case: what to change, the error's words)
BAD = {
    "cu_seq_q not from 0": ({"cu_seq_q": torch.tensor([1, 1, 3, 4])}, "must start at 0"),
    "cu_seq_q falls": ({"cu_seq_q": torch.tensor([0, 3, 1, 4])}, "never decrease"),
    "cu_seq_q short of T_q": ({"cu_seq_q": torch.tensor([0, 1, 2, 3])}, "must equal T_q"),
    "cu_seq_q too long": ({"cu_seq_q": torch.tensor([0, 1, 3, 4, 4])}, "block_table must be"),
    "cu_seq_q float": ({"cu_seq_q": torch.tensor([0.0, 1, 3, 4])}, "int32 or int64"),
    "cu_seq_q 2-D": ({"cu_seq_q": torch.tensor([[0, 1, 3, 4]])}, "cu_seq_q"),
    "a query past max_q": ({"max_q": 1}, "max_q = 1, but sequence 1 has 2"),
    "a length past max_k": ({"max_k": 19}, "max_k = 19, but sequence 1 has 20"),
    "a negative length": ({"seqused_k": torch.tensor([9, -1, 4])}, "must be >= 0"),
    "lengths short": ({"seqused_k": torch.tensor([9, 20])}, "one entry per sequence"),
    "lengths float": ({"seqused_k": torch.tensor([9.0, 20, 4])}, "int32 or int64"),
    "more pages than the table": (
        {"seqused_k": torch.tensor([9, 30, 4]), "max_k": 30},
        r"seqused_k\[1\] = 30 needs 8 pages of 4",
    ),
    "a page below the pool": ({"page": -1}, r"block_table\[1\] points outside the pool"),
    "a page past the pool": ({"page": 10**6}, r"block_table\[1\] points outside the pool"),
    "table float": ({"block_table": torch.zeros(3, 6)}, "int32 or int64"),
}


def _bad(change: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    b, pool = _plain_case()
    args, kwargs = _call(b, pool, causal=True)
    table = kwargs["block_table"].clone()
    if "page" in change:
        table[1, 2] = change.pop("page")
    kwargs["block_table"] = table
    positions = {"cu_seq_q": 3, "max_q": 5, "max_k": 6}
    for name, value in change.items():
        if name in positions:
            args[positions[name]] = value
        else:
            kwargs[name] = value
    return args, kwargs


@pytest.mark.parametrize("case", BAD)
def test_lengths_and_tables_the_whole_path_rejects_are_refused_and_get_its_error(
    case: str,
) -> None:
    change, words = BAD[case]
    args, kwargs = _bad(dict(change))
    assert _lane(args, kwargs) is None
    with pytest.raises((ValueError, TypeError), match=words):
        qkv.varlen_attn(*args, **kwargs)


# Calls the whole path runs (or rejects) that the lane leaves to it. (case: the change)
NOT_PLAIN: dict[str, dict[str, Any]] = {
    "float16": {"dtype": torch.float16},
    "float64": {"dtype": torch.float64},
    "a strided query": {"query": "strided"},
    "a query that wants its gradient": {"grad": True},
    "an int scale": {"scale": 1},
    "a tensor causal": {"causal": torch.tensor(True)},
    "an int enable_gqa": {"enable_gqa": 1},
    "grouped heads without enable_gqa": {"enable_gqa": False},
    "a bool max_q": {"max_q": True},
    "a query subclass": {"query": "subclass"},
    "no sequences": {"empty": True},
    "cu_seq_k beside the pages": {"cu_seq_k": torch.tensor([0, 9, 29, 33], dtype=torch.int32)},
}


def _not_plain(change: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    b, pool = _plain_case()
    args, kwargs = _call(b, pool, causal=True)
    if "dtype" in change:
        args[:3] = [x.to(change["dtype"]) for x in args[:3]]
    if change.get("query") == "strided":
        args[0] = torch.randn(4, 16, 8).transpose(0, 1)[:4, :4].transpose(0, 1)
    if change.get("query") == "subclass":
        args[0] = torch.nn.Parameter(args[0], requires_grad=False)
    if change.get("grad"):
        args[0] = args[0].clone().requires_grad_()
    if change.get("empty"):
        args[0], args[3], args[6] = args[0][:0], torch.tensor([0]), 0
        empty = torch.zeros(0, 1, dtype=torch.long)
        kwargs.update(seqused_k=empty[:, 0], block_table=empty)
    for name in ("scale", "causal", "enable_gqa"):
        if name in change:
            kwargs[name] = change[name]
    if "max_q" in change:
        args[5] = change["max_q"]
    if "cu_seq_k" in change:
        args[4] = change["cu_seq_k"]
    return args, kwargs


@pytest.mark.parametrize("case", NOT_PLAIN)
def test_calls_the_lane_is_not_sure_of_take_the_whole_path(case: str) -> None:
    args, kwargs = _not_plain(NOT_PLAIN[case])
    assert _lane(args, kwargs) is None


@pytest.mark.parametrize(
    "extra",
    [
        {"window_size": (-1, 0)},
        {"window_size": (-1.0, -1)},
        {"softcap": 5.0},
        {"alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])},
        {"sinks": torch.zeros(4)},
        {"return_aux": AuxRequest(lse=True)},
    ],
)
def test_a_call_with_more_than_lengths_causal_and_scale_never_reaches_the_lane(
    extra: dict[str, Any],
) -> None:
    b, pool = _plain_case()
    args, kwargs = _call(b, pool, causal=True)
    more = list(args)
    lane = mock.Mock(wraps=flash_varlen.plain)
    refused = contextlib.suppress(ValueError, TypeError)  # ((-1.0, -1): the whole path's error)
    with mock.patch.object(flash_varlen, "plain", lane), refused:
        qkv.varlen_attn(*more, **kwargs, **extra)
    assert not lane.called
    control = mock.Mock(wraps=flash_varlen.plain)
    with mock.patch.object(flash_varlen, "plain", control):
        qkv.varlen_attn(*args, **kwargs)
    assert control.call_count == 1  # (a control: the plain call asks the lane)


def test_without_the_compiled_kernel_nothing_takes_the_lane(monkeypatch: Any) -> None:
    b, pool = _plain_case()
    args, kwargs = _call(b, pool, causal=True)
    monkeypatch.setattr(kernel, "ENABLED", False)
    assert _lane(args, kwargs) is None
    expected, _ = oracle(b, right=0)
    got = qkv.varlen_attn(*args, **kwargs)  # the whole path's loop
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


# Packed keys (cu_seq_k): a decoding step of continuous batching.


def _packed(b: Any, strided: bool) -> tuple[list[Any], dict[str, Any]]:
    """A plain packed call on b; ``strided``: query, keys and values as views of (H, T, D)
    tensors, as transformers' continuous batching hands them over."""
    q, k, v = b.query, b.key, b.value
    if strided:
        q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    args = [q, k, v, b.cu_seq_q, b.cu_seq_k, max(b.q_lens), max(b.k_lens)]
    return args, {"enable_gqa": True}


@given(
    lengths=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 70)), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (4, 4), (8, 2), (6, 1)]),
    dims=st.sampled_from([(64, 64), (8, 5), (33, 80)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_packed_lane_gives_the_whole_paths_bits_and_the_oracles_numbers(
    lengths: list[tuple[int, int]],
    heads: tuple[int, int],
    dims: tuple[int, int],
    dtype: torch.dtype,
    causal: bool,
    scale: float | None,
    strided: bool,
    seed: int,
) -> None:
    q_lens, k_lens = [lq for lq, _ in lengths], [lk for _, lk in lengths]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    if sum(k_lens) == 0:
        k_lens[0] = 1
    b = batch(q_lens, k_lens, *heads, *dims, dtype=dtype, seed=seed)
    args, kwargs = _packed(b, strided)
    kwargs.update(causal=causal, scale=scale)
    _assert_the_lane_runs_the_whole_path(b, args, kwargs)


# Packed calls the whole path rejects, or runs elsewhere (16 queries: the block kernel).
PACKED_BAD = {
    "cu_seq_k not from 0": ({"cu_seq_k": torch.tensor([1, 9, 29, 33])}, "must start at 0"),
    "cu_seq_k falls": ({"cu_seq_k": torch.tensor([0, 29, 9, 33])}, "never decrease"),
    "cu_seq_k short of T_k": ({"cu_seq_k": torch.tensor([0, 9, 29, 32])}, "must equal T_k"),
    "cu_seq_k too long": ({"cu_seq_k": torch.tensor([0, 9, 29, 30, 33])}, "same length"),
    "cu_seq_k float": ({"cu_seq_k": torch.tensor([0.0, 9, 29, 33])}, "int32 or int64"),
    "a length past max_k": ({"max_k": 19}, "max_k = 19, but sequence 1 has 20"),
    "a query past max_q": ({"max_q": 1}, "max_q = 1, but sequence 1 has 2"),
    "seqused_k beside packed keys": ({"seqused_k": torch.tensor([9, 20, 4])}, None),
    "16 queries": ({"queries": 16}, None),
}


@pytest.mark.parametrize("case", PACKED_BAD)
def test_packed_calls_the_lane_is_not_sure_of_take_the_whole_path(case: str) -> None:
    change, words = PACKED_BAD[case]
    b = batch([1, 16 if "queries" in change else 2, 1], [9, 20, 4], 4, 2, 8, 8)
    args, kwargs = _packed(b, strided=False)
    kwargs["causal"] = True
    positions = {"cu_seq_k": 4, "max_q": 5, "max_k": 6}
    for name, value in change.items():
        if name in positions:
            args[positions[name]] = value
        elif name == "seqused_k":
            kwargs[name] = value
    assert _lane(args, kwargs) is None
    if words is not None:
        with pytest.raises((ValueError, TypeError), match=words):
            qkv.varlen_attn(*args, **kwargs)
        return
    expected, _ = oracle(b, right=0)  # (seqused_k: all of each sequence's keys here)
    got = qkv.varlen_attn(*args, **kwargs)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_paged_cache_step_of_attention_with_cache_takes_the_lane() -> None:
    """``attention_with_cache`` on a ``PagedKVCache`` asks ``varlen_attn`` for no lse
    (``AuxRequest(lse=False)``): a plain decoding step is run by the lane, with the whole path's
    output and cache."""
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randn(2, 2, 21, 8, generator=generator)
    new, q = torch.randn(2, 2, 1, 8, generator=generator), torch.randn(2, 4, 1, 8)
    answers: list[Any] = []
    original = flash_varlen.plain

    def lane(*args: Any, **kwargs: Any) -> Any:
        answers.append(original(*args, **kwargs))
        return answers[-1]

    outs, caches = [], []
    for attend in (lane, mock.Mock(return_value=None)):
        cache = qkv.PagedKVCache(16, 4, 2, 8)
        for seq in range(2):
            cache.append(seq, prefix[seq].transpose(0, 1), prefix[seq].transpose(0, 1))
        with mock.patch.object(flash_varlen, "plain", attend):
            outs.append(qkv.attention_with_cache(q, new, new, cache, causal=True))
        caches.append(cache)
    assert len(answers) == 1 and isinstance(answers[0], torch.Tensor)  # the lane ran the step
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].keys, caches[1].keys)
    assert caches[0].lengths([0, 1]).tolist() == caches[1].lengths([0, 1]).tolist() == [22, 22]
