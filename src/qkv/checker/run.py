"""``qkv.check(obj)``: every check on one implementation, and the forms built on it.

``check`` never raises for a broken implementation: a check that crashes it fails with the error
in its paragraph. It raises ``CheckError`` only when the implementation cannot be run at all (it
cannot be built or called), with what to pass so that it can.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.checker import checks, robustness
from qkv.checker.context import Context, build, describe
from qkv.checker.flash.run import check_flash
from qkv.checker.flash.target import flash_target
from qkv.checker.report import Report, Result
from qkv.checker.target import (
    CheckError,
    Target,
    error_text,
    from_class,
    from_function,
    from_module,
)

CHECKS: tuple[tuple[str, Callable[[Context], Result]], ...] = (
    ("shapes", checks.shapes),
    ("weights", checks.weights),
    ("oracle", checks.oracle),
    ("scale", checks.scale),
    ("causal", checks.causal),
    ("padding", checks.padding),
    ("fully-masked", checks.fully_masked),
    ("batch", robustness.batch),
    ("dropout", robustness.dropout),
    ("empty", robustness.empty),
    ("dtypes", robustness.dtypes),
    ("gradients", robustness.gradients),
)


def target_of(
    obj: Any,
    *,
    init: dict[str, Any] | None = None,
    forward: dict[str, Any] | None = None,
    heads: int | None = None,
    name: str | None = None,
    device: str | torch.device | None = None,
) -> Target:
    """An ``nn.Module`` instance or subclass, or a function f(q, k, v, ...), as a ``Target``."""
    label = name or getattr(obj, "__qualname__", None) or type(obj).__name__
    forward = dict(forward or {})
    where = _device(device)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        target = from_class(obj, label, dict(init or {}), forward, device=where)
    elif isinstance(obj, nn.Module):
        if init:
            raise CheckError(f"{label} is already built: init applies to a class, not an instance")
        target = from_module(obj, label, forward, device=where)
    elif callable(obj) and not isinstance(obj, type):
        target = from_function(obj, label, forward, device=where)
    else:
        raise CheckError(
            f"{label}: expected an nn.Module subclass or instance, or a function f(q, k, v), "
            f"got {type(obj).__name__}"
        )
    if heads is not None:
        target.heads = heads
    return target


def _device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}"
        ) from error


def check(
    obj: Any,
    *,
    init: dict[str, Any] | None = None,
    forward: dict[str, Any] | None = None,
    heads: int | None = None,
    name: str | None = None,
    device: str | torch.device | None = None,
    flash: bool = False,
) -> Report:
    """Grade a self-attention implementation against qkv's contract; see ``docs/check.md``.

    The implementation keeps its own conventions: its mask layout and polarity are found by
    trying them (qkv's own is True = may attend), its causal option by name or by behaviour.

    ``obj``: an ``nn.Module`` subclass (built with its usual constructor names: d_model,
    num_heads, dropout, ...; ``init`` adds or overrides arguments), an instance, or a function
    ``f(q, k, v, ...)``. ``forward``: fixed keyword arguments for every call. ``heads``: the head
    count when it cannot be read from the object. ``device``: where the implementation runs
    (default: where an instance's parameters are, else the CPU; an instance is moved there);
    inputs are made on the CPU and moved, outputs come back to the CPU to be compared. Returns a
    ``Report``; ``report.ok`` is False when a check fails. Raises ``CheckError`` when the
    implementation cannot be run at all.

    ``flash=True`` grades a flash attention instead: a function or ``torch.autograd.Function``
    ``f(q, k, v[, causal])`` returning ``out`` or ``(out, lse)``, against float64 in output, lse
    and gradients, at odd lengths, Lq ≠ Lk and low precision, and for linear memory and skipped
    causal work (``FLASH_CHECK_IDS``).
    """
    start = time.perf_counter()
    if flash:
        if init or heads is not None:
            raise CheckError("init and heads apply to modules; --flash checks a function")
        label = name or getattr(obj, "__qualname__", None) or type(obj).__name__
        with torch.random.fork_rng():
            torch.manual_seed(0)
            report = check_flash(flash_target(obj, label, dict(forward or {}), _device(device)))
        report.seconds = time.perf_counter() - start
        return report
    with torch.random.fork_rng():
        torch.manual_seed(0)
        target = target_of(obj, init=init, forward=forward, heads=heads, name=name, device=device)
        training = None if target.module is None else target.module.training
        try:
            report = _run_all(target)
        finally:  # the caller's module goes back to the mode it came in
            if target.module is not None and training is not None:
                target.module.train(training)
    report.seconds = time.perf_counter() - start
    return report


def _run_all(target: Target) -> Report:
    try:
        ctx = build(target)
    except CheckError:
        raise
    except Exception as error:  # the user's code failed on the plainest call
        raise CheckError(_first_call_failed(target, error)) from error
    report = Report(target.name, detected=describe(ctx))
    for check_id, function in CHECKS:
        report.checks.append(_run_one(check_id, function, ctx))
    plain = ctx.cache.get("plain")
    found = None if plain is None or plain[2] is None else plain[2].heads
    if found is not None and found != target.heads:
        said = "not given" if target.heads is None else f"its attribute says {target.heads}"
        report.detected["heads"] = f"{found} ({said}; {found} reproduces its output)"
    return report


def _run_one(check_id: str, function: Callable[[Context], Result], ctx: Context) -> Result:
    try:
        return function(ctx)
    except Exception as error:  # the implementation crashed during this check: that is a finding
        return Result(check_id, "fail", f"the implementation raised {error_text(error)}")


def _first_call_failed(target: Target, error: Exception) -> str:
    shape = tuple(target.inputs(2, 7).tensors[0].shape)
    what = "x" if target.kind == "module" else "q, k, v"
    asked = ", ".join(f"{k}={v!r}" for k, v in target.forward.items())
    said = f"{target.name} failed on {what} of shape {shape}" + (f" with {asked}" if asked else "")
    said += f": {error_text(error)}."
    if target.kind == "module" and _runs_unbatched(target):
        return (
            f"{said} It runs on one sequence x ({shape[1]}, {shape[2]}) but not on a batch: "
            "something in it assumes two dims, often .T on a 3-dim tensor (it reverses all "
            "dims); use .transpose(-2, -1) so that it works on (B, L, E)"
        )
    return (
        f"{said} If it needs other sizes or arguments, pass them: "
        "--init d_model=64,n_heads=4 (constructor), --forward name=value (every call), or "
        "check a small adapter module whose forward(x) calls it"
    )


def _runs_unbatched(target: Target) -> bool:
    x = target.inputs(1, 7).tensors[0][0]  # (L, E)
    try:
        with torch.no_grad():
            x = x.to(target.device)
            target.impl(*(x,) * (3 if target.query_key_value else 1), **target.forward)
    except Exception:  # it fails unbatched too: the batch is not the problem
        return False
    return True


def assert_attention(obj: Any, **options: Any) -> Report:
    """For pytest and CI: run ``check`` and raise ``AssertionError`` listing the failing checks
    with their explanations. Returns the report when nothing fails."""
    report = check(obj, **options)
    if not report.ok:
        lines = [f"{r.id}: {r.detail}" for r in report.checks if r.status == "fail"]
        raise AssertionError(f"{report.target} fails qkv check:\n" + "\n".join(lines))
    return report


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """A file's top-level prints go to stderr, so that ``--json -`` stays clean."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def load(spec: str) -> Any:
    """``FILE.py:NAME`` -> the object NAME defined in FILE.py (its folder importable)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not name:
        raise CheckError(f"expected FILE.py:NAME, e.g. my_attention.py:SelfAttention, got {spec!r}")
    path = Path(path_text)
    if not path.is_file():
        raise CheckError(f"no such file: {path}")
    module_name = f"qkv_check_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up there
    sys.path.insert(0, str(path.resolve().parent))
    try:
        with _stdout_to_stderr():
            loader.loader.exec_module(module)
    except BaseException as error:  # anything its top level does, SystemExit included
        del sys.modules[module_name]
        raise CheckError(f"importing {path} raised {error_text(error)}") from error
    finally:
        sys.path.remove(str(path.resolve().parent))
    if not hasattr(module, name):
        found = [n for n, v in vars(module).items() if _checkable(v) and not n.startswith("_")]
        raise CheckError(
            f"{path} defines no {name!r}; it defines: {', '.join(found) or 'nothing to check'}"
        )
    return getattr(module, name)


def _checkable(value: Any) -> bool:
    if isinstance(value, type):
        return issubclass(value, nn.Module | torch.autograd.Function)
    return inspect.isfunction(value) or isinstance(value, nn.Module)
