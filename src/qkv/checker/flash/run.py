"""``qkv.check(obj, flash=True)``: every ``--flash`` check on one flash implementation.

A check that the implementation crashes fails with the error in its paragraph, as in
``run``; a warning (``warn``) reports a cost without failing the run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from qkv.checker.flash import checks, cost, edges
from qkv.checker.flash.context import ALIGNMENTS, MAIN, FlashContext
from qkv.checker.flash.target import FlashTarget
from qkv.checker.report import Report, Result
from qkv.checker.target import error_text

FLASH_CHECKS: tuple[tuple[str, Callable[[FlashContext], Result]], ...] = (
    ("oracle", checks.oracle),
    ("lse", checks.lse),
    ("backward", checks.backward),
    ("causal", checks.causal),
    ("alignment", checks.alignment),
    ("odd-lengths", edges.odd_lengths),
    ("fully-masked", edges.fully_masked),
    ("dtypes", edges.dtypes),
    ("determinism", edges.determinism),
    ("memory", cost.memory),
    ("work", cost.work),
)


def check_flash(target: FlashTarget, skip: Collection[str] = ()) -> Report:
    """Run every flash check on ``target`` but those in ``skip``; what was found about how it
    is called goes in ``detected``."""
    ctx = FlashContext(target)
    report = Report(target.name)
    for check_id, function in FLASH_CHECKS:
        if check_id in skip:
            continue
        try:
            report.checks.append(function(ctx))
        except Exception as error:  # the implementation crashed during this check: a finding
            report.checks.append(Result(check_id, "fail", f"it raised {error_text(error)}"))
    report.detected = describe(ctx)
    return report


def describe(ctx: FlashContext) -> dict[str, Any]:
    """What was found about how it is called, for the report's ``detected``."""
    target = ctx.target
    found: dict[str, Any] = {
        "kind": f"{target.kind}, called as {target.called_as()}",
        "inputs": "q, k, v " + ("(B, H, L, D)" if target.layout == "BHLD" else "(B, L, D)"),
    }
    if target.forward:
        found["forward"] = ", ".join(f"{k}={v!r}" for k, v in target.forward.items())
    found["causal"] = "not supported"
    if target.causal_param is not None:
        aligned = ""
        if ctx.aligned is not None and ctx.aligned[0] in ALIGNMENTS:
            aligned = f"; {ctx.aligned[0]}-aligned when Lq ≠ Lk"
        found["causal"] = f"parameter {target.causal_param}{aligned}"
    plain = ctx.runs.get((MAIN, True)) or ctx.runs.get((MAIN, False))  # None if it raised
    found["lse"] = "none"
    if plain is not None and plain.lse is not None:
        found["lse"] = "returned with out"
    elif plain is not None and plain.lse_saved:
        count = len(plain.lse_saved)
        found["lse"] = f"saved for its backward ({count} tensor(s) shaped like q without D)"
    return found
