"""How flash runs ``qkv.varlen_attn``: a packed batch as one kernel call whose query rows each
see their own sequence's keys.

The compiled kernel takes, per query row, the range of keys [lo, hi) it may see (``rules.h``'s
KeyBounds). A packed batch is one (1, H_q, T_q, D) call whose row r of sequence i gets
lo = k_start_i + max(0, p − left), hi = k_start_i + min(k_len_i, p + right + 1), with
p = r − q_start_i + k_len_i − q_len_i its position among the sequence's keys: each sequence's
own bottom-right diagonal and window, and tiles outside every row's range are skipped, so a
packed batch costs what its sequences cost alone. A third column gives each row its own ALiBi
shift (the kernel's distance i + shift − j is then p − (j − k_start_i)). The table rides in
``Rules.key_ranges`` through flash's one autograd function (``autograd.py``), forward and backward.

Where the kernel does not run (float64, another device, no kernel) ``qkv.varlen`` runs each
sequence alone: the same rules, by definition. Paged pools
are read in ``paged.py``; ``sequences.py`` holds the batch's layout and each row's keys.
Legend: N sequences, T_q / T_k packed tokens, H_q / H_kv heads, D / Dv features.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qkv.backends.base import Rules, default_scale
from qkv.backends.flash import autograd, kernel
from qkv.backends.flash import paged as paged_reading
from qkv.backends.flash.rules import decoding_slopes
from qkv.backends.flash.sequences import Packing, VarlenRules, rows


def kernel_ranges(packing: Packing, rules: VarlenRules) -> torch.Tensor:
    """(1, T_q, 3) int64 as the kernel takes them: each row's packed keys [lo, hi) and its ALiBi
    shift (distance i + shift − j for packed row i and packed key j)."""
    table = rows(packing, rules)
    sequence, lo, hi, position = table.unbind(dim=1)
    k_start = torch.tensor(packing.k_start, dtype=torch.long)[sequence]
    packed_row = torch.arange(sequence.numel())
    shift = position + k_start - packed_row
    return torch.stack([lo + k_start, hi + k_start, shift], dim=1)[None].contiguous()


def packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packing: Packing,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out (T_q, H_q, Dv) in query's dtype and lse (H_q, T_q) on the kernel, both
    differentiable; None where it does not take the call (the caller then runs each sequence
    alone): float64, another device, no kernel."""
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (query, key, value))  # (1, H, T, D) views
    if not kernel.takes(q4, k4, v4):
        return None
    if decoding(query, key, value, packing, rules):
        return _decode(query, key, value, packing, rules)
    packed_rules = Rules(
        softcap=rules.softcap,
        alibi_slopes=rules.alibi_slopes,
        sinks=rules.sinks,
        key_ranges=kernel_ranges(packing, rules),
    )
    out, lse = autograd.attention(q4, k4, v4, autograd.Pass(rules.scale, rules=packed_rules))
    return out[0].transpose(0, 1).to(query.dtype), lse[0]


def paged(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    packing: Packing,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (T_q, H_q, Dv) and lse (H_q, T_q) against a paged pool, read where its pages lie."""
    assert packing.table is not None
    table = rows(packing, rules)
    out, lse = paged_reading.attend(query, pool_k, pool_v, packing.table, table, rules)
    if rules.sinks is not None:
        from qkv.backends.flash import with_sinks

        out4, lse4 = with_sinks(out.transpose(0, 1)[None], lse[None], rules.sinks)
        out, lse = out4[0].transpose(0, 1), lse4[0]
    return out.to(query.dtype), lse


_PLAIN_DTYPES = (torch.float32, torch.bfloat16)


def plain(
    query: Any,
    key: Any,
    value: Any,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: Any,
    max_k: Any,
    seqused_k: Any,
    block_table: Any,
    **rules: Any,
) -> torch.Tensor | None:
    """The output of a plain decoding call of ``qkv.varlen_attn`` straight from the kernel
    (``paged.h``'s plain_paged_decode, plain_packed_decode), or None where the call is not one
    (then it takes the whole path). ``rules``: scale, causal, enable_gqa.

    Plain: the lengths, ``causal``, ``scale`` and ``enable_gqa`` and nothing more (the caller has
    checked that no window, softcap, ALiBi, sinks or lse is asked for); pages (``block_table``,
    ``seqused_k``, no ``cu_seq_k``) or packed keys (``cu_seq_k``, no ``seqused_k``) with fewer
    than ``kernel.DECODE_QUERIES`` query tokens a sequence; eager CPU tensors of one dtype,
    float32 or bfloat16, nothing empty, no gradient to record, the kernel built. The whole path
    would run ``paged`` or ``_decode`` on the same kernel with the same rows: the same bits. Its
    checks of the lengths and the table (a tensor operation each) are made by the kernel as
    tests; any that fails sends the call to the whole path, which raises."""
    paged = block_table is not None
    given = (seqused_k, block_table) if paged else (cu_seq_k,)
    if (cu_seq_k if paged else seqused_k) is not None:
        return None
    tensors = (query, key, value, cu_seq_q, *given)
    scale = _plain_scale(tensors, 4 if paged else 3, max_q, max_k, **rules)
    if scale is None:
        return None
    causal, queries, splits = rules["causal"], kernel.DECODE_QUERIES, kernel.DECODE_SPLITS
    module = kernel.load()
    if paged:
        result = module.plain_paged_decode(  # type: ignore[union-attr]
            query, key, value, cu_seq_q, *given, max_q, max_k, causal, scale, splits
        )
    else:
        result = module.plain_packed_decode(  # type: ignore[union-attr]
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, queries, causal, scale, splits
        )
    if not result:
        return None
    out: torch.Tensor = result[0]
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _plain_scale(
    tensors: tuple[Any, ...], kv_dims: int, max_q: Any, max_k: Any, **rules: Any
) -> float | None:
    """The scale of a plain decoding call (``plain`` says which) of query, keys and values (the
    first three of ``tensors``, keys of ``kv_dims`` dimensions: pools or packed), or None where
    the call is not one."""
    query, key, value = tensors[:3]
    if any(type(x) is not torch.Tensor for x in tensors) or torch.compiler.is_compiling():
        return None  # (subclasses and a tracer's tensors: the whole path)
    causal, enable_gqa, scale = rules["causal"], rules["enable_gqa"], rules["scale"]
    if type(causal) is not bool or type(enable_gqa) is not bool:
        return None
    if type(max_q) is not int or type(max_k) is not int or min(max_q, max_k) < 0:
        return None
    dtype = query.dtype
    if dtype not in _PLAIN_DTYPES or key.dtype != dtype or value.dtype != dtype:
        return None
    if query.dim() != 3 or key.dim() != kv_dims or key.shape[:-1] != value.shape[:-1]:
        return None
    (_, hq, d), hkv = query.shape, key.shape[-2]
    if key.shape[-1] != d or hkv == 0 or hq % hkv or (hq != hkv and not enable_gqa):
        return None
    if 0 in query.shape or 0 in value.shape or not all(x.is_cpu for x in tensors):
        return None
    rows_contiguous = key.stride(-1) == 1 and value.stride(-1) == 1
    pools_contiguous = query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    if not (pools_contiguous if kv_dims == 4 else rows_contiguous):
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return None
    if scale is None:
        scale = default_scale(d)
    elif type(scale) is not float or not math.isfinite(scale):
        return None  # (the whole path checks it)
    return float(scale) if kernel.ENABLED and kernel.available() else None


def decoding(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packing: Packing,
    rules: VarlenRules,
) -> bool:
    """Whether a packed call runs on the decoding core (``paged.h``'s packed_decode: each
    sequence's keys read where they lie, no copy): no gradient is asked for, float32 or bfloat16,
    and every sequence has fewer than ``kernel.DECODE_QUERIES`` query tokens (decoding, mixed
    with a few speculative tokens; a longer prompt takes the block kernel)."""
    tensors = (query, key, value, rules.alibi_slopes, rules.sinks)
    wants_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    return (
        not wants_grad
        and query.dtype in (torch.float32, torch.bfloat16)
        and max(packing.q_len, default=0) < kernel.DECODE_QUERIES
    )


def _decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packing: Packing,
    rules: VarlenRules,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed`` on the decoding core: out (T_q, H_q, Dv) in query's dtype, lse (H_q, T_q)."""
    module = kernel.load()
    assert module is not None  # built by takes
    out, lse = module.packed_decode(
        query.contiguous(),
        key if key.stride(-1) == 1 else key.contiguous(),
        value if value.stride(-1) == 1 else value.contiguous(),
        torch.tensor(packing.k_start, dtype=torch.long),
        rows(packing, rules),
        rules.scale,
        rules.softcap or 0.0,
        decoding_slopes(rules.alibi_slopes),
        kernel.DECODE_SPLITS,
    )
    lse = lse.transpose(0, 1)
    if rules.sinks is not None:
        from qkv.backends.flash import with_sinks

        out4, lse4 = with_sinks(out.transpose(0, 1)[None], lse[None], rules.sinks)
        out, lse = out4[0].transpose(0, 1), lse4[0]
    return out.to(query.dtype), lse
