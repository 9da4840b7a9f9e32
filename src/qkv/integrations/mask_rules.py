"""What a transformers mask request means, as qkv's arguments instead of a dense mask.

transformers asks its mask function for every mask a model needs, handing over a *mask function*
``f(b, h, q, kv) -> bool`` built from a few known pieces (the causal rule, a sliding window, the
bidirectional rule, packed documents, padding, offsets from a cache). qkv's flash backend has all
of these as arguments, and with them it never builds the (Lq, Lk) mask and skips the tiles they
block. So for each request:

1. ``rule_of`` inspects the mask function (it is never evaluated) and the request's sizes and
   offsets, and returns the ``Rule`` that means exactly that mask, or None where it is anything
   else (overlays, chunks, prefix-LM blocks, ...): then the dense mask is built as usual.
   A static cache hands the attention its whole preallocated length with a causal mask whose
   keys past the last query are blocked for every query: that is the causal rule over the
   first ``used`` keys (the valid prefix), and the attention function reads only those.
2. The mask function returns a ``RuleMask``: a tensor of the mask's shape (B, 1, Lq, Lk) that
   carries the ``Rule``. Handed to qkv's attention function unchanged, the rule runs as
   arguments (``Rule.arguments``). Touched by any operation on the way (a model that slices,
   pads, concatenates or adds to its mask), it becomes the dense mask it stands for, in eager's
   additive form (0 where a key may be attended, -inf where not), so model code that works on
   eager's masks works on it: never a wrong number, only a slower call.

The rule is read from the mask function transformers hands over, never from the layer's
attributes (a layer of full attention may well hold its config's ``sliding_window``).
Legend: B batch, L/Lq query length, S/Lk key length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import torch
from torch.utils._pytree import tree_map

from qkv import _tracing, masks


@dataclass(frozen=True)
class Rule:
    """A mask as qkv's arguments: ``causal`` (bottom-right), ``window`` (left, right) or None,
    ``documents`` (B, L) ids of packed sequences or None, ``keys`` (B, Lk) bool key padding
    (True = a real key) or None; for ``lq`` queries and ``lk`` keys, ``batch`` rows. ``used``
    (a static cache's valid prefix): only the first ``used`` keys may be attended, the rule
    applying to them as if they were all the keys; None: all ``lk``."""

    causal: bool
    window: tuple[int | None, int | None] | None
    documents: torch.Tensor | None
    keys: torch.Tensor | None
    batch: int
    lq: int
    lk: int
    used: int | None = None

    @property
    def key_count(self) -> int:
        """The keys the rule may attend: the first ``used``, else all ``lk``."""
        return self.lk if self.used is None else self.used

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``qkv.attention`` that mean this mask, for the first
        ``key_count`` keys (the others are never attended)."""
        padding = None if self.keys is None else self.keys[:, None, None, : self.key_count]
        return {
            "mask": padding,
            "causal": self.causal,
            **({"window": self.window} if self.window is not None else {}),
            **({"segments": self.documents} if self.documents is not None else {}),
        }

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The (B, 1, Lq, Lk) mask this rule means, additive (0 may attend, -inf blocked), or
        for ``dtype`` bool transformers' own form (True = may attend)."""
        keep = torch.ones(self.lq, self.lk, dtype=torch.bool, device=device)
        if self.causal:
            causal = masks.causal_mask(self.lq, self.key_count, device=device)
            keep = keep & torch.nn.functional.pad(causal, (0, self.lk - self.key_count))
        if self.window is not None:
            upper, lower = masks.window_offsets(self.window, self.lq, self.lk)
            rows = torch.arange(self.lq, device=device)[:, None]
            cols = torch.arange(self.lk, device=device)[None, :]
            if upper is not None:
                keep = keep & (cols <= rows + upper)
            if lower is not None:
                keep = keep & (cols >= rows + lower)
        keep = keep.expand(self.batch, 1, self.lq, self.lk)
        if self.documents is not None:  # (lq == lk: packing is found only without a cache)
            ids = self.documents.to(device)
            keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
        if self.keys is not None:
            keep = keep & self.keys.to(device)[:, None, None, :]
        return keep if dtype == torch.bool else masks.as_additive(keep, dtype)


class RuleMask(torch.Tensor):
    """A mask (B, 1, Lq, Lk) that carries the ``Rule`` it means (``rule``).

    Its own values are only the key padding and the valid prefix, broadcast (no (Lq, Lk)
    memory; for one causal query row without a window they are the mask itself, bool where it
    was asked for unskippable); qkv's
    attention function reads ``rule`` instead. Any operation on it other than asking its
    shape, dtype or device (or detaching it, or asking for it contiguous: the same mask, as
    transformers' ``generate`` does every step) first turns it into the dense mask of its rule
    (made once, then kept).
    """

    rule: Rule
    _dense: torch.Tensor | None
    _METADATA: ClassVar[set[Callable[..., Any]]] = {
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.__len__,
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.device.__get__,
        torch.Tensor.is_floating_point,
    }

    @staticmethod
    def __new__(cls, rule: Rule, dtype: torch.dtype, device: torch.device) -> RuleMask:
        keys = torch.arange(rule.lk, device=device).expand(rule.batch, -1) < rule.key_count
        if rule.keys is not None:
            keys = keys & rule.keys.to(device)
        values = keys if dtype == torch.bool else masks.as_additive(keys, dtype)
        broadcast = values[:, None, None, :]
        shape = (rule.batch, 1, rule.lq, rule.lk)
        mask = torch.Tensor._make_subclass(cls, broadcast.expand(shape))
        mask.rule, mask._dense = rule, None
        return mask

    def materialize(self) -> torch.Tensor:
        """The dense (B, 1, Lq, Lk) additive mask of ``rule``, as a plain tensor."""
        if self._dense is None:
            with torch._C.DisableTorchFunctionSubclass():
                dtype, device = self.dtype, self.device
            self._dense = self.rule.dense(dtype, device)
        return self._dense

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.detach:  # (a mask has no gradient: detaching changes nothing)
            return args[0]
        if func is torch.Tensor.contiguous and len(args) == 1 and not kwargs:
            return args[0]  # (the same mask: its dense form is made contiguous when made)
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def dense(value: Any) -> Any:
            return value.materialize() if isinstance(value, RuleMask) else value

        return func(*tree_map(dense, args), **tree_map(dense, kwargs))


def rule_mask(kwargs: dict[str, Any]) -> RuleMask | None:
    """The ``RuleMask`` of a request to transformers' mask function (its keyword arguments),
    or None where its mask is not a rule qkv recognises exactly (then it is built)."""
    rule = rule_of(kwargs)
    if rule is None:
        return None
    device = torch.device(kwargs.get("device") or "cpu")
    skippable = kwargs.get("allow_is_causal_skip" if rule.causal else "allow_is_bidirectional_skip")
    if not skippable and rule.documents is None:  # (one causal row: the mask itself, exactly)
        return RuleMask(rule, torch.bool, device)
    return RuleMask(rule, kwargs.get("dtype") or torch.float32, device)


def rule_of(kwargs: dict[str, Any]) -> Rule | None:
    """The ``Rule`` that means exactly the mask a request describes, or None.

    Recognised: transformers' causal, sliding-window causal, bidirectional and bidirectional
    sliding-window mask functions, the first two also as ``create_causal_mask`` composes them
    for sequences packed by position ids; with a 2-D padding mask or none. Positions must line
    up as qkv's bottom-right alignment lines them up (the queries are the last of the keys),
    except for plain bidirectional masks, which positions do not change, and a static cache's
    causal mask (``_used_keys``). A request that may not be skipped
    (``allow_is_causal_skip`` / ``allow_is_bidirectional_skip`` False, outside packing) is
    one whose caller wants the mask itself: it is built, unless it is one causal query row
    without a window (as transformers asks for a static cache's decoding step): then the
    ``RuleMask`` is that very mask, bool (True = may attend) as transformers builds it, in its
    own values and in any operation on it.
    """
    numbers = _integers(
        kwargs, q_length=None, kv_length=None, batch_size=None, q_offset=0, kv_offset=0
    )
    if numbers is None:
        return None
    lq, lk, batch, q_offset, kv_offset = numbers
    function, documents = _unpacked(kwargs.get("mask_function"), lq, lk)
    shape = _shape(function)
    if shape is None:
        return None
    causal, window = shape
    skippable = kwargs.get("allow_is_causal_skip" if causal else "allow_is_bidirectional_skip")
    exact_row = causal and window is None and lq == 1
    if documents is None and not skippable and not exact_row:
        return None
    used = None
    if (causal or window is not None) and q_offset + lq != kv_offset + lk:
        used = _used_keys(causal, window, documents, lq, lk, q_offset, kv_offset)
        if used is None:
            return None  # (not the last queries of the keys)
    keys = _keys(kwargs.get("attention_mask"), lk, kv_offset, batch, used)
    if keys is False or (documents is not None and documents.shape[0] != batch):
        return None
    padding = keys if isinstance(keys, torch.Tensor) else None
    return Rule(causal, window, documents, padding, batch, lq, lk, used)


def _used_keys(
    causal: bool,
    window: tuple[int | None, int | None] | None,
    documents: torch.Tensor | None,
    lq: int,
    lk: int,
    q_offset: int,
    kv_offset: int,
) -> int | None:
    """The valid prefix n of a static cache's causal request, or None.

    transformers' causal mask function keeps key j for query i where kv_offset + j <= q_offset
    + i. With kv_offset 0 and n = q_offset + lq < lk, that is j <= i + n - lq, the bottom-right
    causal rule over the first n keys, and keys n … lk − 1 are blocked for every query (they
    lie past the last query's position). Only the plain causal rule (no window, no packing)."""
    used = q_offset + lq
    plain = causal and window is None and documents is None
    return used if plain and kv_offset == 0 and q_offset >= 0 and used < lk else None


def _shape(function: Any) -> tuple[bool, tuple[int | None, int | None] | None] | None:
    """(causal, window) of transformers' four plain mask functions, else None."""
    from transformers import masking_utils

    if function is masking_utils.causal_mask_function:
        return True, None
    if function is masking_utils.bidirectional_mask_function:
        return False, None
    parts = _composed(function, "and_masks")
    if parts is None or len(parts) != 2:
        return None
    overlay, base = parts
    if base is masking_utils.causal_mask_function:
        width = _closure(overlay, "sliding_window_overlay").get("sliding_window")
        # kv > q - w: the w most recent keys, the query's own included
        return (True, (width - 1, 0)) if _positive(width) else None
    if base is masking_utils.bidirectional_mask_function:
        width = _closure(overlay, "sliding_window_bidirectional_overlay").get("sliding_window")
        return (False, (width, width)) if _positive(width) else None  # |q - kv| <= w
    return None


def _unpacked(function: Any, lq: int, lk: int) -> tuple[Any, torch.Tensor | None]:
    """(the mask function inside ``create_causal_mask``'s packing, the (B, L) document ids)
    for a request on sequences packed by position ids; (``function``, None) otherwise.

    Packed, a query attends only keys of its document, with the rule applied to positions
    within the document: as these count up by one inside a document, that is the rule on the
    row's own indices (transformers starts a document wherever they do not)."""
    parts = _composed(function, "and_masks")
    if parts is None or len(parts) != 2 or lq != lk:
        return function, None
    remapped, same_document = parts
    inner = _closure(remapped, "remap_positions_for_packed_sequence").get("mask_function")
    ids = _closure(same_document, "packed_sequence_mask_function").get("packed_sequence_mask")
    if inner is None or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        return function, None
    shape = _shape(inner)
    if ids.shape[-1] != lq or shape is None or not shape[0]:  # (causal rules only)
        return function, None
    return inner, ids


def _keys(
    padding: Any, lk: int, kv_offset: int, batch: int, used: int | None = None
) -> torch.Tensor | bool | None:
    """(B, Lk) bool: which keys are real, from a request's 2-D padding mask (as transformers'
    ``prepare_padding_mask`` reads it: short masks padded with False); None without padding
    or where every key (of the first ``used``, if given) is real; False where the padding is
    not a 2-D mask qkv can read."""
    if padding is None:
        return None
    if not isinstance(padding, torch.Tensor) or padding.ndim != 2:
        return False
    if padding.shape[0] not in (1, batch):
        return False
    from transformers.masking_utils import prepare_padding_mask

    padded = prepare_padding_mask(padding.to(torch.bool), lk, kv_offset)
    assert padded is not None
    keys = padded[:, kv_offset : kv_offset + lk].expand(batch, lk)
    if _tracing.traced(keys):  # (a graph cannot hold a decision on the mask's values)
        return keys
    return None if bool(keys[:, :used].all()) else keys


def _integers(kwargs: dict[str, Any], **defaults: int | None) -> list[int] | None:
    """The request's values of ``defaults``' names (or the default), if all are ints or
    untraced integer scalar tensors (a static cache's query offset, read as its value)."""
    values = [kwargs.get(name, default) for name, default in defaults.items()]
    integers = [_integer(value) for value in values]
    return None if None in integers else integers  # type: ignore[return-value]


def _integer(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        integral = value.numel() == 1 and not value.is_floating_point() and not value.is_complex()
        if not integral or value.dtype == torch.bool or _tracing.traced(value):
            return None
        return int(value.item())
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _composed(function: Any, factory: str) -> tuple[Any, ...] | None:
    """The mask functions that transformers' ``and_masks`` / ``or_masks`` combined into
    ``function``, or None if ``function`` is not such a combination."""
    parts = _closure(function, factory).get("mask_functions")
    return parts if isinstance(parts, tuple) else None


def _closure(function: Any, factory: str) -> dict[str, Any]:
    """The variables a mask function made by ``transformers.masking_utils.<factory>`` closes
    over, by name; empty if ``function`` was not made there."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    made_there = getattr(function, "__module__", None) == "transformers.masking_utils" and str(
        getattr(function, "__qualname__", "")
    ).startswith(f"{factory}.<locals>.")
    if code is None or not cells or not made_there:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
