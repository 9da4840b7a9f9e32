"""``PagedKVCache``: keys and values of many sequences in one pool of fixed-size pages.

A server decodes many requests at once, each of its own length, and cannot reserve the longest
length for each. The pool holds ``pages`` pages of ``page_size`` tokens, keys (P, page_size,
H_kv, D) and values (P, page_size, H_kv, Dv); a sequence takes a page when its last one is full
and gives all back when it is freed. Its block table row lists its pages in order, so its key t
is token t % page_size of page row[t // page_size]: exactly what ``qkv.varlen_attn`` reads
(``block_table``, ``seqused_k``), in place.

Sequences are named by the caller: any hashable id (a request id), created by its first
``append``. Legend: P pages, H_kv key/value heads, D / Dv features, L new tokens, N sequences.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from qkv import _checks

__all__ = ["PagedKVCache", "PoolExhausted"]


class PoolExhausted(RuntimeError):
    """The pool has fewer free pages than an ``append`` needs (nothing was written)."""


class PagedKVCache:
    """A pool of ``pages`` pages of ``page_size`` tokens for keys and values, shared by
    sequences that each hold a list of pages (their block table row).

    ``keys`` (P, page_size, H_kv, D) and ``values`` (P, page_size, H_kv, Dv) are the pools;
    ``value_dim`` (Dv) defaults to ``head_dim``. ``append(seq, k, v)`` adds tokens to a sequence
    (creating it), ``free(seq)`` returns its pages, ``length(seq)`` counts its tokens, and
    ``block_table(seqs)`` / ``lengths(seqs)`` give ``varlen_attn``'s ``block_table`` and
    ``seqused_k`` for a batch of sequences.
    """

    def __init__(
        self,
        pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str | None = None,
        value_dim: int | None = None,
    ) -> None:
        for name, value in (("pages", pages), ("page_size", page_size), ("kv_heads", kv_heads)):
            _checks.positive_int(name, value)
        _checks.positive_int("head_dim", head_dim)
        value_dim = head_dim if value_dim is None else _checks.positive_int("value_dim", value_dim)
        if not isinstance(dtype, torch.dtype) or dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.page_size = page_size
        self.keys = torch.zeros(pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(pages, page_size, kv_heads, value_dim, dtype=dtype, device=device)
        self._free = list(range(pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(pages={self.keys.shape[0]}, page_size={self.page_size}, "
            f"sequences={len(self._lengths)}, free_pages={self.free_pages})"
        )

    def __contains__(self, seq: object) -> bool:
        return seq in self._lengths

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> list[Hashable]:
        """The ids of the sequences held, in the order they were created."""
        return list(self._lengths)

    def length(self, seq: Hashable) -> int:
        """The number of tokens sequence ``seq`` holds."""
        return self._lengths[self._known(seq)]

    def pages_of(self, seq: Hashable) -> list[int]:
        """The pages sequence ``seq`` holds, in order (its block table row)."""
        return list(self._pages[self._known(seq)])

    def append(self, seq: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add L tokens to sequence ``seq`` (created if new): k (L, H_kv, D), v (L, H_kv, Dv),
        in the pool's dtype and on its device. Takes the pages it needs from the pool, or
        raises ``PoolExhausted`` (writing nothing) where there are too few."""
        self._check_tokens(k, v)
        length = self._lengths.get(seq, 0)
        owned = self._pages.get(seq, [])
        needed = -(-(length + k.shape[0]) // self.page_size) - len(owned)
        if needed > len(self._free):
            raise PoolExhausted(
                f"PagedKVCache: sequence {seq!r} needs {needed} more pages of {self.page_size} "
                f"tokens for {k.shape[0]} new tokens, but only {len(self._free)} of "
                f"{self.keys.shape[0]} are free; free finished sequences or make a larger pool"
            )
        owned = owned + [self._free.pop() for _ in range(needed)]
        self._pages[seq], self._lengths[seq] = owned, length + k.shape[0]
        written = 0
        while written < k.shape[0]:  # page by page, from the first free slot
            position = length + written
            page, slot = owned[position // self.page_size], position % self.page_size
            n = min(self.page_size - slot, k.shape[0] - written)
            self.keys[page, slot : slot + n] = k[written : written + n]
            self.values[page, slot : slot + n] = v[written : written + n]
            written += n

    def _append_step(
        self, seqs: Sequence[Hashable], k_new: torch.Tensor, v_new: torch.Tensor
    ) -> None:
        """``append(seqs[b], k_new[b].transpose(0, 1), v_new[b].transpose(0, 1))`` for each b in
        turn, k_new (N, H_kv, L, D) and v_new (N, H_kv, L, Dv) for N distinct sequences: the same
        checks, the same pages in the same order. On the CPU with flash's compiled kernel the
        tokens are written by one kernel call (``paged_write``), in place of two small tensor
        copies per sequence (a decoding step's N appends cost more than its attention); where the
        pool has too few free pages, the appends run one by one and the one that runs short
        raises."""
        if not seqs:
            return
        self._check_tokens(k_new[0].transpose(0, 1), v_new[0].transpose(0, 1))
        count = k_new.shape[2]
        lengths = [self._lengths.get(seq, 0) for seq in seqs]
        held = [self._pages.get(seq, []) for seq in seqs]
        needed = [-(-(n + count) // self.page_size) - len(p) for n, p in zip(lengths, held)]
        writer = _writer(self.keys, self.values, k_new, v_new)
        if writer is None or sum(needed) > len(self._free):
            for b, seq in enumerate(seqs):
                self.append(seq, k_new[b].transpose(0, 1), v_new[b].transpose(0, 1))
            return
        pages, slots = [], []
        for seq, length, owned, more in zip(seqs, lengths, held, needed):
            owned = owned + [self._free.pop() for _ in range(more)]
            self._pages[seq], self._lengths[seq] = owned, length + count
            for position in range(length, length + count):
                pages.append(owned[position // self.page_size])
                slots.append(position % self.page_size)
        writer.paged_write(self.keys, self.values, k_new, v_new, pages, slots)

    def free(self, seq: Hashable) -> None:
        """Forget sequence ``seq`` and return its pages to the pool."""
        pages = self._pages.pop(self._known(seq))
        del self._lengths[seq]
        self._free.extend(reversed(pages))

    def truncate(self, seq: Hashable, length: int) -> None:
        """Keep only the first ``length`` tokens of ``seq`` (its later pages return to the
        pool). The sequence stays, also at length 0 (every page returned): ``append``
        continues it and ``free`` forgets it, as for a request whose tokens were all rolled
        back."""
        _checks.non_negative_int("length", length)
        if length > self.length(seq):
            raise ValueError(f"length must be <= {self.length(seq)} (seq {seq!r}), got {length}")
        keep = -(-length // self.page_size)
        self._free.extend(reversed(self._pages[seq][keep:]))
        self._pages[seq], self._lengths[seq] = self._pages[seq][:keep], length

    def reset(self) -> None:
        """Forget every sequence."""
        for seq in self.sequences:
            self.free(seq)

    def block_table(self, seqs: Sequence[Hashable] | None = None) -> torch.Tensor:
        """(N, max_pages) int32 on the pool's device: row i lists the pages of ``seqs[i]``
        (default: every sequence, in ``sequences`` order), padded with page 0 past its end."""
        seqs = self.sequences if seqs is None else list(seqs)
        owned = [self._pages[self._known(seq)] for seq in seqs]
        width = max((len(pages) for pages in owned), default=0)
        rows = [pages + [0] * (width - len(pages)) for pages in owned]
        return torch.tensor(rows, dtype=torch.int32).view(len(seqs), width).to(self.keys.device)

    def lengths(self, seqs: Sequence[Hashable] | None = None) -> torch.Tensor:
        """(N,) int32 on the pool's device: the tokens each of ``seqs`` holds (``seqused_k``)."""
        seqs = self.sequences if seqs is None else list(seqs)
        counts = [self._lengths[self._known(seq)] for seq in seqs]
        return torch.tensor(counts, dtype=torch.int32, device=self.keys.device)

    def _known(self, seq: Any) -> Hashable:
        if seq not in self._lengths:
            raise KeyError(f"PagedKVCache holds no sequence {seq!r} (it holds {self.sequences})")
        known: Hashable = seq
        return known

    def _check_tokens(self, k: Any, v: Any) -> None:
        _, _, hkv, d = self.keys.shape
        for name, x, features in (("k", k, d), ("v", v, self.values.shape[-1])):
            _checks.tensor(name, x, ndims=(3,))
            if x.shape[1:] != (hkv, features):
                raise ValueError(
                    f"{name} must be (L, H_kv, {'D' if name == 'k' else 'Dv'}) = (L, {hkv}, "
                    f"{features}), got {_checks.shape_str(x.shape)}"
                )
            if x.dtype != self.keys.dtype or x.device != self.keys.device:
                raise TypeError(
                    f"{name} must be {self.keys.dtype} on {self.keys.device} like the pool, got "
                    f"{x.dtype} on {x.device}"
                )
            if x.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(
                    f"{name} requires grad, but a PagedKVCache is for inference: append under "
                    "torch.no_grad() or append a detached tensor"
                )
        if k.shape[0] != v.shape[0]:
            raise ValueError(
                f"k and v must hold the same L tokens, got {k.shape[0]} and {v.shape[0]}"
            )


def _writer(*tensors: torch.Tensor) -> Any:
    """flash's compiled kernel where its ``paged_write`` takes these pools and new keys and
    values (all on the CPU, rows contiguous), else None."""
    from qkv.backends.flash import kernel

    if not all(x.is_cpu and x.stride(-1) == 1 for x in tensors) or not kernel.ENABLED:
        return None
    return kernel.load()


def attention_with_paged_cache(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKVCache,
    sequences: Sequence[Hashable] | None,
    options: dict[str, Any],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``qkv.attention_with_cache`` for a ``PagedKVCache``: batch entry b of q (B, Hq, L, D),
    k_new (B, H_kv, L, D) and v_new (B, H_kv, L, Dv) is sequence ``sequences[b]`` (default b);
    its L keys and values are appended, then its queries attend to all its tokens through
    ``varlen_attn`` reading the pages in place. Returns out (B, Hq, L, Dv) [, lse (B, Hq, L)].
    A call refused for a bad argument leaves the cache unchanged."""
    from qkv.varlen import AuxRequest, varlen_attn

    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        _checks.tensor(name, x, ndims=(4,))
    b, hq, length = q.shape[0], q.shape[1], q.shape[2]
    if k_new.shape[0] != b or k_new.shape[2] != length or v_new.shape[:3] != k_new.shape[:3]:
        raise ValueError(
            f"q (B, Hq, L, D), k_new (B, H_kv, L, D) and v_new (B, H_kv, L, Dv) must share B and "
            f"L, got q {_checks.shape_str(q.shape)}, k_new {_checks.shape_str(k_new.shape)}, "
            f"v_new {_checks.shape_str(v_new.shape)}"
        )
    seqs = list(range(b)) if sequences is None else list(sequences)
    if len(seqs) != b or len(set(seqs)) != b:
        raise ValueError(f"sequences must name the B = {b} batch entries once each, got {seqs!r}")
    keywords = _varlen_options(options)
    before = {seq: cache.length(seq) if seq in cache else None for seq in seqs}
    try:
        cache._append_step(seqs, k_new, v_new)
        lengths = cache.lengths(seqs)
        cu_seq_q = torch.arange(0, b * length + 1, max(length, 1), dtype=torch.int32)[: b + 1]
        result = varlen_attn(
            q.permute(0, 2, 1, 3).reshape(b * length, hq, q.shape[-1]),
            cache.keys,
            cache.values,
            cu_seq_q.to(q.device),
            None,
            length,
            int(lengths.max()) if b else 0,
            seqused_k=lengths,
            block_table=cache.block_table(seqs),
            enable_gqa=True,
            return_aux=AuxRequest(lse=bool(options["return_lse"])),
            **keywords,
        )
    except Exception:
        for seq, count in before.items():  # undo this call's appends
            if seq in cache and count is None:
                cache.free(seq)
            elif seq in cache and count is not None:
                cache.truncate(seq, count)
        raise
    out, lse = result if isinstance(result, tuple) else (result, None)
    out = out.view(b, length, hq, -1).permute(0, 2, 1, 3)
    if lse is None:
        return out
    return out, lse.view(hq, b, length).permute(1, 0, 2)


def _varlen_options(options: dict[str, Any]) -> dict[str, Any]:
    """``attention_with_cache``'s keywords as ``varlen_attn``'s, refusing what a paged cache
    does not do (a mask, dropout, weights, segments, top-left causal)."""
    refused = {"mask": None, "dropout_p": 0.0, "return_weights": False, "segments": None}
    for name, default in refused.items():
        value = options[name]
        if (value is not None) if default is None else (value != default):
            raise ValueError(
                f"{name} is not supported with a PagedKVCache (use a KVCache, "
                f"or leave {name} at {default!r})"
            )
    if options["backend"] not in ("auto", "flash"):
        raise ValueError(
            f'backend={options["backend"]!r} cannot read a PagedKVCache\'s pages; use "auto" '
            'or "flash"'
        )
    causal = options["causal"]
    _checks.choice("causal", causal, (False, True, "bottom-right", "top-left"))
    if causal == "top-left":
        raise ValueError(
            'causal="top-left" is not supported with a PagedKVCache (decoding '
            "aligns the last query with the last key: use causal=True)"
        )
    window = options["window"]
    window_size = (-1, -1)
    if window is not None:
        checked = _checks.window("window", window, causal)
        left, right = (checked - 1, 0) if isinstance(checked, int) else checked
        window_size = (-1 if left is None else left, -1 if right is None else right)
    alibi = options["alibi_slopes"]
    if alibi is not None and alibi.dim() != 1:
        raise ValueError(
            f"alibi_slopes must be (Hq,) with a PagedKVCache, got {tuple(alibi.shape)}"
        )
    return {
        "scale": options["scale"],
        "window_size": window_size,
        "causal": causal is not False,
        "softcap": options["softcap"],
        "alibi_slopes": alibi,
        "sinks": options["sinks"],
    }
