"""flash with your own rule: a ``score_mod`` and a ``mask_mod`` evaluated per tile.

``loop.py`` calls a ``TileMods`` at three points of each (queries q0:q1, keys k0:k1) tile:

- ``occupied``: which key tiles a query tile needs. The mask_mod's block occupancy (empty,
  partial or full per QUERY_TILE × KEY_BLOCK block, over every batch entry and head) is found
  once per call by evaluating the mask_mod block by block (as ``create_block_mask`` does) and
  kept in a small cache for a repeated mask_mod and shape; empty tiles are skipped and a tile's
  empty leading or trailing blocks trimmed off.
- ``modify``: the score_mod on the tile's scores, converted from the loop's base 2 to the
  natural scaled scores FlexAttention defines and back, with broadcast index tensors
  (``qkv.mods.indices``) — one call per tile. On long calls the step is ``torch.compile``d
  (tile sizes static; a tile shape compiles once).
- ``block``: the mask_mod's blocked pairs set to −inf, except in full tiles (not evaluated).

Each mod runs on whole tiles, or per score under ``torch.vmap`` when it fails on a block
(``qkv.mods.resolve``, decided on the call's first corner); a mask_mod's result of any broadcast
shape reduces to the occupancy along the axes it has (``_columns``).

In a backward pass ``modify`` evaluates the score_mod under autograd and ``gradient`` turns
dL/d(new score) into dL/d(scaled score) with ``torch.autograd.grad``, adding up the gradients
of the tensors the score_mod captures (``qkv.mods.captured_tensors``: closure cells, globals,
partials, bound modules), which are explicit inputs of the autograd function. Tiles run in a
fixed order, so the sums are deterministic. Legend: B batch (flattened), Hq query heads, N
key/value heads of the loop, R rows and kt keys of a tile.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qkv import mods as own
from qkv.backends.flash.rules import LOG2_E

LN_2 = math.log(2.0)
QUERY_TILE = 256  # the loop's query tile (``loop.QUERY_TILE``; tests check they agree)
KEY_BLOCK = 128  # key granularity of the mask_mod's block occupancy
EMPTY, PARTIAL, FULL = 0, 1, 2
COMPILE_MIN_TILES = 64  # "auto" compiles the score_mod step of calls with this many tiles
_SETTINGS: dict[str, Any] = {"skip": True, "compile": os.environ.get("QKV_FLEX_COMPILE", "auto")}
_OCCUPANCY: collections.OrderedDict[Any, torch.Tensor] = collections.OrderedDict()
_COMPILED: collections.OrderedDict[Any, Callable[..., Any] | None] = collections.OrderedDict()
_CACHE_SIZE = 16


@contextlib.contextmanager
def settings(*, skip: bool | None = None, compile: str | None = None) -> Iterator[None]:
    """Within the block: ``skip=False`` evaluates every tile (no block skipping); ``compile``
    "auto" (default, env QKV_FLEX_COMPILE), "1" (always compile the score_mod step) or "0"."""
    saved = dict(_SETTINGS)
    if skip is not None:
        _SETTINGS["skip"] = skip
    if compile is not None:
        _SETTINGS["compile"] = compile
    try:
        yield
    finally:
        _SETTINGS.update(saved)


def skipping() -> bool:
    """Whether empty blocks are skipped (``settings(skip=...)``)."""
    return bool(_SETTINGS["skip"])


class TileMods:
    """A call's score_mod and mask_mod for the loop's tiles. ``batch`` B and ``heads`` Hq give
    the (B, Hq, rows, keys) view of a tile's (N, R, kt) scores; ``grad``: for a backward pass."""

    def __init__(
        self,
        score_mod: Callable[..., Any] | None,
        mask_mod: Callable[..., Any] | None,
        shape: tuple[int, int, int, int],
        device: torch.device,
        captured: list[torch.Tensor],
        grad: bool = False,
        differentiable: bool = False,
    ) -> None:
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.batch, self.heads, self.lq, self.lk = shape
        self.device, self.captured, self.grad = device, captured, grad
        self.differentiable = differentiable or grad  # a backward pass may follow
        self.captured_grads: list[torch.Tensor | None] = [None] * len(captured)
        self.occupancy: torch.Tensor | None = None
        if mask_mod is not None:  # on blocks, or per score (``qkv.mods.resolve``)
            corner = own.indices(self.batch, self.heads, 0, min(self.lq, 32), 0, 64, device)
            corner = (*corner[:3], corner[3][..., : min(self.lk, 64)])
            run = own.resolve("mask_mod", mask_mod, corner, torch.bool)
            self.mask_mod = run
            self.occupancy = _occupancy(mask_mod, shape, device, run)
        self._checked_score = self._checked_mask = grad  # (the forward pass checked them)
        self._step: Callable[..., Any] | None = None
        self._grad_step: Callable[..., Any] = score_mod or _identity
        self._graph: tuple[torch.Tensor, torch.Tensor] | None = None  # backward: (input, output)
        self._full: set[tuple[int, int, int]] = set()
        self._resolved = False  # whether the score_mod runs on blocks or per score is decided

    def occupied(self, q0: int, q1: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The key tiles of ``spans`` that the mask_mod leaves a pair in, trimmed to their first
        and last such block (tiles the mask_mod fills entirely are remembered as full)."""
        if self.occupancy is None or not _SETTINGS["skip"]:
            return spans
        states = self.occupancy[q0 // QUERY_TILE]  # (blocks,) one query tile's row
        kept = []
        for k0, k1 in spans:
            row = states[k0 // KEY_BLOCK : (k1 - 1) // KEY_BLOCK + 1]
            occupied = torch.nonzero(row != EMPTY)
            if occupied.numel() == 0:
                continue
            first, last = int(occupied[0]), int(occupied[-1])
            start = max(k0, (k0 // KEY_BLOCK + first) * KEY_BLOCK)
            end = min(k1, (k0 // KEY_BLOCK + last + 1) * KEY_BLOCK)
            if bool((row[first : last + 1] == FULL).all()):
                self._full.add((q0, start, end))
            kept.append((start, end))
        return kept

    def _view(self, scores: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """(N, R, kt) -> (B, Hq, q1−q0, kt), the layout the index tensors broadcast against."""
        return scores.view(self.batch, self.heads, q1 - q0, scores.shape[-1])

    def modify(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """Replace a tile's (N, R, kt) base-2 scores by score_mod's, in place."""
        if self.score_mod is None:
            return
        tile = self._view(scores, q0, q1)
        index = own.indices(self.batch, self.heads, q0, q1, k0, k1, self.device)
        if not self._resolved:  # on blocks, or per score (``qkv.mods.resolve``)
            score, *rest = own.corner((tile, *index))
            corner = (score * LN_2, *rest)
            self.score_mod = own.resolve("score_mod", self.score_mod, corner, tile.dtype)
            self._grad_step, self._resolved = self.score_mod, True
        if not self._checked_score:
            self._check_score(tile, index)
        if self._step is None:
            self._step = self._choose_step(tile, index)
        if self.grad:  # keep the tile's graph for ``gradient``
            with torch.enable_grad():
                raw = tile.mul(LN_2).requires_grad_()
                try:
                    new = self._grad_step(raw, *index)
                except Exception:  # a compiled step that fails: the plain one
                    if self._grad_step is self.score_mod:
                        raise
                    self._grad_step = self.score_mod
                    new = self.score_mod(raw, *index)
                new = new.to(raw.dtype)  # (a score_mod may compute in another float dtype)
            self._graph = (raw, new)
            tile.copy_(new.detach()).mul_(LOG2_E)
            return
        tile.copy_(self._step(tile, *index))

    def _check_score(self, tile: torch.Tensor, index: own.Indices) -> None:
        """Shape, dtype, elementwise (``qkv.mods``), and no missed captured tensor."""
        assert self.score_mod is not None
        raw = tile.mul(LN_2)
        with torch.enable_grad():
            result = self.score_mod(raw, *index)
        own.checked("score_mod", result, tuple(tile.shape), tile.dtype)
        if self.differentiable:
            _check_captured(result, self.captured)
        with torch.no_grad():  # on a corner of the tile: cheap, and enough to tell
            own.check_elementwise("score_mod", self.score_mod, own.corner((raw, *index)))
        self._checked_score = True

    def _choose_step(self, tile: torch.Tensor, index: own.Indices) -> Callable[..., Any]:
        """The score_mod step in base 2, compiled when asked or worth it, else plain (in a
        backward pass: the score_mod itself, compiled with its gradient, as ``_grad_step``)."""
        assert self.score_mod is not None
        plain = base2_step(self.score_mod)
        mode = _SETTINGS["compile"]
        tiles = math.ceil(self.lq / QUERY_TILE) * math.ceil(self.lk / tile.shape[-1])
        wanted = mode == "1" or (mode == "auto" and tiles >= COMPILE_MIN_TILES)
        if not wanted or self.device.type != "cpu" or hasattr(self.score_mod, "qkv_per_score"):
            return plain
        if self.grad:
            grad_step = compiled_step(("grad", self.score_mod), self.score_mod)
            self._grad_step = self.score_mod if grad_step is None else grad_step
            return plain
        compiled = compiled_step(self.score_mod, plain)
        if compiled is None:  # (it failed before)
            return plain
        try:  # the compiled step must agree with the plain one on this tile
            agree = own.same(compiled(tile, *index), plain(tile, *index))
        except Exception as error:  # any compile failure falls back
            agree, reason = False, f"{type(error).__name__}: {error}"
        else:
            reason = "its results differ from the plain loop's"
        if not agree:
            _COMPILED[self.score_mod] = None
            warnings.warn(
                f"qkv: compiling the score_mod step failed ({reason}); running it uncompiled",
                stacklevel=2,
            )
            return plain
        return compiled

    def gradient(self, ds: torch.Tensor) -> torch.Tensor:
        """dL/d(scaled score) (N, R, kt) from dL/d(score_mod's result) ``ds``; adds the tile's
        part of the captured tensors' gradients."""
        if self._graph is None:
            return ds
        raw, new = self._graph
        self._graph = None
        if not new.requires_grad:  # a score_mod that reads neither the score nor a learned tensor
            return ds.zero_()
        grad_new = ds.view(raw.shape).sum_to_size(new.shape)
        inputs = [raw, *self.captured]
        with torch.enable_grad():
            grads = torch.autograd.grad(new, inputs, grad_new, allow_unused=True)
        for i, grad in enumerate(grads[1:]):
            if grad is not None:
                total = self.captured_grads[i]
                self.captured_grads[i] = grad if total is None else total.add_(grad)
        if grads[0] is None:  # the new score does not depend on the old one
            return ds.zero_()
        return ds.copy_(grads[0].reshape(ds.shape))

    def block(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """Set the pairs the mask_mod blocks to −inf (nothing in a full tile)."""
        if self.mask_mod is None or (q0, k0, k1) in self._full:
            return
        tile = self._view(scores, q0, q1)
        keep = self.mask_mod(*own.indices(self.batch, self.heads, q0, q1, k0, k1, self.device))
        if not self._checked_mask:
            own.checked("mask_mod", keep, tuple(tile.shape), torch.bool)
            self._checked_mask = True
        tile.masked_fill_(keep.logical_not(), float("-inf"))


def _identity(score: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    return score


def base2_step(score_mod: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The score_mod on base-2 scores: natural in, natural out, base 2 again."""

    def step(tile: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = score_mod(tile * LN_2, *index) * LOG2_E
        return result

    return step


def compiled_step(score_mod: Any, plain: Callable[..., Any]) -> Callable[..., Any] | None:
    """``torch.compile`` of the step (static shapes: each tile shape compiles once), cached per
    score_mod; None where it failed before (a step that disagreed with the plain one is cached as
    None)."""
    compiled = cached(_COMPILED, score_mod, lambda: torch.compile(plain, dynamic=False))
    return compiled  # type: ignore[no-any-return]


def cached(cache: collections.OrderedDict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """cache[key], made by ``make`` the first time; the _CACHE_SIZE most recently used kept. An
    unhashable key (a mod that cannot be hashed) is made for this call only."""
    try:
        hash(key)
    except TypeError:
        return make()
    if key not in cache:
        cache[key] = make()
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


def _check_captured(result: torch.Tensor, captured: list[torch.Tensor]) -> None:
    """ValueError if the score_mod's result depends on a tensor needing gradients that
    ``qkv.mods.captured_tensors`` did not find (its gradient would be lost)."""
    if result.grad_fn is None:
        return
    stops = {id(t.grad_fn) for t in captured if t.grad_fn is not None}
    leaves = {id(t) for t in captured if t.grad_fn is None}
    pending: list[Any] = [result.grad_fn]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if (
            isinstance(variable, torch.Tensor)
            and variable.requires_grad
            and id(variable) not in leaves
        ):
            raise ValueError(
                f"score_mod reads a tensor of shape {tuple(variable.shape)} that "
                f"requires grad but is not in its closure or globals, so its gradient "
                f"would be lost; capture it directly (a closure variable, a global or "
                f"an attribute of a bound torch.nn.Module)"
            )
        pending.extend(next_node for next_node, _ in node.next_functions)


def _occupancy(
    mask_mod: Callable[..., Any],
    shape: tuple[int, int, int, int],
    device: torch.device,
    run: Callable[..., Any],
) -> torch.Tensor:
    """(query tiles, key blocks) int8: EMPTY, PARTIAL or FULL over every batch entry and head,
    from the mask_mod's own ``qkv_occupancy`` (a BlockMask's) or by evaluating it (as ``run``:
    itself or per score); cached."""
    own_occupancy = getattr(mask_mod, "qkv_occupancy", None)
    if own_occupancy is not None:
        result: torch.Tensor = own_occupancy(shape, QUERY_TILE, KEY_BLOCK)
        return result
    key = (mask_mod, shape, device, versions(mask_mod))
    return cached(  # type: ignore[no-any-return]
        _OCCUPANCY, key, lambda: block_states(run, shape, QUERY_TILE, KEY_BLOCK, device)
    )


def versions(mod: Any) -> tuple[tuple[int, int, int], ...]:
    """Every tensor the mod reads, as (id, data pointer, version): a tensor changed in place, or
    another one in its place, makes a new cache key."""
    return tuple((id(t), t.data_ptr(), t._version) for t in own.captured_tensors(mod, every=True))


def block_states(
    mask_mod: Callable[..., Any],
    shape: tuple[int, int, int, int],
    query_block: int,
    key_block: int,
    device: torch.device,
) -> torch.Tensor:
    """(ceil(Lq / query_block), ceil(Lk / key_block)) int8 on the CPU: each block EMPTY, PARTIAL
    or FULL over every batch entry and head, the mask_mod evaluated one query block and up to
    16 key blocks at a time (the loop's occupancy and the compiled programs' block states)."""
    batch, heads, lq, lk = shape
    blocks = math.ceil(lk / key_block)
    states = torch.empty(math.ceil(lq / query_block), blocks, dtype=torch.int8)
    chunk = 16 * key_block
    for i, q0 in enumerate(range(0, lq, query_block)):
        q1 = min(lq, q0 + query_block)
        for k0 in range(0, lk, chunk):
            k1 = min(lk, k0 + chunk)
            keep = mask_mod(*own.indices(batch, heads, q0, q1, k0, k1, device))
            keep = own.checked("mask_mod", keep, (batch, heads, q1 - q0, k1 - k0), torch.bool)
            some, every = _columns(keep, k1 - k0)
            pad = (-(k1 - k0)) % key_block
            n = (k1 - k0 + pad) // key_block
            some = torch.nn.functional.pad(some, (0, pad)).view(n, key_block).any(dim=1)
            every = torch.nn.functional.pad(every, (0, pad), value=True)
            every = every.view(n, key_block).all(dim=1)
            state = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY))
            states[i, k0 // key_block : k0 // key_block + n] = state.to(torch.int8).cpu()
    return states


def _columns(keep: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys,) bool twice: whether some (b, h, q) of a broadcastable ``keep`` block may attend
    each key, and whether every one may. Reduced over the axes ``keep`` has (a size-1 axis
    stands for all its entries), then broadcast along the keys: no (B, Hq, R, kt) copy."""
    rows = keep.reshape(-1, keep.shape[-1]) if keep.dim() > 0 else keep.reshape(1, 1)
    some = rows.any(dim=0).expand(keys)
    every = rows.all(dim=0).expand(keys)
    return some.contiguous(), every.contiguous()
