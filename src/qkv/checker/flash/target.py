"""The flash implementation under check, and what every ``--flash`` check shares.

A flash attention is a function ``f(q, k, v, ...)`` or a ``torch.autograd.Function`` (called as
``Name.apply(q, k, v, ...)``, which takes positional arguments only) that returns ``out`` or
``(out, lse)``, lse being each query row's natural log-sum-exp of scaled scores, shaped like q
without its last dim. An ``autograd.Function`` that returns only ``out`` is expected to save its
lse for the backward pass, as FlashAttention-2 does: it is read from ``out.grad_fn``'s saved
tensors (the one tensor shaped like q without its last dim). Its causal option is the parameter
named ``causal`` or ``is_causal``. Inputs are (B, H, L, D), or (B, L, D) when it refuses four
dims. Legend: B batch, H heads, L/Lq query length, Lk key length, D features (Dk, Dv).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from qkv.checker.target import CAUSAL_NAMES, CheckError, error_text, parameters_of

HEAD = 32  # Dk (and Dv) of every probe but the one that makes Dv ≠ Dk


@dataclass(frozen=True)
class Case:
    """One probe's sizes: B = ``batch``, H = ``heads`` (with four dims), Lq, Lk, Dk, Dv."""

    lq: int
    lk: int
    causal: bool = False
    dtype: torch.dtype = torch.float32
    dk: int = HEAD
    dv: int = HEAD
    batch: int = 2
    heads: int = 2
    seed: int = 0

    def describe(self) -> str:
        lengths = (
            f"Lq = Lk = {self.lq}" if self.lq == self.lk else f"Lq = {self.lq}, Lk = {self.lk}"
        )
        return lengths + (", causal" if self.causal else "")


@dataclass
class Observed:
    """One call's inputs and results, on the CPU. ``lse_saved`` holds every saved tensor shaped
    like an lse when the implementation returned none (exactly one is expected)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    lse_saved: list[torch.Tensor] = field(default_factory=list)
    dout: torch.Tensor | None = None
    grads: tuple[torch.Tensor | None, ...] | None = None  # dq, dk, dv


@dataclass
class FlashTarget:
    """How to call one flash implementation."""

    name: str
    kind: str  # "function" or "autograd.Function"
    impl: Callable[..., Any]  # the function, or the Function's apply
    layout: str = "BHLD"  # or "BLD"
    causal_param: str | None = None
    positional: tuple[str, ...] = ()  # an autograd.Function's parameters after q, k, v
    defaults: dict[str, Any] = field(default_factory=dict)
    forward: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def tensors(self, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for ``case`` on the CPU, from a fixed seed."""
        generator = torch.Generator().manual_seed(case.seed)
        lead = (case.batch, case.heads) if self.layout == "BHLD" else (case.batch,)
        q, k, v = (
            torch.randn((*lead, length, width), generator=generator).to(case.dtype)
            for length, width in ((case.lq, case.dk), (case.lk, case.dk), (case.lk, case.dv))
        )
        return q, k, v

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> Any:
        """One call on the target's device, returning what the implementation returns."""
        q, k, v = (t.to(self.device) for t in (q, k, v))  # differentiable: grads reach the CPU
        if self.kind == "function":
            kwargs = dict(self.forward)
            if self.causal_param is not None:
                kwargs[self.causal_param] = causal
            return self.impl(q, k, v, **kwargs)
        return self.impl(q, k, v, *self._arguments(causal))

    def _arguments(self, causal: bool) -> list[Any]:
        """``apply`` takes no keywords: every parameter up to the last one set, in order."""
        given = {**self.forward}
        if self.causal_param is not None:
            given[self.causal_param] = causal
        last = max((self.positional.index(n) for n in given), default=-1)
        return [given.get(n, self.defaults.get(n)) for n in self.positional[: last + 1]]

    def observe(self, case: Case, *, backward: bool = False) -> Observed:
        """Run ``case`` (forward, and backward with a fixed random dout when asked)."""
        q, k, v = (t.requires_grad_() for t in self.tensors(case))
        with torch.set_grad_enabled(True):
            result = self.call(q, k, v, causal=case.causal)
            out, lse, saved = split_result(result, q.shape[:-1])
            observed = Observed(
                q.detach(),
                k.detach(),
                v.detach(),
                out.detach().cpu(),
                None if lse is None else lse.detach().cpu(),
                [tensor.detach().cpu() for tensor in saved],
            )
            if backward:
                generator = torch.Generator().manual_seed(case.seed + 1)
                dout = torch.randn(out.shape, generator=generator).to(out.dtype)
                grads = torch.autograd.grad(out, (q, k, v), dout.to(out.device), allow_unused=True)
                observed.dout = dout
                observed.grads = tuple(None if g is None else g.cpu() for g in grads)
        return observed

    def called_as(self) -> str:
        """``Name.apply(q, k, v, is_causal)`` or ``name(q, k, v, causal=...)``."""
        own = getattr(self.impl, "__self__", self.impl)  # apply is bound to its class
        shown = getattr(own, "__name__", type(own).__name__)
        if self.kind == "function":
            flag = f", {self.causal_param}=..." if self.causal_param else ""
            return f"{shown}(q, k, v{flag})"
        flag = f", {self.causal_param}" if self.causal_param else ""
        return f"{shown}.apply(q, k, v{flag})"


def split_result(
    result: Any, row_shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """``out`` or ``(out, lse, ...)`` -> out, the returned lse (the item shaped like q without its
    last dim), and, when none is returned, the saved tensors of that shape."""
    items = list(result) if isinstance(result, tuple | list) else [result]
    out = items[0] if items else None
    if not isinstance(out, torch.Tensor):
        raise CheckError(
            f"it returned {type(result).__name__}; qkv check --flash needs out or (out, lse)"
        )
    for item in items[1:]:
        if isinstance(item, torch.Tensor) and item.shape in (row_shape, (*row_shape, 1)):
            return out, item.reshape(row_shape), []
    try:  # FlashAttention-2 saves lse for its backward: an autograd.Function's saved tensors
        saved = list(getattr(out.grad_fn, "saved_tensors", ()) or ())
    except RuntimeError:  # already freed, or not a custom function
        saved = []
    shaped = [t for t in saved if isinstance(t, torch.Tensor) and t.shape == row_shape]
    return out, None, shaped


def flash_target(
    obj: Any, name: str, forward: dict[str, Any], device: torch.device | None = None
) -> FlashTarget:
    """A function, an ``autograd.Function`` subclass, or a function of no arguments that returns
    one (the form of CS336's adapters), as a ``FlashTarget`` whose layout works."""
    if inspect.isfunction(obj) and not parameters_of(obj, 0):
        try:
            made = obj()
        except Exception as error:  # the user's code: any failure is reported
            raise CheckError(
                f"{name}() raised {error_text(error)}; a function of no arguments is called "
                "for the autograd.Function it returns"
            ) from error
        if isinstance(made, type) and issubclass(made, torch.autograd.Function):
            obj = made
    where = device or torch.device("cpu")
    if isinstance(obj, nn.Module) or (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise CheckError(
            f"{name} is an nn.Module: --flash grades a function f(q, k, v, ...) or a "
            "torch.autograd.Function subclass; check a module without --flash"
        )
    if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
        skip = 3 if _overrides(obj, "setup_context") else 4  # the old form's ctx comes first
        params = parameters_of(obj.forward, skip)
        target = FlashTarget(
            name,
            "autograd.Function",
            obj.apply,
            causal_param=_causal(params, forward),
            positional=tuple(params),
            defaults={n: p.default for n, p in params.items() if p.default is not p.empty},
            forward=forward,
            device=where,
        )
        _check_positional(target, params)
    elif callable(obj) and not isinstance(obj, type):
        params = parameters_of(obj, 3)
        causal = _causal(params, forward)
        target = FlashTarget(
            name, "function", obj, causal_param=causal, forward=forward, device=where
        )
    else:
        raise CheckError(
            f"{name}: --flash grades a function f(q, k, v, ...) or a torch.autograd.Function "
            f"subclass, got {type(obj).__name__}"
        )
    return _with_layout(target)


def _overrides(cls: type, name: str) -> bool:
    own = [base for base in cls.__mro__ if not base.__module__.startswith("torch")]
    return any(name in vars(base) for base in own)


def _causal(params: dict[str, inspect.Parameter], forward: dict[str, Any]) -> str | None:
    """Its causal parameter, unless ``--forward`` fixes it."""
    if set(forward) & set(CAUSAL_NAMES):
        return None
    return next((name for name in CAUSAL_NAMES if name in params), None)


def _check_positional(target: FlashTarget, params: dict[str, inspect.Parameter]) -> None:
    """``apply`` cannot leave out a parameter without a default: each must be given."""
    given = {*target.forward, target.causal_param}
    missing = [n for n, p in params.items() if p.default is p.empty and n not in given]
    if missing:
        raise CheckError(
            f"{target.name}: its forward needs {', '.join(missing)}, which qkv check does not "
            f"recognise; pass them: --forward {','.join(f'{n}=...' for n in missing)}"
        )


def _with_layout(target: FlashTarget) -> FlashTarget:
    """(B, H, L, D) first, then (B, L, D): the first whose output is shaped (..., Lq, Dv)."""
    errors = []
    for layout in ("BHLD", "BLD"):
        candidate = replace(target, layout=layout)
        case = Case(64, 64)
        q, k, v = candidate.tensors(case)
        try:
            with torch.no_grad():
                out, _, _ = split_result(candidate.call(q, k, v, causal=False), q.shape[:-1])
        except CheckError:
            raise
        except Exception as error:  # the user's code: any failure is reported
            errors.append(f"{layout}: {error_text(error)}")
            continue
        if out.shape == (*q.shape[:-1], case.dv):
            return candidate
        errors.append(f"{layout}: returned shape {tuple(out.shape)}")
    gpu = any(word in " ".join(errors).lower() for word in ("cuda", "triton", "gpu"))
    hint = " (a GPU kernel? pass --device cuda)" if gpu and target.device.type == "cpu" else ""
    raise CheckError(
        f"{target.name}(q, k, v) ran on neither q, k, v (B, H, L, D) = (2, 2, 64, {HEAD}) nor "
        f"(B, L, D) = (2, 64, {HEAD}): {'; '.join(errors)}{hint}. Pass fixed arguments with "
        "--forward name=value, or check a small adapter f(q, k, v, causal) that calls it"
    )
