"""What every check shares: the target in eval mode, its inputs, and what was detected once.

Built once per ``qkv.check`` call: how the target asks for causal attention (a forward flag, a
constructor argument, or always), which mask encoding it takes (``probe``), whether two eval-mode
calls agree, and the first call's output. Captures and diagnoses are cached by setting.
Legend: B batch, L length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.checker.capture import Capture, run_captured
from qkv.checker.compare import difference, tolerance
from qkv.checker.diagnose import Finding, Setting, diagnose
from qkv.checker.inputs import Inputs
from qkv.checker.probe import Probe, padding_keep, probe
from qkv.checker.target import D_VALUE, Output, Target, error_text

BATCH, LENGTH = 2, 7  # 7: a length equal to no feature size, so shapes cannot be confused


@dataclass
class Context:
    target: Target
    inputs: Inputs
    causal_mode: str | None  # "flag" (forward), "init" (constructor), "always", or None
    causal_target: Target | None
    probe: Probe
    base: Output
    eval_noise: float  # largest difference between two eval-mode calls on the same input
    cache: dict[str, tuple[Output, Capture | None, Finding | None]] = field(default_factory=dict)
    values: tuple[str, Capture | None, Finding | None] | None = None  # the Dv ≠ Dk probe

    @property
    def always_causal(self) -> bool:
        return self.causal_mode == "always"

    def call(
        self,
        inputs: Inputs | None = None,
        *,
        causal: bool = False,
        keep: torch.Tensor | None = None,
        weights: bool = False,
        target: Target | None = None,
    ) -> Output:
        """One call; ``causal=True`` goes to the causal target, ``keep`` (B, L) is encoded the
        way the probe found."""
        chosen = target or (self.causal_target if causal else self.target)
        assert chosen is not None
        inputs = inputs or self.inputs
        mask = self.mask(keep, inputs.dtype)
        flag = causal and self.causal_mode == "flag"
        return chosen.call(inputs, causal=flag, mask=mask, weights=weights)

    def mask(self, keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The (B, L) keep mask in the encoding the probe found (None: no mask)."""
        if keep is None:
            return None
        assert self.probe.encoding is not None
        return self.probe.encoding.encode(keep, dtype)

    def setting(self, *, causal: bool = False, keep: torch.Tensor | None = None) -> Setting:
        d_in = self.target.width if self.target.kind == "module" else 0
        return Setting(causal=causal or self.always_causal, keep=keep, d_in=d_in)

    def diagnosed(
        self, name: str, *, causal: bool = False, padded: bool = False
    ) -> tuple[Output, Capture | None, Finding | None]:
        """Run with this setting, capture Q, K, V and diagnose (cached by ``name``)."""
        if name not in self.cache:
            keep = padding_keep(BATCH, LENGTH) if padded else None
            chosen = self.causal_target if causal else self.target
            assert chosen is not None
            mask = self.mask(keep, self.inputs.dtype)
            flag = causal and self.causal_mode == "flag"
            output, cap = run_captured(chosen, self.inputs, causal=flag, mask=mask)
            setting = self.setting(causal=causal, keep=keep)
            finding = None if cap is None else diagnose(cap, setting, self.target.heads)
            self.cache[name] = (output, cap, finding)
        return self.cache[name]

    def diagnosed_values(self) -> tuple[str, Capture | None, Finding | None]:
        """``values_probe``, run once."""
        if self.values is None:
            self.values = self.values_probe()
        return self.values

    def values_probe(self) -> tuple[str, Capture | None, Finding | None]:
        """The probe with values of another width than the keys (Dv = ``D_VALUE``): a scale by
        √Dv looks right whenever Dv = Dk. Returns what was run (or why not) and its diagnosis;
        no capture when it does not apply (a module without a value-width argument) or raised."""
        target = self.target
        inputs = self.inputs
        if target.kind == "function":
            inputs = target.inputs(BATCH, LENGTH, value_width=D_VALUE)
            chosen: Target | None = target
        elif target.value_init is not None:
            chosen = target.variant(**{target.value_init: D_VALUE})
        else:
            return "", None, None
        assert chosen is not None
        said = f"with values of width Dv = {D_VALUE}"
        if chosen.module is not None:
            chosen.module.eval()
            said = f"built with {target.value_init}={D_VALUE}"
        try:
            _, cap = run_captured(chosen, inputs)
        except Exception as error:  # a function that needs Dv = Dk: not a finding
            return f"it does not take Dv ≠ Dk ({error_text(error)})", None, None
        if cap is None:
            return said, None, None
        return said, cap, diagnose(cap, self.setting(), self.target.heads)


def gradients_of(
    loss: torch.Tensor, inputs: Inputs, target: Target
) -> dict[str, torch.Tensor | None]:
    """d loss / d each input tensor and parameter (None where the loss does not depend on it)."""
    named = {f"input {i}": t for i, t in enumerate(inputs.tensors)}
    if target.module is not None:
        named.update({n: p for n, p in target.module.named_parameters() if p.requires_grad})
    found = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return dict(zip(named, found))


def _is_always_causal(target: Target, inputs: Inputs, base: Output) -> bool:
    """No output depends on a later position, yet the last one depends on the first."""
    half = inputs.length // 2
    later = target.call(inputs.replaced(0, range(half, inputs.length))).rows
    earlier = target.call(inputs.replaced(0, [0])).rows
    limit = tolerance(base.rows)
    no_future = difference(later[0, :half], base.rows[0, :half]) <= limit
    sees_past = difference(earlier[0, -1], base.rows[0, -1]) > limit
    return no_future and sees_past


def _causal(target: Target, inputs: Inputs, base: Output) -> tuple[str | None, Target | None]:
    if target.causal_param is not None:
        return "flag", target
    if _is_always_causal(target, inputs, base):
        return "always", target
    if target.causal_init is not None:
        variant = target.variant(**{target.causal_init: True})
        if variant is not None and variant.module is not None:
            variant.module.eval()
            return "init", variant
    return None, None


def build(target: Target) -> Context:
    """Eval mode, the first call, and what the target takes (raises what the target raises)."""
    if target.module is not None:
        target.module.eval()
    inputs = target.inputs(BATCH, LENGTH)
    with torch.no_grad():
        base = target.call(inputs)
        again = target.call(inputs)
        noise = difference(base.rows, again.rows)
        causal_mode, causal_target = _causal(target, inputs, base)
        found = probe(target, inputs, causal=causal_mode == "always")
    return Context(target, inputs, causal_mode, causal_target, found, base, noise)


def describe(ctx: Context) -> dict[str, Any]:
    """What was detected, for the report's ``detected``."""
    target = ctx.target
    found: dict[str, Any] = {"kind": target.kind}
    if target.config_param is not None:
        config = vars(target.init[target.config_param])
        usual = ("n_embd", "n_head", "dropout", "block_size", "bias")
        shown = ", ".join(f"{name}={config[name]!r}" for name in usual)
        found["constructor"] = f"{target.config_param}: a namespace with {shown} (and synonyms)"
    elif target.init:
        found["constructor"] = ", ".join(f"{k}={v!r}" for k, v in target.init.items())
    if target.kind == "function":
        found["inputs"] = "q, k, v " + ("(B, H, L, D)" if target.layout == "BHLD" else "(B, L, D)")
    else:
        found["input width"] = target.width
    found["heads"] = target.heads if target.heads is not None else "not given"
    found["causal"] = {
        "flag": f"forward argument {target.causal_param}=True",
        "init": f"constructor argument {target.causal_init}=True",
        "always": "always (no output depends on a later position)",
        None: "not supported",
    }[ctx.causal_mode]
    encoding = ctx.probe.encoding
    if encoding is None:
        found["mask"] = "not supported"
    else:
        inexact = " (its best fit; no layout or polarity masks exactly: see padding)"
        exact = "" if ctx.probe.exact else inexact
        found["mask"] = encoding.describe(target.mask_param or "mask") + exact
    found["weights"] = (
        f"returned, {tuple(ctx.base.weights.shape)}"
        if ctx.base.weights is not None
        else (f"on request ({target.weights_param}=True)" if target.weights_param else "none")
    )
    return found
