"""``qkv.flex_attention``: torch's FlexAttention, on the CPU, with gradients.

    from qkv import flex_attention          # instead of torch.nn.attention.flex_attention
    out = flex_attention(q, k, v, score_mod=rel_bias, block_mask=create_block_mask(...))

Same signature and meanings as ``torch.nn.attention.flex_attention.flex_attention`` (torch 2.13):
q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev); ``score_mod(score, b, h, q_idx, kv_idx)``
on the scaled score; ``block_mask`` a ``BlockMask`` from ``create_block_mask``, whose blocks
decide which pairs are looked at (blocks it leaves out are masked, full blocks are not masked,
partial blocks by its mask_mod); ``enable_gqa``; ``return_lse`` (natural log, float32 for
float16/bfloat16). It runs on qkv's flash backend (``qkv.backends.flash.mods``), memory linear
in length and differentiable, also to the tensors score_mod captures. On CUDA, where torch's
compiled FlexAttention runs, the call is handed over to it. Legend: B batch, Hq/Hkv heads,
L/S lengths, QB/KB a BlockMask's query/key block sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qkv import _checks, _tracing, mods
from qkv.functional import attention
from qkv.mods import ScoreMod

EMPTY, PARTIAL, FULL = 0, 1, 2
_TORCH_COMPILED: dict[str, Callable[..., Any]] = {}


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention: ``softmax(score_mod(q kᵀ · scale) masked by block_mask) v``, out
    (B, Hq, L, Ev) in query's dtype [, lse (B, Hq, L)]. Fully masked rows give 0 (lse −inf)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.tensor(name, x, min_ndim=4)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, E), got {_checks.shape_str(x.shape)}")
    hq, hkv = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hkv:
        raise ValueError(
            f"query and key must have the same number of heads without enable_gqa, got "
            f"Hq={hq} and Hkv={hkv}; pass enable_gqa=True for grouped-query attention"
        )
    if query.shape[0] != key.shape[0]:
        raise ValueError(
            f"query and key must have the same batch size B, got {query.shape[0]} and "
            f"{key.shape[0]}"
        )
    if query.is_cuda:  # torch's compiled kernels run here: hand over
        handed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _torch_flex(
            query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse
        )
        return handed
    mask_mod = None
    if block_mask is not None:
        mask_mod = BlockSparse(block_mask, query, key)
    result = attention(
        query,
        key,
        value,
        scale=scale,
        score_mod=score_mod,
        mask_mod=mask_mod,
        return_lse=_checks.boolean("return_lse", return_lse),
        backend="flash",
    )
    if isinstance(result, tuple):
        out, lse = result
        return out, lse
    return result


def _torch_flex(*args: Any) -> Any:
    """torch's own FlexAttention, compiled once per process (CUDA)."""
    from torch.nn.attention import flex_attention as torch_flex

    if "cuda" not in _TORCH_COMPILED:
        _TORCH_COMPILED["cuda"] = torch.compile(torch_flex.flex_attention)
    return _TORCH_COMPILED["cuda"](*args)


class BlockSparse:
    """A ``BlockMask`` as a mask_mod qkv's tiles take: a pair may attend when its block is full,
    or partial and the BlockMask's mask_mod allows it; never in a block the BlockMask leaves
    out. ``qkv_occupancy`` gives flash its tiles' states straight from the blocks (the mask_mod
    is not evaluated to find them)."""

    def __init__(self, block_mask: Any, query: torch.Tensor, key: torch.Tensor) -> None:
        from torch.nn.attention.flex_attention import BlockMask, noop_mask

        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (from "
                f"create_block_mask) or None, got {type(block_mask).__name__}"
            )
        self.q_block, self.kv_block = (int(s) for s in block_mask.BLOCK_SIZE)
        lq, lk = query.shape[-2], key.shape[-2]
        _check_fits(block_mask, query, lq, lk, self.q_block, self.kv_block)
        self.states = _block_states(block_mask)  # (Bm, Hm, nQ, nKV) int8
        self.mask_mod = None if block_mask.mask_mod is noop_mask else block_mask.mask_mod
        if self.mask_mod is not None and _tracing.traced(query):  # (see ``mods.dense_keep``)
            self.mask_mod = mods.per_score(self.mask_mod)
        elif self.mask_mod is not None:  # on blocks or per score
            corner = mods.indices(query.shape[0], query.shape[1], 0, min(lq, 32), 0, 1, key.device)
            corner = (*corner[:3], mods.indices(1, 1, 0, 1, 0, min(lk, 64), key.device)[3])
            self.mask_mod = mods.resolve("mask_mod", self.mask_mod, corner, torch.bool)

    def __call__(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        """Bool (B, Hq, R, C)-broadcastable: True where the pair may attend."""
        bm, hm = self.states.shape[:2]
        first = b.new_zeros((1, 1, 1, 1))  # a BlockMask made for B = 1 or H = 1 broadcasts
        state = self.states[
            b if bm > 1 else first,
            h if hm > 1 else first,
            q_idx // self.q_block,
            kv_idx // self.kv_block,
        ]
        keep = state == FULL
        if self.mask_mod is None:
            return keep | (state == PARTIAL)
        partial_keep: torch.Tensor = self.mask_mod(b, h, q_idx, kv_idx)
        return keep | ((state == PARTIAL) & partial_keep)

    def qkv_occupancy(
        self, shape: tuple[int, int, int, int], query_tile: int, key_block: int
    ) -> torch.Tensor:
        """(query tiles, key blocks) int8 EMPTY/PARTIAL/FULL of flash's query_tile × key_block
        blocks, over every batch entry and head, from the BlockMask's blocks."""
        _, _, lq, lk = shape
        states = self.states.cpu()
        tiles = math.ceil(lq / query_tile)
        blocks = math.ceil(lk / key_block)
        result = torch.empty(tiles, blocks, dtype=torch.int8)
        pad = blocks * key_block - lk
        for i in range(tiles):
            q0, q1 = i * query_tile, min(lq, (i + 1) * query_tile)
            rows = states[:, :, q0 // self.q_block : (q1 - 1) // self.q_block + 1]
            some = (rows != EMPTY).flatten(0, 2).any(dim=0)  # (nKV,)
            every = (rows == FULL).flatten(0, 2).all(dim=0)
            columns = torch.stack([some, every]).repeat_interleave(self.kv_block, dim=1)[:, :lk]
            columns = torch.cat([columns, columns.new_tensor([[False], [True]]).expand(2, pad)], 1)
            per_block = columns.view(2, blocks, key_block)
            some_b, every_b = per_block[0].any(dim=1), per_block[1].all(dim=1)
            result[i] = torch.where(every_b, FULL, torch.where(some_b, PARTIAL, EMPTY))
        return result


def _check_fits(
    block_mask: Any, query: torch.Tensor, lq: int, lk: int, q_block: int, kv_block: int
) -> None:
    """ValueError unless the BlockMask was made for these lengths, batch and heads."""
    mask_lq, mask_lk = (int(s) for s in block_mask.seq_lengths)
    if (mask_lq, mask_lk) != (lq, lk):
        raise ValueError(
            f"block_mask was made for lengths (L, S) = ({mask_lq}, {mask_lk}) but the call has "
            f"({lq}, {lk}); make it with create_block_mask(mask_mod, B, H, {lq}, {lk})"
        )
    blocks = tuple(block_mask.kv_indices.shape[-2:])
    expected = (math.ceil(lq / q_block), math.ceil(lk / kv_block))
    if blocks != expected:
        raise ValueError(
            f"block_mask's BLOCK_SIZE {tuple(block_mask.BLOCK_SIZE)} and kv_indices "
            f"{_checks.shape_str(block_mask.kv_indices.shape)} do not fit lengths ({lq}, {lk}): "
            f"expected {expected} query x key blocks, got {blocks}"
        )
    bm, hm = block_mask.kv_indices.shape[0], block_mask.kv_indices.shape[1]
    if bm not in (1, query.shape[0]) or hm not in (1, query.shape[1]):
        raise ValueError(
            f"block_mask's batch and heads ({bm}, {hm}) must be 1 or the query's "
            f"({query.shape[0]}, {query.shape[1]})"
        )
    if block_mask.kv_indices.device != query.device:
        raise ValueError(
            f"block_mask is on {block_mask.kv_indices.device} but query on {query.device}"
        )


def _block_states(block_mask: Any) -> torch.Tensor:
    """(Bm, Hm, nQ, nKV) int8: FULL for the full blocks, PARTIAL for the other listed ones
    (kv_indices' first kv_num_blocks per row), EMPTY elsewhere."""
    shape = block_mask.kv_indices.shape
    device = block_mask.kv_indices.device
    states = torch.zeros(*shape[:-1], shape[-1] + 1, dtype=torch.int8, device=device)
    for num, idx, value in (
        (block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL),
    ):
        if num is None or idx is None:
            continue
        listed = torch.arange(idx.shape[-1], device=device) < num[..., None]  # (Bm, Hm, nQ, n)
        target = idx.long().masked_fill(~listed, shape[-1])  # unlisted: the spare last column
        states.scatter_(-1, target, torch.full_like(target, value, dtype=torch.int8))
    return states[..., :-1].contiguous()
