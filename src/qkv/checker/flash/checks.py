"""The ``--flash`` checks of the numbers: oracle, lse, backward, causal, alignment. Each takes the
shared ``FlashContext`` and returns one ``Result`` with the numbers, naming the mistake when one
of the usual ones (``oracle``, ``diagnose``) reproduces what the implementation returned.
Legend: B batch, H heads, Lq query length, Lk key length, Dk query/key and Dv value features.
"""

from __future__ import annotations

import torch

from qkv.checker.compare import difference, tolerance
from qkv.checker.flash.context import (
    ALIGNMENT_CASES,
    ALIGNMENTS,
    CAUSAL,
    CAUSAL_NOT_JUDGED,
    MAIN,
    NOT_JUDGED,
    FlashContext,
    qkv_diagnosis,
)
from qkv.checker.flash.oracle import (
    explain_gradient,
    explain_lse,
    explain_output,
    from_saved,
    without_delta,
)
from qkv.checker.flash.target import Case
from qkv.checker.report import Result, number, sentence
from qkv.checker.target import error_text

REFERENCE = "qkv.attention(q, k, v{}, backend='reference') in float64"
VALUES = Case(256, 256, dv=16)  # Dv ≠ Dk: a scale by √Dv is wrong only here
GRADIENTS = ("dq", "dk", "dv")


def oracle(ctx: FlashContext) -> Result:
    observed = ctx.observe(MAIN)
    truth = ctx.expected(observed, False)
    out, shape = observed.out, tuple(observed.out.shape)
    if out.shape != truth.out.shape or out.dtype != observed.q.dtype:
        return Result(
            "oracle",
            "fail",
            f"out is {shape} {out.dtype} for q {tuple(observed.q.shape)} float32; expected "
            f"{tuple(truth.out.shape)} float32 (q's dtype, v's width)",
        )
    miss, limit = difference(out, truth.out), ctx.limit(truth.out)
    said = f"{MAIN.describe()}: out {shape} differs from {REFERENCE.format('')} by {number(miss)}"
    if miss > limit:
        why = explain_output(observed.q, observed.k, observed.v, out, limit) or qkv_diagnosis(
            observed, False, ctx.target.layout
        )
        return Result(
            "oracle", "fail", f"{said} (allowed {number(limit)}). {sentence(why or _UNEXPLAINED)}"
        )
    if miss > tolerance(truth.out):  # within the allowance of TF32 products only
        return Result(
            "oracle",
            "warn",
            f"{said}: more than float32 round-off ({number(tolerance(truth.out))}), as much as "
            "TF32 products give (10-bit mantissas, tl.dot's default for float32 on GPUs); "
            "input_precision='ieee' gives float32 accuracy",
        )
    return _with_values(ctx, f"{said}, within round-off ({number(limit)})")


_UNEXPLAINED = (
    "none of the usual mistakes (scale, softmax axis, rescaling of the running sum or "
    "accumulator, a skipped partial tile, exp2 without log₂e) explains it"
)


def _with_values(ctx: FlashContext, said: str) -> Result:
    """The oracle's second look, with values of another width than the keys."""
    try:
        observed = ctx.observe(VALUES)
    except Exception as error:  # many kernels take one head size for all: not a finding
        return Result("oracle", "pass", f"{said}; it does not take Dv ≠ Dk ({error_text(error)})")
    truth = ctx.expected(observed, False)
    miss, limit = difference(observed.out, truth.out), ctx.limit(truth.out)
    values = f"with values of width Dv = {VALUES.dv} ≠ Dk = {VALUES.dk}"
    if miss > limit:
        why = (
            qkv_diagnosis(observed, False, ctx.target.layout)
            or "the usual mistakes do not explain it"
        )
        return Result(
            "oracle",
            "fail",
            f"{sentence(values)} it differs from the reference by {number(miss)}: {why}",
        )
    return Result("oracle", "pass", f"{said}; {values} too")


def lse(ctx: FlashContext) -> Result:
    observed = ctx.observe(MAIN)
    truth = ctx.expected(observed, False)
    found, how = ctx.lse(observed, truth)
    rows = tuple(observed.q.shape[:-1])
    if found is None:
        return Result(
            "lse",
            "skip",
            f"no lse: it returns no second tensor shaped {rows} (like q without its last dim) "
            "and saves none for its backward",
        )
    miss, limit = difference(found, truth.lse), ctx.limit(truth.lse)
    said = f"lse {rows} ({how}) differs from the natural log-sum-exp in float64 by {number(miss)}"
    if found.dtype not in (torch.float32, torch.float64):
        return Result("lse", "fail", f"{said}; it is {found.dtype}: keep it float32")
    if miss > limit:
        why = (
            explain_lse(observed.q, observed.k, observed.v, found, limit)
            or "the usual mistakes do not explain it"
        )
        tied = "" if ctx.plain_right() else " (the output is wrong too: see oracle)"
        return Result("lse", "fail", f"{said} (allowed {number(limit)}). {sentence(why)}{tied}")
    return Result("lse", "pass", f"{said}, within round-off ({number(limit)})")


def backward(ctx: FlashContext) -> Result:
    cases = [MAIN, CAUSAL] if ctx.causal_right() else [MAIN]
    found = []
    for case in cases:
        observed = ctx.observe(case, backward=True)
        assert observed.grads is not None
        missing = [n for n, g in zip(GRADIENTS, observed.grads) if g is None]
        if missing:
            return Result(
                "backward", "fail", f"no gradient reaches {', '.join(missing)} ({case.describe()})"
            )
        truth = ctx.expected(observed, case.causal)
        assert truth.grads is not None
        misses = {
            name: (difference(grad, right), ctx.limit(right))
            for name, grad, right in zip(GRADIENTS, observed.grads, truth.grads)
            if grad is not None
        }
        said = ", ".join(f"{name} by {number(miss)}" for name, (miss, _) in misses.items())
        wrong = [name for name, (miss, limit) in misses.items() if miss > limit]
        if wrong:
            why = _follows_forward(ctx, case) or _gradient_cause(ctx, case, wrong[0])
            return Result(
                "backward",
                "fail",
                f"{case.describe()}: the gradients differ from float64 autograd of the reference: "
                f"{said}; {', '.join(wrong)} beyond round-off. {sentence(why)}",
            )
        found.append(f"{case.describe()}: {said}")
    unjudged = (
        "; causal not judged: " + CAUSAL_NOT_JUDGED if ctx.has_causal and len(cases) == 1 else ""
    )
    return Result(
        "backward",
        "pass",
        f"dq, dk, dv equal float64 autograd of the reference within round-off ({'; '.join(found)})"
        + unjudged,
    )


def _follows_forward(ctx: FlashContext, case: Case) -> str:
    """When the forward's out or lse is wrong: whether the backward is right for them."""
    if ctx.plain_right() and ctx.lse_right():
        return ""
    observed = ctx.observe(case, backward=True)
    truth = ctx.expected(observed, case.causal)
    found = ctx.lse(observed, truth)[0]
    if case.causal or found is None or observed.dout is None or observed.grads is None:
        return "The forward is wrong too (see oracle)."
    right = from_saved(observed.q, observed.k, observed.v, observed.out, found, observed.dout)
    if not all(
        g is not None and difference(g, r) <= ctx.limit(r) for g, r in zip(observed.grads, right)
    ):
        return "The forward is wrong too (see oracle and lse)."
    return (
        "The backward itself is right for what the forward saved: it recomputes p = "
        "exp(s − lse) from the forward's lse, which is wrong (see lse)"
    )


def _gradient_cause(ctx: FlashContext, case: Case, name: str) -> str:
    observed = ctx.observe(case, backward=True)
    assert observed.grads is not None and observed.dout is not None
    truth = ctx.expected(observed, case.causal)
    assert truth.grads is not None
    index = GRADIENTS.index(name)
    grad = observed.grads[index]
    assert grad is not None
    if not bool(grad.isfinite().all()):
        return f"its {name} holds NaN or inf"
    no_delta = None
    if not case.causal and name != "dv":
        no_delta = without_delta(observed.q, observed.k, observed.v, observed.dout)[index]
    right = truth.grads[index]
    limit = ctx.limit(right)
    return explain_gradient(name, grad, right, no_delta, observed.q.shape[-1], limit) or (
        "none of the usual mistakes (a missing or doubled scale, a base-2 factor, ds without "
        "D = rowsum(dO ∘ O)) explains it"
    )


def causal(ctx: FlashContext) -> Result:
    if not ctx.has_causal:
        return Result("causal", "skip", "no causal parameter (causal / is_causal)")
    if not ctx.plain_right():
        return Result("causal", "skip", NOT_JUDGED)
    observed = ctx.observe(CAUSAL)
    truth = ctx.expected(observed, True)
    miss, limit = difference(observed.out, truth.out), ctx.limit(truth.out)
    reference = REFERENCE.format(", causal=True")
    said = f"{CAUSAL.describe()}: out differs from {reference} by {number(miss)}"
    if miss > limit:
        why = qkv_diagnosis(observed, True, ctx.target.layout) or (
            "the usual mistakes (the diagonal hidden, the mask flipped or ignored) do not "
            "explain it; look at which key tiles are skipped and how the diagonal tile is masked"
        )
        return Result("causal", "fail", f"{said} (allowed {number(limit)}). {sentence(why)}")
    return Result("causal", "pass", f"{said}: query i sees keys 0 … i, itself included")


def alignment(ctx: FlashContext) -> Result:
    if not ctx.plain_right():
        return Result("alignment", "skip", NOT_JUDGED)
    found = []
    for case in (Case(c.lq, c.lk) for c in ALIGNMENT_CASES):
        observed = ctx.observe(case)
        truth = ctx.expected(observed, False)
        miss, limit = difference(observed.out, truth.out), ctx.limit(truth.out)
        if miss > limit:
            return Result(
                "alignment",
                "fail",
                f"{case.describe()}: out differs from the reference by {number(miss)} (allowed "
                f"{number(limit)}): with Lq ≠ Lk, loops and bounds over the queries must use Lq "
                "and those over the keys Lk",
            )
        found.append(f"{case.describe()} by {number(miss)}")
    said = "without causal masking, out differs from the reference at " + " and ".join(found)
    if not ctx.has_causal:
        return Result("alignment", "pass", f"{said}; no causal parameter")
    if not ctx.causal_right():
        return Result("alignment", "pass", f"{said}; causal not judged: {CAUSAL_NOT_JUDGED}")
    rule, misses = ctx.alignment()
    cases = " and ".join(c.describe().replace(", causal", "") for c in ALIGNMENT_CASES)
    if rule == "neither":
        return Result(
            "alignment",
            "fail",
            f"{said}; but causal with {cases} matches neither alignment: bottom-right misses by "
            f"{number(misses['bottom-right'])}, top-left by {number(misses['top-left'])}. Causal "
            "needs one rule everywhere: the key tiles it skips and the mask of the tiles it "
            "computes must use the same offset (Lk − Lq for bottom-right, 0 for top-left)",
        )
    return Result(
        "alignment",
        "pass",
        f"{said}; causal with {cases} is {rule}-aligned: {ALIGNMENTS[rule]} (within "
        f"{number(misses[rule])})",
    )
