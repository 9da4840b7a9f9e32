"""flash's forward and backward passes with a score_mod / mask_mod on the compiled kernel, the
mods run as programs (``program.py``, ``program.h``): no Python per tile.

``forward`` takes a call where the kernel takes its tensors (CPU; float32, bfloat16 or
float16; at least ``kernel.DECODE_QUERIES`` queries), it has no float mask, no soft-cap and no
ALiBi slopes beside the mods (their order with the score_mod is the loop's to define), both
mods have programs, and, where a backward pass follows, no tensor the score_mod captures needs
a gradient (such calls, a learned bias table, run forward and backward on the exact path); else
it returns None and the call takes the exact path (the loop with ``TileMods``). ``backward``
then runs the backward pass of such a forward pass on the kernel: each tile's scores recomputed,
the programs applied as the forward pass applied them, and the score program's derivative with
respect to the score (forward mode, ``program.h``) multiplying the scores' gradient.

A ``BlockMask``'s states are used as they are where its blocks are multiples of the kernel's
128 × 128 state blocks (otherwise the exact path); a plain mask_mod's states are found by
evaluating it block by block, once per mask_mod, shape and version of the tensors it reads (a
small cache). The program is proven equal to the eager mods on the first tile of the first call
that runs it (``prove``; the score program's derivative against ``torch.autograd`` too) and the
verdict cached per mod and version of the tensors they read: a program that differs warns once
and those mods keep the exact path.

``ENABLED = False`` (env ``QKV_FLEX_PROGRAM=0``) sends every call to the exact path.
"""

from __future__ import annotations

import collections
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from qkv import mods as own
from qkv.backends.base import Call, Rules
from qkv.backends.flash import kernel
from qkv.backends.flash import mods as flash_mods
from qkv.backends.flash.loop import flat_heads
from qkv.backends.flash.program import (
    KEY_BLOCK,
    NO_CODE,
    QUERY_BLOCK,
    STATE_BLOCK,
    Program,
    Unsupported,
    lower,
)
from qkv.backends.flash.rules import kernel_ranges

ENABLED = os.environ.get("QKV_FLEX_PROGRAM", "1") != "0"
_PROGRAMS: collections.OrderedDict[Any, Program | None] = collections.OrderedDict()
_STATES: collections.OrderedDict[Any, torch.Tensor] = collections.OrderedDict()
EMPTY, PARTIAL, FULL = flash_mods.EMPTY, flash_mods.PARTIAL, flash_mods.FULL


def forward(
    call: Call, rules: Rules, differentiable: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out (*B, Hq, Lq, Dv) float32, lse (*B, Hq, Lq)) without sinks, on the kernel with the
    mods' program, or None where it does not run this call (see the module doc;
    ``differentiable``: a backward pass follows)."""
    q, k, v = call.q, call.k, call.v
    plan = _plan(call, rules, differentiable)
    if plan is None:
        return None
    program, states, ranges = plan
    *_, hq, lq, _ = call.scores_shape
    offset, window = call.causal_offset, rules.window_offset
    low = q.dtype == torch.bfloat16 and kernel.bfloat16_products()
    q_flat, k_flat, v_flat, batch_shape = flat_heads(
        q, k, v, torch.bfloat16 if low else torch.float32
    )
    module = kernel.load()
    assert module is not None  # (kernel.takes built it)
    out, lse = module.forward_program(
        q_flat.flatten(0, 1).contiguous(),
        k_flat.contiguous(),
        v_flat.contiguous(),
        call.scale,
        offset is not None,
        offset or 0,
        window is not None,
        window or 0,
        kernel.PRODUCTS.index(kernel.cached_products()),
        *ranges,
        *program.arguments(),
        states,
        hq,
    )
    return out.view(*batch_shape, hq, *out.shape[1:]), lse.view(*batch_shape, hq, lq)


def backward(
    call: Call,
    rules: Rules,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(dq, dk, dv) float32 with the shapes of q, k and v, of a call whose forward pass ran on
    ``forward`` with a backward pass to follow (out, lse as it gave them; grad_lse: None for
    none), or None where the kernel does not run it (q, k, v of different batch shapes)."""
    q, k, v = call.q, call.k, call.v
    plan = _plan(call, rules, True)
    if plan is None or not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        return None
    program, states, ranges = plan
    hq = call.scores_shape[-3]
    offset, window = call.causal_offset, rules.window_offset
    module = kernel.load()
    assert module is not None
    dq, dk, dv = module.backward_program(
        *kernel.backward_tensors(q, k, v, out, grad_out, lse, grad_lse),
        call.scale,
        offset is not None,
        offset or 0,
        window is not None,
        window or 0,
        kernel.PRODUCTS.index(kernel.cached_products()),
        *ranges,
        *program.arguments(),
        states,
        hq,
    )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _plan(
    call: Call, rules: Rules, differentiable: bool
) -> tuple[Program, torch.Tensor, tuple[torch.Tensor, int]] | None:
    """The call's program, block states and key ranges, or None where it takes the exact path."""
    if not _takes(call, rules):
        return None
    score_mod = call.rules.score_mod
    if (  # a learned table: its gradient on the exact path
        differentiable
        and score_mod is not None
        and any(t.requires_grad for t in own.captured_tensors(score_mod))
    ):
        return None
    *batch, hq, lq, lk = call.scores_shape
    ranges = kernel_ranges(rules.segments, tuple(batch), hq, lq)
    parts = _mask_parts(call.rules.mask_mod)
    if ranges is None or parts is None:
        return None
    mask_fn, block_states = parts
    program = _program(call, score_mod, mask_fn)
    if program is None:
        return None
    states = torch.empty(0, 0, dtype=torch.int8)
    if block_states is not None and flash_mods.skipping():
        states = block_states((math.prod(batch), hq, lq, lk))
    return program, states, ranges


def _takes(call: Call, rules: Rules) -> bool:
    return (
        ENABLED
        and call.mask is None
        and rules.softcap is None
        and rules.alibi_slopes is None
        and call.q.shape[-2] >= kernel.DECODE_QUERIES
        and call.q.dim() >= 3
        and kernel.takes(call.q, call.k, call.v)
    )


def _mask_parts(
    mask_mod: Any,
) -> tuple[Callable[..., Any] | None, Callable[[Any], torch.Tensor] | None] | None:
    """The mask_mod to compile (None: none) and the function giving its block states (None:
    no mask); None where a BlockMask's blocks do not fall on the kernel's state blocks."""
    if mask_mod is None:
        return None, None
    if getattr(mask_mod, "qkv_occupancy", None) is not None:  # qkv.flex.BlockSparse: a BlockMask
        if mask_mod.q_block % QUERY_BLOCK or mask_mod.kv_block % STATE_BLOCK:
            return None
        return mask_mod.mask_mod, lambda shape: _block_mask_states(mask_mod, shape)
    return mask_mod, lambda shape: mask_states(mask_mod, shape)


def _block_mask_states(mask: Any, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A BlockMask's states (``BlockSparse.states``, blocks multiples of 128) on the kernel's
    128 × 128 blocks, over every batch entry and head: each block takes its BlockMask block's."""
    states = mask.states.flatten(0, 1)  # (Bm·Hm, nQ, nKV)
    some, every = (states != EMPTY).any(0), (states == FULL).all(0)
    merged = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)
    rows, columns = math.ceil(shape[2] / QUERY_BLOCK), math.ceil(shape[3] / STATE_BLOCK)
    merged = merged.repeat_interleave(mask.q_block // QUERY_BLOCK, 0)[:rows]
    return merged.repeat_interleave(mask.kv_block // STATE_BLOCK, 1)[:, :columns].contiguous()


def _program(call: Call, score_mod: Any, mask_fn: Any) -> Program | None:
    """The mods' program, proven on this call's first tile the first time (cached)."""
    key = tuple((m, flash_mods.versions(m)) for m in (score_mod, mask_fn) if m is not None)
    return flash_mods.cached(_PROGRAMS, key, lambda: _proven(call, score_mod, mask_fn))  # type: ignore[no-any-return]


def _proven(call: Call, score_mod: Any, mask_fn: Any) -> Program | None:
    tables: list[torch.Tensor] = []
    try:
        score = NO_CODE if score_mod is None else lower(score_mod, True, tables)
        mask = NO_CODE if mask_fn is None else lower(mask_fn, False, tables)
    except Unsupported:
        return None
    program = Program(score, mask, tables)
    reason = prove(program, call, score_mod, mask_fn)
    if reason is None:
        return program
    warnings.warn(
        f"qkv: the compiled program of this score_mod/mask_mod differs from the mod on its "
        f"first tile ({reason}); running the mods on the exact path",
        stacklevel=4,
    )
    return None


def prove(program: Program, call: Call, score_mod: Any, mask_fn: Any) -> str | None:
    """None where ``program`` gives what the eager mods give on the call's first tile (queries
    0…127, keys 0…511, every batch entry and head, the call's own scores), else what differs.
    A mod whose result has the wrong dtype or shape raises as on the exact path."""
    *batch, hq, lq, lk = call.scores_shape
    b, rows, n = math.prod(batch), min(QUERY_BLOCK, lq), min(KEY_BLOCK, lk)
    q_flat, k_flat, _, _ = flat_heads(call.q, call.k, call.v, torch.float32)
    scores = q_flat[:, :, :rows] @ k_flat[:, None, :n].transpose(-1, -2)  # (N, g, R, n)
    scores = scores.reshape(-1, rows, n).contiguous()
    module = kernel.load()
    assert module is not None
    got, keep, slope = module.evaluate_program(scores, 0, 0, call.scale, *program.arguments(), hq)
    shape = (b, hq, rows, n)
    index = own.indices(b, hq, 0, rows, 0, n, call.q.device)
    if score_mod is not None:
        scaled = (scores.view(shape) * call.scale).requires_grad_()
        with torch.enable_grad():
            expected = score_mod(scaled, *index)
            own.checked("score_mod", expected, shape, torch.float32)
            (derivative,) = (
                torch.autograd.grad(expected.expand(shape).sum(), scaled, allow_unused=True)
                if expected.requires_grad
                else (None,)
            )
        if not own.same(got.view(shape), expected.detach().expand(shape)):
            return "score_mod"
        derivative = torch.zeros(shape) if derivative is None else derivative
        finite = expected.detach().expand(shape).isfinite()  # (no gradient flows from −inf)
        if not own.same(slope.view(shape)[finite], derivative[finite]):
            return "score_mod's derivative"
    if mask_fn is not None:
        allowed = own.checked("mask_mod", mask_fn(*index), shape, torch.bool)
        if not torch.equal(keep.view(shape) != 0, allowed.expand(shape)):
            return "mask_mod"
    return None


def mask_states(mask_mod: Callable[..., Any], shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The mask_mod's block states over (QUERY_BLOCK, STATE_BLOCK) blocks (cached)."""
    key = (mask_mod, shape, flash_mods.versions(mask_mod))
    return flash_mods.cached(  # type: ignore[no-any-return]
        _STATES,
        key,
        lambda: flash_mods.block_states(
            mask_mod, shape, QUERY_BLOCK, STATE_BLOCK, torch.device("cpu")
        ),
    )
