"""The ``--flash`` checks of the edges: odd lengths, fully masked rows, low precision and
determinism. Each takes the shared ``FlashContext`` and returns one ``Result`` with the numbers.
Legend: B batch, H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

import torch

from qkv.canonical import Causal
from qkv.checker.compare import difference, tolerance
from qkv.checker.flash.context import (
    ALIGNMENTS,
    CAUSAL_NOT_JUDGED,
    MAIN,
    NOT_JUDGED,
    FlashContext,
    causal_argument,
)
from qkv.checker.flash.oracle import Expected, explain_lse, explain_output
from qkv.checker.flash.target import Case, Observed
from qkv.checker.report import Result, number, sentence

ODD = ((67, 67), (197, 197), (67, 131), (131, 67), (1, 1))  # multiples of no tile
WITH_GRADIENTS = (197, 197)
MASKED = Case(96, 64, causal=True)  # bottom-right: queries 0-31 see no key
# A float32 softmax leaves the low-precision output about as close to the exact result as
# rounding the exact result to that dtype (p rounded for the p·V product adds about half that
# again); scores, a running maximum or sum kept in the low precision add 4× or more.
ROUNDINGS = 2.5
LOW_LSE = 1e-4  # lse of float32 scores and sums, per unit of magnitude


def _rule(ctx: FlashContext, lq: int, lk: int, causal: bool) -> Causal:
    """The causal argument of the truth for these lengths (its alignment is a right one)."""
    if not causal or lq == lk:
        return causal
    return causal_argument(ctx.alignment()[0])


def _misses(ctx: FlashContext, observed: Observed, truth: Expected) -> dict[str, float]:
    """What differs beyond round-off over the queries that have a key: out, and lse and the
    gradients where those are right at the plain size (else their own checks report them)."""
    rows = truth.lse.isfinite()
    pairs = [("out", observed.out[rows], truth.out[rows])]
    found_lse = ctx.lse(observed, truth)[0]
    if found_lse is not None and ctx.lse_right():
        pairs.append(("lse", found_lse[rows], truth.lse[rows]))
    if observed.grads is not None and truth.grads is not None and ctx.backward_right():
        pairs += [
            (name, grad, right)
            for name, grad, right in zip(("dq", "dk", "dv"), observed.grads, truth.grads)
            if grad is not None
        ]
    misses = {name: difference(found, right) for name, found, right in pairs}
    limits = {name: ctx.limit(right) for name, _, right in pairs}
    return {name: miss for name, miss in misses.items() if miss > limits[name]}


def odd_lengths(ctx: FlashContext) -> Result:
    if not ctx.plain_right():
        return Result("odd-lengths", "skip", NOT_JUDGED)
    rules = (False, True) if ctx.causal_right() and ctx.alignment()[0] in ALIGNMENTS else (False,)
    for lq, lk in ODD:
        for causal in rules:
            case = Case(lq, lk, causal=causal)
            observed = ctx.observe(case, backward=(lq, lk) == WITH_GRADIENTS)
            truth = ctx.expected(observed, _rule(ctx, lq, lk, causal))
            wrong = _misses(ctx, observed, truth)
            if wrong:
                listed = ", ".join(f"{name} by {number(miss)}" for name, miss in wrong.items())
                return Result(
                    "odd-lengths",
                    "fail",
                    f"{case.describe()}: differs from the reference: {listed}. "
                    + _odd_cause(observed, truth, causal, ctx.limit(truth.out)),
                )
    tried = ", ".join(f"{lq}×{lk}" for lq, lk in ODD)
    causal_too = " (with and without causal)" if len(rules) > 1 else ""
    return Result(
        "odd-lengths",
        "pass",
        f"Lq×Lk = {tried}{causal_too}: out, lse and the gradients at "
        f"{WITH_GRADIENTS[0]}×{WITH_GRADIENTS[1]} equal the reference within round-off",
    )


def _odd_cause(observed: Observed, truth: Expected, causal: bool, limit: float) -> str:
    """A skipped partial key tile, or the first query that is wrong."""
    q, k, v = observed.q, observed.k, observed.v
    named = ""
    if not causal:
        named = explain_output(q, k, v, observed.out, limit)
        if not named and observed.lse is not None:
            named = explain_lse(q, k, v, observed.lse, limit)
    if named:
        return sentence(named)
    per_query = (observed.out.double() - truth.out).abs().flatten(0, -3).amax(dim=(0, 2))
    bad = (per_query > limit) | per_query.isnan()
    if not bool(bad.any()):
        return (
            "Tiles that run past Lq or Lk must be masked (loads and stores alike), never "
            "rounded down or left out"
        )
    first = int(bad.nonzero()[0])
    rest = " (and every later one)" if bool(bad[first:].all()) else ""
    return (
        f"The first wrong query is {first} of {observed.out.shape[-2]}{rest}: tiles that run "
        "past Lq or Lk must be masked (loads and stores alike), never rounded down or left out"
    )


def fully_masked(ctx: FlashContext) -> Result:
    if not ctx.has_causal:
        return Result(
            "fully-masked", "skip", "no causal parameter and no mask: every query has a key"
        )
    if not ctx.plain_right():
        return Result("fully-masked", "skip", NOT_JUDGED)
    if not ctx.causal_right():
        return Result("fully-masked", "skip", CAUSAL_NOT_JUDGED)
    rule = ctx.alignment()[0]
    if rule == "top-left":
        return Result(
            "fully-masked",
            "skip",
            "top-left causal (torch's is_causal): every query sees key 0, so none is left "
            "without keys",
        )
    if rule == "neither":
        return Result("fully-masked", "skip", "its causal alignment is wrong (see alignment)")
    observed = ctx.observe(MASKED, backward=True)
    truth = ctx.expected(observed, True)
    empty = ~truth.lse.isfinite()  # (…, Lq): queries with no key
    found_lse = ctx.lse(observed, truth)[0]
    said = f"{MASKED.describe()}: queries 0–{MASKED.lq - MASKED.lk - 1} have no key (bottom-right)"
    problem = _masked_problem(observed, empty, found_lse, ctx.backward_right())
    if problem:
        return Result("fully-masked", "fail", f"{said}; {problem}")
    lse_said = ", their lse −inf" if found_lse is not None else ""
    return Result(
        "fully-masked",
        "pass",
        f"{said}: their out is exactly 0{lse_said}, and every gradient is finite (dq of those "
        "queries 0)",
    )


def _masked_problem(
    observed: Observed, empty: torch.Tensor, lse: torch.Tensor | None, backward_right: bool
) -> str:
    out = observed.out[empty]
    bad = int((~out.isfinite()).sum())
    if bad:
        return (
            f"their out holds {bad} NaN/inf: out = acc / l is 0 / 0 for a row with no key; "
            "divide only where l > 0 and give such rows 0"
        )
    if bool((out != 0).any()):
        return (
            f"their out is not 0 (largest |out| {number(float(out.abs().max()))}): a row with no "
            "key has no weights, so its output is 0 (a value here is often memory left "
            "unwritten because every key tile of those queries was skipped)"
        )
    if lse is not None and not bool(lse[empty].isneginf().all()):
        value = lse[empty][~lse[empty].isneginf()][0]
        return (
            f"their lse is {number(float(value))}, not −inf: the log of an empty sum is −inf, and "
            "a finite value gives these rows weight when results are merged (qkv.merge) or "
            "when a backward computes exp(s − lse)"
        )
    grads = [g for g in observed.grads or () if g is not None]
    bad = sum(int((~g.isfinite()).sum()) for g in grads)
    if bad:
        return (
            f"the backward gives {bad} NaN/inf gradients: p = exp(s − lse) is exp(−inf + inf) = "
            "NaN for a row with no key; make p 0 there"
        )
    if grads and backward_right and bool((grads[0][empty] != 0).any()):
        return "dq of those queries is not 0: they attend nothing, so nothing flows back to them"
    return ""


def dtypes(ctx: FlashContext) -> Result:
    if not ctx.plain_right():
        return Result("dtypes", "skip", NOT_JUDGED)
    found = []
    for dtype in (torch.bfloat16, torch.float16):
        worst, worst_lse = 0.0, 0.0
        for causal in (False, True) if ctx.causal_right() else (False,):
            case = Case(MAIN.lq, MAIN.lk, causal=causal, dtype=dtype)
            observed = ctx.observe(case)
            truth = ctx.expected(observed, causal)  # float64 of the rounded inputs
            said = f"{dtype} ({case.describe()})"
            problem = _low_precision(ctx, observed, truth)
            if isinstance(problem, str):
                return Result("dtypes", "fail", f"{said}: {problem}")
            worst, worst_lse = max(worst, problem[0]), max(worst_lse, problem[1])
        lse_said = f"; its lse within {number(worst_lse)} of float64" if worst_lse else ""
        found.append(
            f"{dtype}: out's mean error {worst:.2f}× that of rounding the exact result to "
            f"{dtype}{lse_said}"
        )
    return Result(
        "dtypes", "pass", "; ".join(found) + f" (allowed: {ROUNDINGS}×; a float32 softmax)"
    )


def _low_precision(
    ctx: FlashContext, observed: Observed, truth: Expected
) -> str | tuple[float, float]:
    """What is wrong with a low-precision call, or its out's error in roundings and its lse's."""
    dtype = observed.q.dtype
    if observed.out.dtype != dtype:
        return f"out is {observed.out.dtype}; return q's dtype"
    error = float((observed.out.double() - truth.out).abs().mean())
    rounding = float((truth.out.to(dtype).double() - truth.out).abs().mean())
    times = error / rounding if rounding > 0 else 0.0
    if not times <= ROUNDINGS:  # NaN included
        return (
            f"out's mean error is {times:.2f}× that of rounding the exact result to {dtype} "
            f"(allowed {ROUNDINGS}×): keep the scores, the running max and sum and the softmax "
            f"in float32, and round only p to {dtype} for the p·V product"
        )
    found_lse = ctx.lse(observed, truth)[0]
    if found_lse is None or not ctx.lse_right():
        return times, 0.0
    miss = difference(found_lse, truth.lse)
    limit = LOW_LSE * (1 + float(truth.lse.abs().max()))
    if found_lse.dtype != torch.float32 or miss > limit:
        return (
            f"lse ({found_lse.dtype}) differs from float64 by {number(miss)} (allowed "
            f"{number(limit)}): keep the scores, the running max and sum, and lse, in float32"
        )
    return times, miss


def determinism(ctx: FlashContext) -> Result:
    first = ctx.observe(MAIN, backward=True)
    second = ctx.target.observe(MAIN, backward=True)
    pairs = [("out", first.out, second.out)]
    pairs += [
        (name, a, b)
        for name, a, b in zip(("dq", "dk", "dv"), first.grads or (), second.grads or ())
        if a is not None and b is not None
    ]
    changed = [(name, difference(a, b), tolerance(b)) for name, a, b in pairs]
    moved = ", ".join(f"{name} by {number(d)}" for name, d, _ in changed if d)
    said = "two forward and backward calls on the same inputs "
    if not moved:
        return Result("determinism", "pass", f"{said}agree bit for bit")
    if all(d <= limit for _, d, limit in changed):
        return Result(
            "determinism",
            "warn",
            f"{said}differ: {moved}, within round-off: the order of a sum changes from call to "
            "call (atomic adds do that); results cannot be reproduced bit for bit",
        )
    return Result(
        "determinism",
        "fail",
        f"{said}differ: {moved}, more than round-off: something reads memory that is not "
        "written yet (a race between programs, or uninitialised memory)",
    )
