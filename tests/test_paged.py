"""qkv.PagedKVCache and attention read from its pages: allocation, block tables, freeing,
truncating (to 0 too) and an exhausted pool, also as a stateful property against a plain
model; paged attention equals the same call on contiguous keys (kernel and loop), and
attention_with_cache on a paged cache equals a KVCache per sequence."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from oracle import TOLERANCE
from varlen_oracle import batch, cumulative, oracle

import qkv
from qkv.paged import PoolExhausted
from qkv.varlen import AuxRequest

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.3, -1.0, 2.0, 0.0])


def test_pages_are_taken_as_needed_and_returned() -> None:
    cache = qkv.PagedKVCache(6, 4, 2, 8)
    k = torch.randn(10, 2, 8)
    cache.append("a", k[:5], k[:5])
    cache.append("b", k[:4], k[:4])
    cache.append("a", k[5:9], k[5:9])  # 9 tokens: 3 pages
    assert cache.length("a") == 9 and cache.length("b") == 4 and cache.free_pages == 2
    assert len(cache.pages_of("a")) == 3 and not set(cache.pages_of("a")) & set(cache.pages_of("b"))
    table, lengths = cache.block_table(["b", "a"]), cache.lengths(["b", "a"])
    assert table.shape == (2, 3) and table.dtype == torch.int32 and lengths.tolist() == [4, 9]
    for t in range(9):  # token t of "a" lies at slot t % 4 of its page t // 4
        page = int(cache.block_table(["a"])[0, t // 4])
        assert torch.equal(cache.keys[page, t % 4], k[t])
    cache.free("b")
    assert cache.free_pages == 3 and "b" not in cache
    cache.append("c", k[:8], k[:8])  # reuses b's page
    assert cache.free_pages == 1


def test_an_exhausted_pool_says_so_and_writes_nothing() -> None:
    cache = qkv.PagedKVCache(2, 4, 1, 4)
    cache.append(0, torch.zeros(6, 1, 4), torch.zeros(6, 1, 4))
    with pytest.raises(PoolExhausted, match=r"needs 1 more pages.*only 0 of 2 are free"):
        cache.append(0, torch.ones(3, 1, 4), torch.ones(3, 1, 4))
    assert cache.length(0) == 6 and cache.free_pages == 0
    with pytest.raises(KeyError, match="no sequence 'x'"):
        cache.free("x")


@pytest.mark.parametrize(
    ("argument", "value", "error", "match"),
    [
        ("k", torch.zeros(3, 2, 5), ValueError, r"k must be \(L, H_kv, D\)"),
        ("k", torch.zeros(3, 2, 8, dtype=torch.float64), TypeError, "float32"),
        ("k", torch.zeros(3, 2, 8, requires_grad=True), RuntimeError, "inference"),
    ],
)
def test_append_checks_its_tokens(argument: str, value: Any, error: type, match: str) -> None:
    cache = qkv.PagedKVCache(4, 4, 2, 8)
    with pytest.raises(error, match=match):
        cache.append("a", value, torch.zeros(3, 2, 8))


def paged_copy(b: Any, page_size: int = 4, pages: int = 64) -> tuple[qkv.PagedKVCache, list[int]]:
    """b's keys and values written sequence by sequence into a pool; the sequences' ids."""
    cache = qkv.PagedKVCache(
        pages, page_size, b.key.shape[1], b.key.shape[2], b.key.dtype, value_dim=b.value.shape[2]
    )
    cache.append("spacer", b.key[:1], b.value[:1])  # so that no sequence starts at page 0
    bounds = b.cu_seq_k.tolist()
    for i, (k0, k1) in enumerate(itertools.pairwise(bounds)):
        cache.append(i, b.key[k0:k1], b.value[k0:k1])
    return cache, list(range(len(b.k_lens)))


@pytest.mark.parametrize(
    "rules",
    [
        {},
        {"causal": True},
        {"window_size": (3, 0)},
        {"window_size": (5, 2), "softcap": 3.0, "alibi_slopes": SLOPES, "sinks": SINKS},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_paged_equals_contiguous(
    rules: dict[str, Any], dtype: torch.dtype, kernel_path: str
) -> None:
    b = batch([1, 2, 0, 1, 3], [9, 0, 4, 17, 30], dtype=dtype)
    cache, seqs = paged_copy(b)
    contiguous, lse = qkv.varlen_attn(
        b.query,
        b.key,
        b.value,
        b.cu_seq_q,
        b.cu_seq_k,
        3,
        30,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        **rules,
    )
    paged, paged_lse = qkv.varlen_attn(
        b.query,
        cache.keys,
        cache.values,
        b.cu_seq_q,
        None,
        3,
        30,
        enable_gqa=True,
        seqused_k=cache.lengths(seqs),
        block_table=cache.block_table(seqs),
        return_aux=AuxRequest(lse=True),
        **rules,
    )
    atol, rtol = TOLERANCE[dtype]
    assert paged.dtype == dtype
    torch.testing.assert_close(paged.double(), contiguous.double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(paged_lse.double(), lse.double(), atol=atol * 10, rtol=rtol)


def test_paged_matches_the_oracle(kernel_path: str) -> None:
    b = batch([1, 4, 1], [16, 7, 33])
    cache, seqs = paged_copy(b, page_size=16)
    out = qkv.varlen_attn(
        b.query,
        cache.keys,
        cache.values,
        b.cu_seq_q,
        None,
        4,
        33,
        enable_gqa=True,
        causal=True,
        alibi_slopes=SLOPES,
        seqused_k=cache.lengths(seqs),
        block_table=cache.block_table(seqs),
    )
    expected, _ = oracle(b, right=0, alibi_slopes=SLOPES)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_with_a_paged_cache_equals_a_kv_cache_per_sequence(kernel_path: str) -> None:
    """Decoding three sequences of different prompt lengths in one paged batch, step by step,
    gives each the outputs it gets with its own KVCache."""
    torch.manual_seed(0)
    cache, own = qkv.PagedKVCache(32, 4, 2, 8), [qkv.KVCache() for _ in range(3)]
    for i, prompt in enumerate([5, 1, 11]):  # each prompt on its own first (its own L)
        q, k, v = (
            torch.randn(1, 4, prompt, 8),
            torch.randn(1, 2, prompt, 8),
            torch.randn(1, 2, prompt, 8),
        )
        got = qkv.attention_with_cache(q, k, v, cache, sequences=[f"r{i}"], causal=True)
        want = qkv.attention_with_cache(q, k, v, own[i], causal=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for _ in range(3):  # then decode all three together
        q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
        got, lse = qkv.attention_with_cache(
            q, k, v, cache, sequences=["r0", "r1", "r2"], causal=True, return_lse=True
        )
        for i in range(3):
            want, want_lse = qkv.attention_with_cache(
                q[i : i + 1], k[i : i + 1], v[i : i + 1], own[i], causal=True, return_lse=True
            )
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[i : i + 1], want_lse, atol=1e-5, rtol=1e-5)
    assert [cache.length(f"r{i}") for i in range(3)] == [8, 4, 14]


def test_a_refused_call_leaves_the_paged_cache_unchanged() -> None:
    cache = qkv.PagedKVCache(8, 4, 2, 8)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    qkv.attention_with_cache(q, k, k, cache, sequences=["a", "b"])
    with pytest.raises(ValueError, match="mask is not supported with a PagedKVCache"):
        qkv.attention_with_cache(q, k, k, cache, sequences=["a", "b"], mask=torch.ones(3, 6).bool())
    with pytest.raises(ValueError, match="softcap"):
        qkv.attention_with_cache(q, k, k, cache, sequences=["a", "b"], softcap=-1.0)
    assert cache.lengths(["a", "b"]).tolist() == [3, 3] and cache.free_pages == 6
    with pytest.raises(ValueError, match="sequences"):
        qkv.attention_with_cache(q, k, k, qkv.KVCache(), sequences=["a", "b"])


def test_paged_errors_name_the_argument() -> None:
    b = batch([1, 1], [5, 3])
    cache, seqs = paged_copy(b)
    table, used = cache.block_table(seqs), cache.lengths(seqs)
    call = (b.query, cache.keys, cache.values, b.cu_seq_q, None, 1, 5)
    with pytest.raises(ValueError, match="block_table needs seqused_k"):
        qkv.varlen_attn(*call, enable_gqa=True, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1\] points outside the pool of 64"):
        qkv.varlen_attn(
            *call,
            enable_gqa=True,
            block_table=table.index_fill(0, torch.tensor([1]), 64),
            seqused_k=used,
        )
    with pytest.raises(ValueError, match=r"block_table\[0\] points outside the pool of 64"):
        qkv.varlen_attn(*call, enable_gqa=True, block_table=table * 0 - 1, seqused_k=used)
    # columns past a sequence's pages are never read: any value there is accepted
    padded = torch.cat([table, torch.full((2, 3), -1, dtype=table.dtype)], dim=1)
    out = qkv.varlen_attn(*call, enable_gqa=True, block_table=padded, seqused_k=used)
    torch.testing.assert_close(
        out, qkv.varlen_attn(*call, enable_gqa=True, block_table=table, seqused_k=used)
    )
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 9 needs 3 pages of 4"):
        qkv.varlen_attn(
            *call[:-1], 9, enable_gqa=True, block_table=table, seqused_k=torch.tensor([9, 3])
        )
    with pytest.raises(ValueError, match=r"key must be \(P, page_size, H_kv, D\)"):
        qkv.varlen_attn(
            b.query, b.key, b.value, b.cu_seq_q, None, 1, 5, block_table=table, seqused_k=used
        )
    with pytest.raises(ValueError, match=r"max_k = 4, but sequence 0 has 5 keys"):
        qkv.varlen_attn(*call[:-1], 4, enable_gqa=True, block_table=table, seqused_k=used)
    assert cumulative([1]).tolist() == [0, 1]


def test_the_paged_benchmark_runs_and_agrees() -> None:
    """``qkv bench --paged`` at a small size: pages scattered, the two steps agree."""
    from qkv.bench import paged as bench

    keys = torch.randn(3, 2, 40, 8)
    cache = bench.paged_cache(keys, keys, 16)
    assert cache.pages_of(0) == [0, 3, 6]  # the sequences took pages in turn
    result = bench.paged_benchmark(sequences=3, length=40, heads=4, kv_heads=2, dim=8, repeats=1)
    assert result["max_abs_difference"] < 1e-5 and result["paged_over_contiguous"] > 0


def test_a_sequence_truncated_to_zero_stays_until_freed() -> None:
    cache = qkv.PagedKVCache(4, 4, 1, 2)
    cache.append("r", torch.ones(6, 1, 2), torch.ones(6, 1, 2))
    cache.truncate("r", 0)  # every token rolled back: the request goes on
    assert "r" in cache and cache.length("r") == 0 and cache.pages_of("r") == []
    assert cache.free_pages == 4 and cache.lengths(["r"]).tolist() == [0]
    assert cache.block_table(["r"]).shape == (1, 0)
    cache.append("r", torch.full((5, 1, 2), 2.0), torch.full((5, 1, 2), 3.0))
    assert cache.length("r") == 5 and cache.free_pages == 2
    page = cache.pages_of("r")[1]
    assert torch.equal(cache.keys[page, 0], torch.full((1, 2), 2.0))
    cache.free("r")
    assert "r" not in cache and cache.free_pages == 4


def _caches(page_size: int, held: list[int], dtype: torch.dtype) -> list[qkv.PagedKVCache]:
    """Two equal caches: sequence i holds held[i] tokens (none held: not yet a sequence)."""
    caches = []
    for _ in range(2):
        cache = qkv.PagedKVCache(64, page_size, 2, 3, dtype, value_dim=5)
        for i, n in enumerate(held):
            if n:
                tokens = torch.arange(n * 10.0).view(n, 2, 5).to(dtype)
                cache.append(i, tokens[..., :3], tokens)
        caches.append(cache)
    return caches


@given(
    held=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    new=st.integers(0, 7),
    page_size=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    order=st.randoms(use_true_random=False),
)
def test_a_steps_appends_in_one_write_equal_one_append_per_sequence(
    held: list[int], new: int, page_size: int, dtype: torch.dtype, order: Any
) -> None:
    """``_append_step`` (attention_with_cache's writes: one kernel call on the CPU) leaves the
    pools, lengths, pages and free list that one ``append`` per sequence leaves."""
    each, step = _caches(page_size, held, dtype)
    seqs = list(range(len(held)))
    order.shuffle(seqs)
    k = torch.randn(len(seqs), 2, new, 3).to(dtype)
    v = torch.randn(len(seqs), 2, new, 5).to(dtype)
    for b, seq in enumerate(seqs):
        each.append(seq, k[b].transpose(0, 1), v[b].transpose(0, 1))
    step._append_step(seqs, k, v)
    assert torch.equal(each.keys, step.keys) and torch.equal(each.values, step.values)
    assert each.lengths(seqs).tolist() == step.lengths(seqs).tolist()
    assert [each.pages_of(s) for s in seqs] == [step.pages_of(s) for s in seqs]
    assert each._free == step._free


def test_a_step_the_pool_cannot_hold_raises_and_leaves_the_cache(monkeypatch: Any) -> None:
    """Too few free pages: the one append that runs short raises, and the step's other appends
    are undone (lengths, pages, the tokens held); with the kernel's write and without it."""
    for enabled in (True, False):
        monkeypatch.setattr(qkv.backends.flash.kernel, "ENABLED", enabled)
        cache = qkv.PagedKVCache(3, 2, 2, 4)
        cache.append("a", torch.ones(3, 2, 4), torch.ones(3, 2, 4))
        q, k = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
        with pytest.raises(PoolExhausted, match="needs 2 more pages"):
            qkv.attention_with_cache(q, k, k, cache, sequences=["a", "b"], causal=True)
        assert cache.sequences == ["a"] and cache.length("a") == 3 and cache.free_pages == 1
        table = cache.pages_of("a")
        held = torch.stack([cache.keys[table[t // 2], t % 2] for t in range(3)])
        assert torch.equal(held, torch.ones(3, 2, 4))
        q, k = torch.randn(1, 2, 1, 4), torch.full((1, 2, 1, 4), 2.0)
        qkv.attention_with_cache(q, k, k, cache, sequences=["a"], causal=True)
        assert cache.length("a") == 4
        assert torch.equal(cache.keys[cache.pages_of("a")[1], 1], k[0, :, 0])


class PagedCacheAgainstAList(RuleBasedStateMachine):
    """append / truncate / free / reset on a small pool against a plain model: each sequence a
    list of token values; pages in use are its ceil(length / page_size)."""

    PAGES, PAGE = 6, 3

    def __init__(self) -> None:
        super().__init__()
        self.cache = qkv.PagedKVCache(self.PAGES, self.PAGE, 1, 2, value_dim=1)
        self.model: dict[str, list[float]] = {}
        self.next_value = 0.0

    @rule(seq=st.sampled_from("abc"), count=st.integers(0, 7))
    def append(self, seq: str, count: int) -> None:
        values = [self.next_value + i for i in range(count)]
        self.next_value += count
        k = torch.tensor(values).view(count, 1, 1).expand(count, 1, 2).contiguous()
        v = -torch.tensor(values).view(count, 1, 1)
        tokens = self.model.get(seq, [])
        needed = -(-(len(tokens) + count) // self.PAGE) + len(tokens) // -self.PAGE
        if needed > self.pages_left():
            with pytest.raises(PoolExhausted):
                self.cache.append(seq, k, v)
            return
        self.cache.append(seq, k, v)
        self.model[seq] = tokens + values

    @rule(seq=st.sampled_from("abc"), data=st.data())
    def truncate(self, seq: str, data: st.DataObject) -> None:
        if seq not in self.model:
            with pytest.raises(KeyError):
                self.cache.truncate(seq, 0)
            return
        length = data.draw(st.integers(0, len(self.model[seq])))
        self.cache.truncate(seq, length)
        del self.model[seq][length:]

    @rule(seq=st.sampled_from("abc"))
    def free(self, seq: str) -> None:
        if seq not in self.model:
            with pytest.raises(KeyError):
                self.cache.free(seq)
            return
        self.cache.free(seq)
        del self.model[seq]

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.model.clear()

    def pages_left(self) -> int:
        in_use = sum(-(-len(tokens) // self.PAGE) for tokens in self.model.values())
        return self.PAGES - in_use

    @invariant()
    def the_cache_holds_what_the_model_holds(self) -> None:
        assert sorted(self.cache.sequences) == sorted(self.model)
        assert self.cache.free_pages == self.pages_left()
        owned = [page for seq in self.model for page in self.cache.pages_of(seq)]
        assert len(owned) == len(set(owned)) == self.PAGES - self.pages_left()
        for seq, tokens in self.model.items():
            assert self.cache.length(seq) == len(tokens)
            assert len(self.cache.pages_of(seq)) == -(-len(tokens) // self.PAGE)
            if not tokens:
                continue
            row = self.cache.block_table([seq])[0].long()
            read = self.cache.keys[row].flatten(0, 1)[: len(tokens), 0]  # (length, 2)
            want = torch.tensor(tokens)
            assert torch.equal(read, want[:, None].expand(-1, 2))
            assert torch.equal(self.cache.values[row].flatten(0, 1)[: len(tokens), 0, 0], -want)
        lengths = self.cache.lengths(list(self.model)).tolist()
        assert lengths == [len(tokens) for tokens in self.model.values()]


PagedCacheAgainstAList.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
test_the_paged_cache_against_a_plain_model = PagedCacheAgainstAList.TestCase
