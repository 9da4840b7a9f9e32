"""The checks of attention's arithmetic: shapes, weights, oracle, scale, causal, padding,
fully-masked. Each takes the shared ``Context`` and returns one ``Result`` with the numbers.

The oracle is ``qkv.attention(..., backend="reference")`` in float64 on the implementation's
own Q, K and V (see ``capture``); when it disagrees, ``diagnose`` names the mistake.
"""

from __future__ import annotations

import math

import torch

from qkv.checker.compare import difference, tolerance
from qkv.checker.context import BATCH, LENGTH, Context, gradients_of
from qkv.checker.diagnose import RIGHT, Finding, fit_scale, right_error
from qkv.checker.probe import PADDED, padding_keep
from qkv.checker.report import Result, number, sentence

NO_CAPTURE = (
    "could not find the Q, K and V projections: qkv looks for nn.Linear layers applied to x "
    "(one fused or one each) and an output projection; compute them with nn.Linear, or check "
    "the attention function f(q, k, v) itself"
)


def shapes(ctx: Context) -> Result:
    target, inputs, out = ctx.target, ctx.inputs, ctx.base.out
    shape = tuple(inputs.tensors[0].shape)
    expected: tuple[int, ...] = shape
    if target.kind == "module":
        expected = (BATCH, LENGTH, target.out_width or target.width)
        if target.value_init is not None and out.shape[-1] != expected[-1]:
            # no output projection: its values' width (all heads) is the output's
            value_width = target.init[target.value_init] * (target.heads or 1)
            expected = (BATCH, LENGTH, value_width)
    said = f"output {tuple(out.shape)} {out.dtype} for input {shape} {inputs.dtype}"
    if tuple(out.shape) != expected:
        return Result("shapes", "fail", f"{said}; expected {expected}")
    if out.dtype != inputs.dtype:
        return Result("shapes", "fail", f"{said}: the output must keep the input's dtype")
    weights = ctx.base.weights
    if weights is not None and (weights.shape[0] != BATCH or weights.dim() not in (3, 4)):
        return Result(
            "shapes",
            "fail",
            f"{said}; weights {tuple(weights.shape)}: expected "
            f"(B, L, L) or (B, H, L, L) = ({BATCH}, [H,] {LENGTH}, {LENGTH})",
        )
    return Result("shapes", "pass", f"{said}, as expected")


def weights(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result("weights", "skip", "the output is random in eval mode (see dropout)")
    with torch.no_grad():
        found = ctx.call(weights=True).weights
    if found is None:
        return Result(
            "weights",
            "skip",
            "it returns no attention weights (no return_weights / "
            "need_weights parameter, no (L, L) item in what it returns)",
        )
    found = found.double()
    smallest = float(found.min()) if found.numel() else 0.0
    sums = found.sum(-1)
    miss = float((sums - 1).abs().max()) if sums.numel() else 0.0
    limit = tolerance(sums)
    said = (
        f"weights {tuple(found.shape)}: smallest {number(smallest)}, rows sum to 1 ± {number(miss)}"
    )
    if not bool(found.isfinite().all()):
        return Result("weights", "fail", f"{said}; the weights hold NaN or inf")
    if smallest < -limit or miss > limit:
        why = _weights_cause(found, sums)
        return Result("weights", "fail", f"{said}; they must be ≥ 0 with rows summing to 1. {why}")
    return Result("weights", "pass", f"{said}: each query's weights are a distribution")


def _weights_cause(found: torch.Tensor, sums: torch.Tensor) -> str:
    columns = found.sum(-2)
    if float((columns - 1).abs().max()) < 1e-4:
        return "Its columns sum to 1: the softmax ran over the queries (dim=-2), not the keys."
    ratio = float(sums.mean())
    if float((sums - ratio).abs().max()) < 1e-4:
        return (
            f"Every row sums to {ratio:.4f} ≈ 1/√{1 / ratio**2:.3g}: the weights were scaled "
            "after the softmax; scale the scores before it."
        )
    return ""


def _oracle_said(ctx: Context, finding: Finding | None, causal: bool) -> str:
    heads = finding.heads if finding else ctx.target.heads
    rule = ", causal=True" if causal or ctx.always_causal else ""
    return f"qkv.attention(q, k, v{rule}, backend='reference') in float64 ({heads} head(s))"


def oracle(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result("oracle", "skip", "the output is random in eval mode (see dropout)")
    _, cap, finding = ctx.diagnosed("plain")
    if cap is None:
        return Result("oracle", "skip", NO_CAPTURE)
    said = _oracle_said(ctx, finding, False)
    if finding is not None and finding.mistake.name == "right":
        found = f"equals {said} on its own Q, K, V (max difference {number(finding.error)}; "
        values, values_cap, values_finding = ctx.diagnosed_values()
        if values_cap is not None and (values_finding is None or values_finding.mistake != RIGHT):
            miss = right_error(values_cap, ctx.setting(), finding.heads)
            scaled = values_finding is not None and values_finding.mistake.check == "scale"
            why = ": the scale is wrong (see scale)" if scaled else ""
            return Result(
                "oracle",
                "fail",
                f"{found}{cap.source}), but not {values}: it misses by {number(miss)}{why}",
            )
        return Result("oracle", "pass", f"{found}{cap.source})")
    heads = finding.heads if finding else (ctx.target.heads or 1)
    miss = right_error(cap, ctx.setting(), heads)
    if finding is not None and finding.mistake.check == "scale":  # explained by the scale check
        return Result(
            "oracle",
            "fail",
            f"differs from {said} on its own Q, K, V by {number(miss)} ({cap.source}): the scale "
            "is wrong (see scale)",
        )
    if finding is not None:
        evidence = _evidence(said, miss, finding)
        return Result("oracle", "fail", f"{sentence(finding.explain())}. {evidence} ({cap.source})")
    return Result(
        "oracle",
        "fail",
        f"differs from {said} on its own Q, K, V by {number(miss)}; "
        "none of the usual mistakes (scale, softmax axis, head split or merge) explains "
        f"it ({cap.source})",
    )


def _evidence(said: str, miss: float, finding: Finding) -> str:
    return (
        f"The evidence: from its own Q, K, V, {said} misses its output by {number(miss)}, while "
        f"the same computation with this mistake in it gives its output to {number(finding.error)}"
    )


def scale(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result("scale", "skip", "the output is random in eval mode (see dropout)")
    _, cap, finding = ctx.diagnosed("plain")
    if cap is None:
        return Result("scale", "skip", NO_CAPTURE)
    if finding is not None:
        numbers = finding.numbers
        right = f"1/√{numbers['D']} = 1/√head_dim ({finding.heads} head(s) of size {numbers['D']})"
        if finding.mistake.check == "scale":
            miss = right_error(cap, ctx.setting(), finding.heads)
            said = _oracle_said(ctx, finding, False)
            evidence = _evidence(said, miss, finding)
            return Result("scale", "fail", f"{sentence(finding.explain())}. {evidence}")
        if finding.mistake.name == "right":
            return _scale_with_values(ctx, f"the scale is {right}, as it must be")
        return Result(
            "scale", "pass", f"the scale is {right}; what is wrong is elsewhere (see oracle)"
        )
    heads = ctx.target.heads or 1
    value, miss = fit_scale(cap, ctx.setting(), heads)
    head = cap.q.shape[-1] // heads
    if miss <= tolerance(cap.observed):
        return Result(
            "scale",
            "fail",
            f"your scale is {value:.4g} ≈ 1/√{value**-2:.3g}; with "
            f"{heads} head(s) of size {head} it must be 1/√{head} = {head**-0.5:.4g}",
        )
    return Result(
        "scale",
        "skip",
        "no scale s makes softmax(QKᵀ·s)V equal the output (closest "
        f"misses by {number(miss)}): the error is not the scale (see oracle)",
    )


def _scale_with_values(ctx: Context, said: str) -> Result:
    """The scale check's second look, with values of another width than the keys."""
    values, cap, finding = ctx.diagnosed_values()
    if cap is None:
        return Result("scale", "pass", f"{said}; {values}" if values else said)
    if finding is not None and finding.mistake.check == "scale":
        miss = right_error(cap, ctx.setting(), finding.heads)
        evidence = _evidence(_oracle_said(ctx, finding, False), miss, finding)
        numbers = finding.numbers
        return Result(
            "scale",
            "fail",
            f"{sentence(values)} (Dk = {numbers['D']}): {finding.explain()}. {evidence}",
        )
    return Result("scale", "pass", f"{said}, {values} (≠ Dk) too")


def causal(ctx: Context) -> Result:
    if ctx.causal_mode is None:
        return Result(
            "causal",
            "skip",
            "no causal option (forward causal/is_causal, or a "
            "constructor causal argument) and the output is not causal by itself",
        )
    if ctx.eval_noise > 0:
        return Result("causal", "skip", "the output is random in eval mode (see dropout)")
    half = LENGTH // 2
    with torch.no_grad():
        base = ctx.call(causal=True).rows
        later = ctx.call(ctx.inputs.replaced(0, range(half, LENGTH)), causal=True).rows
    leak = difference(later[0, :half], base[0, :half])
    _, cap, finding = ctx.diagnosed("causal", causal=True)
    cause = _cause(finding, "causal")
    bad_rows = [i for i in range(LENGTH) if not bool(base[:, i].isfinite().all())]
    said = (
        f"changing positions {half}–{LENGTH - 1} changes the outputs at 0–{half - 1} "
        f"by {number(leak)}"
    )
    if leak > tolerance(base) or math.isnan(leak):
        why = cause or _elsewhere(ctx)
        return Result(
            "causal", "fail", f"{said}: earlier positions see the future. {sentence(why)}"
        )
    if bad_rows:
        return Result(
            "causal",
            "fail",
            f"{said}, but positions {bad_rows} give NaN/inf. "
            f"{cause or 'A query must see itself: the diagonal stays allowed.'}",
        )
    if cause:
        return Result("causal", "fail", f"{said}, but {cause}")
    if cap is None:
        return Result("causal", "pass", f"{said} (outputs not recomputed: {NO_CAPTURE})")
    if finding is None or finding.mistake.name != "right":
        return Result(
            "causal",
            "pass",
            f"{said}; the outputs differ from the oracle for another "
            "reason (see oracle), so whether each position sees itself is not shown",
        )
    return Result(
        "causal",
        "pass",
        f"{said}; equals {_oracle_said(ctx, finding, True)}, so "
        "each position sees itself and every earlier one",
    )


def _elsewhere(ctx: Context) -> str:
    """The oracle check's diagnosis, which often explains a causal or padding failure too."""
    if ctx.eval_noise > 0:
        return ""
    _, _, finding = ctx.diagnosed("plain")
    if finding is None or finding.mistake.name == "right":
        return ""
    return f"It follows from what the oracle check found: {finding.explain()}"


def _cause(finding: Finding | None, check_id: str) -> str:
    """The diagnosis, when it is a mistake of this check (others are reported by theirs)."""
    return finding.explain() if finding is not None and finding.mistake.check == check_id else ""


def padding(ctx: Context) -> Result:
    encoding = ctx.probe.encoding
    if encoding is None:
        return Result(
            "padding",
            "skip",
            "no mask parameter (mask, attn_mask, attention_mask, key_padding_mask, padding_mask)",
        )
    if ctx.eval_noise > 0:
        return Result("padding", "skip", "the output is random in eval mode (see dropout)")
    keep = padding_keep(BATCH, LENGTH)
    with torch.no_grad():
        masked = ctx.call(keep=keep, weights=True)
        moved = ctx.call(ctx.inputs.replaced(0, range(PADDED)), keep=keep).rows
    change = difference(moved[0, PADDED:], masked.rows[0, PADDED:])
    said = (
        f"with {encoding.describe(ctx.target.mask_param or 'mask')} and item 0's first "
        f"{PADDED} tokens padded, changing them changes the real tokens' outputs by "
        f"{number(change)}"
    )
    leaked, allowed = 0.0, 0.0
    if masked.weights is not None:
        leaked = float(masked.weights[0, ..., PADDED:, :PADDED].double().abs().max())
        allowed = tolerance(masked.weights)
        said += f"; real queries give padded keys weight up to {number(leaked)}"
    _, _, finding = ctx.diagnosed("padding", padded=True)
    cause = _cause(finding, "padding")
    leaks = change > tolerance(masked.rows) or leaked > allowed
    if leaks or math.isnan(change) or math.isnan(leaked):
        why = cause or _elsewhere(ctx)
        return Result("padding", "fail", f"{said}: padding leaks into real tokens. {sentence(why)}")
    if cause or not ctx.probe.exact:
        why = cause or _elsewhere(ctx)
        return Result(
            "padding",
            "fail",
            f"{said}, but the real tokens' outputs differ from "
            f"running them alone by {number(ctx.probe.error)}. {sentence(why)}",
        )
    return Result("padding", "pass", f"{said}; they equal the real tokens run alone")


def _added_note(ctx: Context) -> str:
    encoding = ctx.probe.encoding
    if encoding is None or encoding.polarity != "float 0 / -inf":
        return ""
    return (
        " (its float mask was given -inf, torch's and qkv's 'blocked'; a caller that adds "
        "torch.finfo(dtype).min instead hides this, the softmax should not depend on it)"
    )


def fully_masked(ctx: Context) -> Result:
    if ctx.probe.encoding is None:
        return Result("fully-masked", "skip", "no mask parameter, so no query can lose all keys")
    keep = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    keep[0] = False  # item 0: every key is padding
    inputs = ctx.inputs.with_grad()
    with torch.no_grad():  # inference: some implementations take another path without autograd
        inferred = ctx.call(keep=keep).rows
    rows = ctx.call(inputs, keep=keep).rows
    bad = max(int((~r[0].isfinite()).sum()) for r in (inferred, rows))
    said = f"item 0 with every key padded gives {bad} NaN/inf outputs"
    if bad:
        path = "" if not bool(rows[0].isfinite().all()) else " (under torch.no_grad() only)"
        return Result(
            "fully-masked",
            "fail",
            f"{said} (of {rows[0].numel()}){path}: softmax of a row that is all -inf is 0/0. "
            "Give such rows zero weights (qkv: exactly 0), e.g. "
            "torch.where(row has a key, softmax, 0)" + _added_note(ctx),
        )
    grads = list(gradients_of(rows.sum(), inputs, ctx.target).values())
    bad_grads = sum(int((~g.isfinite()).sum()) for g in grads if g is not None)
    if bad_grads:
        return Result(
            "fully-masked",
            "fail",
            f"{said}, but {bad_grads} NaN/inf gradients: a "
            "NaN replaced after the softmax still poisons the backward pass; keep the "
            "NaN from ever being computed",
        )
    size = float(rows[0].detach().abs().max())
    note = "all zeros" if size == 0 else f"largest |output| {number(size)}; qkv gives exactly 0"
    return Result("fully-masked", "pass", f"{said} ({note}) and finite gradients")
