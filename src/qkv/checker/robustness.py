"""The checks of behaviour around the arithmetic: batch, dropout, empty, dtypes, gradients.

Each takes the shared ``Context`` and returns one ``Result`` with the numbers.
"""

from __future__ import annotations

import torch

from qkv.checker.compare import difference, tolerance
from qkv.checker.context import BATCH, LENGTH, Context, gradients_of
from qkv.checker.probe import padding_keep
from qkv.checker.report import Result, number
from qkv.checker.target import Target, error_text

DROPOUT_P = 0.5
LOW = {torch.float16: 5e-3, torch.bfloat16: 4e-2}  # relative to float32: a few input roundings


def batch(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result("batch", "skip", "the output is random in eval mode (see dropout)")
    with torch.no_grad():
        alone = torch.cat([ctx.call(ctx.inputs.item(i)).rows for i in range(BATCH)])
        other = ctx.call(ctx.inputs.replaced(1, range(LENGTH))).rows
    apart = difference(alone, ctx.base.rows)
    moved = difference(other[0], ctx.base.rows[0])
    said = (
        f"each item run alone differs from the batch by {number(apart)}; changing item 1 "
        f"changes item 0 by {number(moved)}"
    )
    if max(apart, moved) > tolerance(ctx.base.rows):
        return Result(
            "batch",
            "fail",
            f"{said}: items of a batch mix. Attention works within "
            "each item: no reduction, softmax or view may cross the batch dim 0",
        )
    return Result("batch", "pass", f"{said}: items are independent")


def dropout(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result(
            "dropout",
            "fail",
            _in_eval(f"two calls on the same input differ by {number(ctx.eval_noise)}"),
        )
    said = "two eval-mode calls agree exactly"
    target = ctx.target
    if target.module is None:
        return Result("dropout", "pass", f"{said} (a function has no train mode)")
    trained, rate = _with_dropout(target)
    module = trained.module
    assert module is not None
    if trained is not target:  # the checks ran with dropout 0; the author's layer drops
        module.eval()
        with torch.no_grad():
            noise = difference(trained.call(ctx.inputs).rows, trained.call(ctx.inputs).rows)
        if noise > 0:
            return Result(
                "dropout", "fail", _in_eval(f"with {rate}, two calls differ by {number(noise)}")
            )
        said += f", with {rate} too"
    module.train()
    try:
        with torch.no_grad():
            first = trained.call(ctx.inputs).rows
            second = trained.call(ctx.inputs).rows
    finally:
        module.eval()
    changed = difference(first, second)
    if changed > 0:
        p = f" with {rate}" if trained is not target else ""
        return Result(
            "dropout",
            "pass",
            f"{said}; in train mode{p} two calls differ by {number(changed)}: it drops",
        )
    if trained is not target and target.config_param is None:
        return Result(
            "dropout",
            "fail",
            f"{said}, but with {rate} two train-mode calls agree too: the dropout is never applied",
        )
    return Result("dropout", "pass", f"{said}; no dropout in train mode either (p = 0 or none)")


def _in_eval(said: str) -> str:
    return (
        f"in eval mode {said}: dropout runs in eval mode. Use nn.Dropout (it follows .eval()) "
        "or F.dropout(..., training=self.training)"
    )


def _with_dropout(target: Target) -> tuple[Target, str]:
    """The target built as its author uses it: with its own default dropout rate when that is
    not 0 (the checks build it with 0), else with ``DROPOUT_P``; the target itself when it
    takes no rate."""
    name = target.dropout_init
    variant = None
    if name is not None:
        default = target.dropout_default
        rate = default if default else DROPOUT_P
        variant = target.variant(**{name: rate})
    if name is None or variant is None:
        return target, ""
    why = "its default" if target.dropout_default else "a trial rate"
    return variant, f"{name}={rate} ({why})"


def _empty_hint(error: Exception) -> str:
    """Why an empty sequence (L = 0) crashed, from the usual two causes."""
    message = str(error)
    if "unspecified dimension size -1" in message:
        return (
            " An empty sequence must give an empty output: view/reshape with -1 cannot infer a "
            "size from 0 elements; spell the sizes out, e.g. .view(B, L, H, D)."
        )
    if "non-zero size" in message or "reduction" in message:
        return (
            " An empty sequence must give an empty output: a reduction such as max(dim=-1) "
            "over no keys fails; guard it or return early."
        )
    return " An empty sequence must give an empty output (B, 0, E)."


def empty(ctx: Context) -> Result:
    results = []
    rules = [False, True] if ctx.causal_mode in ("flag", "init") else [False]
    for length in (0, 1):
        for causal in rules:
            said = f"L = {length}" + (" (causal)" if causal else "")
            try:
                with torch.no_grad():
                    rows = ctx.call(ctx.target.inputs(BATCH, length, seed=3), causal=causal).rows
            except Exception as error:  # the implementation's own failure is the finding
                hint = _empty_hint(error) if length == 0 else ""
                return Result("empty", "fail", f"{said} raised {error_text(error)}.{hint}")
            if tuple(rows.shape[:2]) != (BATCH, length):
                return Result("empty", "fail", f"{said} gave shape {tuple(rows.shape)}")
            if not bool(rows.isfinite().all()):
                return Result("empty", "fail", f"{said} gave NaN/inf outputs")
        results.append(f"L = {length} gives {tuple(rows.shape)}")
    causal_too = " (with and without causal)" if len(rules) > 1 else ""
    return Result("empty", "pass", "; ".join(results) + f", finite{causal_too}")


def _configs(ctx: Context) -> list[tuple[str, bool, torch.Tensor | None]]:
    configs: list[tuple[str, bool, torch.Tensor | None]] = [("plain", False, None)]
    if ctx.causal_mode in ("flag", "init"):
        configs.append(("causal", True, None))
    if ctx.probe.encoding is not None:
        configs.append(("padded", False, padding_keep(BATCH, LENGTH, side="right")))
    return configs


def dtypes(ctx: Context) -> Result:
    if ctx.eval_noise > 0:
        return Result("dtypes", "skip", "the output is random in eval mode (see dropout)")
    found = []
    for dtype, relative in LOW.items():
        low = ctx.target.dtype_copy(dtype)
        low_causal = None if ctx.causal_target is None else ctx.causal_target.dtype_copy(dtype)
        worst = 0.0
        for name, causal, keep in _configs(ctx):
            chosen = low_causal if causal else low
            try:
                with torch.no_grad():
                    reference = ctx.call(causal=causal, keep=keep).rows
                    rows = ctx.call(
                        ctx.inputs.to(dtype), causal=causal, keep=keep, target=chosen
                    ).rows
            except Exception as error:  # the implementation's own failure is the finding
                hint = (
                    "fills like -1e9 overflow float16: use float('-inf') or "
                    "torch.finfo(scores.dtype).min"
                    if "overflow" in str(error)
                    else f"inputs, parameters and any float mask are all {dtype}"
                )
                return Result(
                    "dtypes", "fail", f"{dtype} ({name}) raised {error_text(error)}; {hint}"
                )
            real = slice(None) if keep is None else keep
            miss = difference(rows.float()[real], reference[real])
            limit = relative * (1 + float(reference[real].abs().max()))
            if miss > limit:
                return Result(
                    "dtypes",
                    "fail",
                    f"{dtype} ({name}) differs from float32 by "
                    f"{number(miss)} (allowed {number(limit)}); compute scores and softmax "
                    "in float32",
                )
            worst = max(worst, miss)
        found.append(f"{dtype} within {number(worst)} of float32")
    return Result("dtypes", "pass", "; ".join(found) + " (finite)")


def gradients(ctx: Context) -> Result:
    found: dict[str, torch.Tensor | None] = {}
    for name, causal, keep in _configs(ctx):
        inputs = ctx.inputs.with_grad()
        rows = ctx.call(inputs, causal=causal, keep=keep).rows
        direction = torch.randn(rows.shape, generator=torch.Generator().manual_seed(5))
        if keep is not None:  # padded queries' outputs are free: only real ones carry a loss
            direction = direction * keep[:, :, None]
        grads = gradients_of((rows * direction).sum(), inputs, ctx.target)
        missing = [n for n, g in grads.items() if g is None and n.startswith("input")]
        bad = [n for n, g in grads.items() if g is not None and not bool(g.isfinite().all())]
        if missing or bad:
            return Result(
                "gradients",
                "fail",
                f"backward ({name}) gives no gradient to {missing} and NaN/inf gradients to {bad}",
            )
        found.update(grads)
    largest = max(float(g.abs().max()) for g in found.values() if g is not None and g.numel())
    count = sum(g is not None for g in found.values())
    runs = ", ".join(name for name, _, _ in _configs(ctx))
    return Result(
        "gradients",
        "pass",
        f"backward ({runs}) gives finite gradients to {count} tensors "
        f"(inputs and parameters; largest |∂| {number(largest)})",
    )
