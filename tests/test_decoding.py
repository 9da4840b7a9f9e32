"""flash's decoding core (decode.h, paged.h) on every path that reaches it: ``qkv.attention``
with a few queries, ``attention_with_cache`` with a ``KVCache``, and ``qkv.varlen_attn`` over
packed keys and over a paged pool. Each path runs with its keys split across threads
(``kernel.DECODE_SPLITS``, forced here so that both branches run on any number of cores) and
unsplit; both match the float64 oracle, for lengths that are no multiple of a page (16), a block
(32) or a split.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from oracle import TOLERANCE, oracle
from test_paged import paged_copy
from varlen_oracle import batch
from varlen_oracle import oracle as varlen_oracle

import qkv
from qkv.backends.flash import kernel
from qkv.varlen import AuxRequest

SPLITS = (1, 3, 0)  # unsplit, three pieces, and the core's own choice


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if kernel.load() is None:
        pytest.skip("flash's compiled kernel is not available")


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("heads", [(8, 2), (3, 3)])  # grouped (GQA) and one key head per query head
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [35, 131])  # odd; 131: value rows in several pieces on every build
def test_attention_split_and_unsplit_match_the_oracle(
    heads: tuple[int, int],
    queries: int,
    dtype: torch.dtype,
    dv: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hq, hkv = heads
    q = torch.randn(2, hq, queries, 67, dtype=dtype)  # odd D
    k, v = torch.randn(2, hkv, 203, 67, dtype=dtype), torch.randn(2, hkv, 203, dv, dtype=dtype)
    expected, _ = oracle(q, k, v, causal=True)
    outs = []
    for splits in SPLITS:
        monkeypatch.setattr(kernel, "DECODE_SPLITS", splits)
        outs.append(qkv.attention(q, k, v, causal=True, backend="flash"))
        assert outs[-1].dtype == dtype
        _close(outs[-1], expected, dtype)
    _close(outs[1], outs[0], dtype)


def test_kv_cache_decoding_split_and_unsplit_match_the_oracle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    prefix_k, prefix_v = torch.randn(1, 2, 150, 64), torch.randn(1, 2, 150, 64)
    keys, values = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
    expected, _ = oracle(q, keys, values, causal=True)
    outs = []
    for splits in SPLITS:
        monkeypatch.setattr(kernel, "DECODE_SPLITS", splits)
        cache = qkv.KVCache()
        qkv.attention_with_cache(torch.randn(1, 8, 150, 64), prefix_k, prefix_v, cache, causal=True)
        outs.append(qkv.attention_with_cache(q, k, v, cache, causal=True))
        _close(outs[-1], expected, torch.float32)
    _close(outs[1], outs[0], torch.float32)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.3, -1.0, 2.0, 0.0])
RULES: list[dict[str, Any]] = [
    {"causal": True},
    {"window_size": (40, 0), "softcap": 3.0, "alibi_slopes": SLOPES, "sinks": SINKS},
]
ORACLE_RULES: list[dict[str, Any]] = [
    {"right": 0},
    {"left": 40, "right": 0, "softcap": 3.0, "alibi_slopes": SLOPES, "sinks": SINKS},
]


def _varlen(
    b: Any, paged: bool, rules: dict[str, Any], pages: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = b.bounds
    if not paged:
        args = (b.query, b.key, b.value, b.cu_seq_q, b.cu_seq_k, *bounds)
        out, lse = qkv.varlen_attn(*args, enable_gqa=True, return_aux=AuxRequest(lse=True), **rules)
        return out, lse
    cache, seqs = paged_copy(b, page_size=16, pages=pages)
    out, lse = qkv.varlen_attn(
        b.query, cache.keys, cache.values, b.cu_seq_q, None, *bounds, enable_gqa=True,
        seqused_k=cache.lengths(seqs), block_table=cache.block_table(seqs),
        return_aux=AuxRequest(lse=True), **rules,
    )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_paged_and_packed_split_and_unsplit_match_the_oracle(
    which: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # decoding and a few speculative tokens side by side; a sequence with no keys gives 0
    b = batch([1, 2, 1, 3], [1, 75, 0, 203], hq=4, hkv=2, d=67, dv=35, dtype=dtype)
    expected, expected_lse = varlen_oracle(b, **ORACLE_RULES[which])
    results = {}
    for splits in (1, 3):
        monkeypatch.setattr(kernel, "DECODE_SPLITS", splits)
        for paged in (False, True):
            out, lse = _varlen(b, paged, RULES[which])
            _close(out, expected, dtype)
            torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)
            results[splits, paged] = out, lse
    for splits in (1, 3):  # paged and packed keys run the very same arithmetic: the same bits
        assert torch.equal(results[splits, True][0], results[splits, False][0])
        assert torch.equal(results[splits, True][1], results[splits, False][1])
    _close(results[3, False][0], results[1, False][0], dtype)
    assert not results[1, True][0][3].abs().sum()  # the sequence without keys: 0, never NaN


def test_a_call_large_enough_to_stream_gives_the_bits_of_smaller_calls() -> None:
    """A call reading more than 4 MiB of keys and values asks for rows ahead (decode.h's
    kStreamBytes); one head at a time reads less and does not. The arithmetic is the same: the
    outputs are equal, and equal the oracle."""
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, 2100, 64), torch.randn(1, 8, 2100, 64)  # 8.6 MB together
    whole = qkv.attention(q, k, v, backend="flash")
    for h in range(8):  # 1.1 MB each
        part = qkv.attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], backend="flash")
        assert torch.equal(part[0, 0], whole[0, h])
    _close(whole, oracle(q, k, v)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streaming_paged_call_asking_closer_than_a_pass_gives_the_contiguous_bits(
    dtype: torch.dtype,
) -> None:
    """A paged item holds all 8 key/value heads of a page's tokens: at D 128 it asks for the rows
    of keys less than a pass ahead (decode.h's kAheadBytes), the contiguous cache's items a pass
    ahead. Prefetching only: the same bits, and the oracle's output."""
    b = batch([1, 1], [1100, 1037], hq=32, hkv=8, d=128, dv=128, dtype=dtype)  # 17.5 MB in float32
    paged, _ = _varlen(b, True, {"causal": True}, pages=140)
    _close(paged, varlen_oracle(b, right=0)[0], dtype)
    _assert_each_sequence_gives_the_contiguous_bits(b, paged)


def _assert_each_sequence_gives_the_contiguous_bits(b: Any, paged: torch.Tensor) -> None:
    """paged (one decoding token per sequence of b) equals qkv.attention on each sequence's keys
    as one contiguous cache, bit for bit."""
    bounds = b.cu_seq_k.tolist()
    for i, (k0, k1) in enumerate(itertools.pairwise(bounds)):
        q = b.query[i : i + 1].transpose(0, 1)[None]  # (1, H_q, 1, D)
        k, v = (x[k0:k1].transpose(0, 1)[None] for x in (b.key, b.value))
        out = qkv.attention(q, k, v, causal=True, backend="flash")
        assert torch.equal(out[0, :, 0], paged[i])


# query heads sharing a key/value head, and one per key/value head (a lone row: the contiguous
# cache reads longer passes than the pages, which hold four heads a token; the same bits)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("splits", [1, 2])
def test_paged_equals_attention_bit_for_bit(
    heads: tuple[int, int], splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paged sequence and the same keys as one contiguous cache run the very same arithmetic
    (the core's blocks and splits start at the same keys), so the outputs are equal."""
    monkeypatch.setattr(kernel, "DECODE_SPLITS", splits)
    b = batch([1, 1], [77, 603], hq=heads[0], hkv=heads[1], d=64, dv=64)
    paged, _ = _varlen(b, True, {"causal": True})
    _close(paged, varlen_oracle(b, right=0)[0], torch.float32)
    _assert_each_sequence_gives_the_contiguous_bits(b, paged)


def test_many_decoding_sequences_read_packed_keys_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More decoding sequences than the block kernel's threshold still take the decoding core,
    not the block kernel's forward pass (which would copy the keys into blocks)."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the block kernel ran")

    monkeypatch.setattr(kernel, "forward", refused)
    lengths = [5 + 7 * i for i in range(kernel.DECODE_QUERIES + 4)]
    b = batch([1] * len(lengths), lengths)
    out, lse = _varlen(b, False, {"causal": True})
    expected, expected_lse = varlen_oracle(b, right=0)
    _close(out, expected, torch.float32)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)
