"""What every ``--flash`` check shares: the target, its calls (run once per size), the float64
truth for them, and what was found once: whether the plain output is right, which causal
alignment it takes when Lq ≠ Lk, and where its lse comes from.
Legend: B batch, H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qkv.canonical import Causal
from qkv.checker.capture import Capture
from qkv.checker.compare import difference, tolerance
from qkv.checker.diagnose import RIGHT, Setting, diagnose
from qkv.checker.flash.oracle import Expected, expected
from qkv.checker.flash.target import Case, FlashTarget, Observed

TF32_EPS = 2.0**-10
MAIN = Case(256, 256)  # a length that tiles of 16, 32, 64, 128 and 256 all divide
CAUSAL = Case(256, 256, causal=True)
ALIGNMENTS = {
    "bottom-right": "query i sees keys j ≤ i + Lk − Lq: the last query sees every key (the "
    "alignment of a KV cache, FlashAttention-2 and qkv)",
    "top-left": "query i sees keys j ≤ i (torch's is_causal)",
}
ALIGNMENT_CASES = (Case(64, 192, causal=True), Case(192, 64, causal=True))
NOT_JUDGED = "not judged: the output is already wrong at Lq = Lk = 256 (see oracle)"
CAUSAL_NOT_JUDGED = "its causal output is already wrong at Lq = Lk = 256 (see causal)"


@dataclass
class FlashContext:
    target: FlashTarget
    runs: dict[tuple[Case, bool], Observed] = field(default_factory=dict)
    truths: dict[tuple[int, Causal], Expected] = field(default_factory=dict)
    verdicts: dict[str, bool] = field(default_factory=dict)  # what is right at the plain sizes
    aligned: tuple[str, dict[str, float]] | None = None  # see ``alignment``

    def limit(self, reference: torch.Tensor) -> float:
        """The difference from ``reference`` that round-off allows: float32's, or on a GPU that
        of TF32 products (10-bit mantissas, the default of Triton's tl.dot for float32)."""
        if self.target.device.type == "cpu":
            return tolerance(reference)
        finite = reference[reference.isfinite()]
        magnitude = float(finite.abs().max()) if finite.numel() else 1.0
        return max(tolerance(reference), 10 * TF32_EPS * (1 + magnitude))

    @property
    def has_causal(self) -> bool:
        return self.target.causal_param is not None

    def observe(self, case: Case, *, backward: bool = False) -> Observed:
        """The call for ``case`` (with its backward when asked), run once."""
        if (case, True) in self.runs:
            return self.runs[case, True]
        if (case, backward) not in self.runs:
            self.runs[case, backward] = self.target.observe(case, backward=backward)
        return self.runs[case, backward]

    def expected(self, observed: Observed, causal: Causal) -> Expected:
        """The float64 truth for an observed call under this causal rule, computed once."""
        key = (id(observed), causal)
        if key not in self.truths:
            self.truths[key] = expected(observed.q, observed.k, observed.v, causal, observed.dout)
        return self.truths[key]

    def plain_right(self) -> bool:
        """Whether the output at Lq = Lk = 256 without causal masking is right."""
        return self._right("plain", MAIN)

    def causal_right(self) -> bool:
        """Whether the causal output at Lq = Lk = 256 is right (False without causal)."""
        return self.has_causal and self._right("causal", CAUSAL)

    def _right(self, name: str, case: Case) -> bool:
        if name not in self.verdicts:
            observed = self.observe(case)
            truth = self.expected(observed, case.causal)
            self.verdicts[name] = difference(observed.out, truth.out) <= self.limit(truth.out)
        return bool(self.verdicts[name])

    def lse_right(self) -> bool:
        """Whether the lse at Lq = Lk = 256 is right, or there is none to judge."""
        if "lse" not in self.verdicts:
            observed = self.observe(MAIN)
            truth = self.expected(observed, False)
            found = self.lse(observed, truth)[0]
            miss = 0.0 if found is None else difference(found, truth.lse)
            self.verdicts["lse"] = miss <= self.limit(truth.lse)
        return bool(self.verdicts["lse"])

    def backward_right(self) -> bool:
        """Whether dq, dk, dv at Lq = Lk = 256 without causal masking are right."""
        if "backward" not in self.verdicts:
            observed = self.observe(MAIN, backward=True)
            truth = self.expected(observed, False)
            assert observed.grads is not None and truth.grads is not None
            self.verdicts["backward"] = all(
                g is not None and difference(g, r) <= self.limit(r)
                for g, r in zip(observed.grads, truth.grads)
            )
        return bool(self.verdicts["backward"])

    def alignment(self) -> tuple[str, dict[str, float]]:
        """ "bottom-right", "top-left" or "neither" for causal calls with Lq ≠ Lk, and how far
        each rule is from what it returns, over the queries that have a key under the rule."""
        if self.aligned is None:
            misses = dict.fromkeys(ALIGNMENTS, 0.0)
            for case in ALIGNMENT_CASES:
                observed = self.observe(case)
                for rule in misses:
                    truth = self.expected(observed, causal_argument(rule))
                    rows = truth.lse.isfinite()  # the queries that have a key
                    miss = difference(observed.out[rows], truth.out[rows])
                    misses[rule] = max(misses[rule], miss)
            limit = self.limit(self.observe(ALIGNMENT_CASES[0]).out)
            fits = [rule for rule, miss in misses.items() if miss <= limit]
            self.aligned = (fits[0] if fits else "neither", misses)
        return self.aligned

    def lse(self, observed: Observed, truth: Expected) -> tuple[torch.Tensor | None, str]:
        """Its lse for this call and where it came from: returned, or saved for its backward
        (of several saved tensors shaped like one, the closest to the truth)."""
        if observed.lse is not None:
            return observed.lse, "returned"
        saved = observed.lse_saved
        if not saved:
            return None, ""
        closest = min(saved, key=lambda t: difference(t, truth.lse))
        if len(saved) == 1:
            return closest, "saved for its backward"
        return closest, (
            f"saved for its backward: the closest of the {len(saved)} saved tensors shaped "
            "(…, Lq); one, the log-sum-exp, is all a backward needs"
        )


def causal_argument(alignment: str) -> Causal:
    """``qkv.attention``'s causal argument for a right alignment's name."""
    return "top-left" if alignment == "top-left" else "bottom-right"


def qkv_diagnosis(observed: Observed, causal: bool, layout: str) -> str:
    """The usual attention mistakes (scale, softmax axis, causal rule; ``diagnose``) that
    reproduce a square call's output, or ''."""
    q, k, v, out = (t.detach().double() for t in (observed.q, observed.k, observed.v, observed.out))
    heads = 1
    if layout == "BHLD":  # (B, H, L, D) -> (B, L, H*D), the heads side by side
        heads = q.shape[1]
        q, k, v, out = (t.transpose(1, 2).flatten(2) for t in (q, k, v, out))
    cap = Capture(q, k, v, out, lambda merged: merged, True, "the function's q, k, v")
    finding = diagnose(cap, Setting(causal=causal), heads)
    return "" if finding is None or finding.mistake == RIGHT else finding.explain()
