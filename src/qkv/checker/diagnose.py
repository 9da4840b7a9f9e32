"""What is wrong, not only that something is: the usual mistakes, each recomputed and compared.

From the implementation's own Q, K and V (float64), each candidate below recomputes what an
implementation *with that mistake* would output. The first candidate that reproduces the
observed output names the mistake. The right computation is ``qkv.attention(...,
backend="reference")``, softmax(QKᵀ/√d_k)V; the candidates change one thing each: the scale, the
softmax's axis, the head split or merge, the masked-score fill, the causal rule or the axis of the
padding mask. Legend: B batch, H heads, L length, E all heads' width, D head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from qkv.checker.capture import Capture
from qkv.checker.compare import difference, tolerance
from qkv.functional import attention

MASKED_TINY = 1e-20  # a "very small" fill: after softmax it is weight like any other score
MASKED_POSITIVE = 1e9


@dataclass(frozen=True)
class Setting:
    """What the implementation was asked to do: causal or not, and which keys are real."""

    causal: bool = False
    keep: torch.Tensor | None = None  # (B, L) bool, True = real key token
    d_in: int = 0  # the input's width (a module's x)


@dataclass(frozen=True)
class Mistake:
    """One way to get attention wrong; ``check`` is the id of the check it fails."""

    name: str
    check: str
    text: str  # format fields: H, Hkv, E, D, Dv, d_in
    scale: str = "head"
    scale_after_softmax: bool = False
    softmax_dim: int = -1
    split_transposed: bool = True
    merge_transposed: bool = True
    fill: float = -math.inf
    rule: str = "j<=i"  # causal rule: "j<=i" (right), "j<i", "j>=i", "j>i", "all" (none)
    padding_axis: str = "keys"


RIGHT = Mistake("right", "oracle", "")
SCALES: dict[str, tuple[Callable[[int, int, int, int], float], str]] = {
    # name -> (its value from D, E, Dv, d_in; how to say it)
    "head": (lambda d, e, dv, di: d**-0.5, "1/√{D} = 1/√head_dim"),
    "one": (lambda d, e, dv, di: 1.0, "1 (no scale at all)"),
    "width": (lambda d, e, dv, di: e**-0.5, "1/√{E} = 1/√d_model, the width of all heads"),
    "d_in": (lambda d, e, dv, di: di**-0.5, "1/√{d_in} = 1/√d_in, the input's width"),
    "d_v": (lambda d, e, dv, di: dv**-0.5, "1/√{Dv} = 1/√d_v, the value size"),
    "no-sqrt": (lambda d, e, dv, di: 1.0 / d, "1/{D} = 1/head_dim, without the square root"),
    "times": (lambda d, e, dv, di: d**0.5, "√{D}: multiplied instead of divided"),
}
MUST = (
    "with {H} head(s) of size {D} it must be 1/√{D} = 1/√d_k, the query/key size per head: a dot "
    "product of d_k numbers spreads like √d_k, and the scale undoes exactly that"
)


def _scale_mistakes() -> list[Mistake]:
    return [
        Mistake(f"scale-{name}", "scale", f"your scale is {said}; {MUST}", scale=name)
        for name, (_, said) in SCALES.items()
        if name != "head"
    ]


MISTAKES = [
    *_scale_mistakes(),
    Mistake(
        "scale-after-softmax",
        "scale",
        "the scale 1/√{D} is applied after the softmax, to the "
        "weights; it belongs inside, to the scores QKᵀ before the softmax (rows of weights must "
        "sum to 1)",
        scale_after_softmax=True,
    ),
    Mistake(
        "softmax-axis",
        "oracle",
        "the softmax runs over the wrong axis, the queries (dim=-2); "
        "each query's row of scores over the keys must be normalised: softmax(scores, dim=-1)",
        softmax_dim=-2,
    ),
    Mistake(
        "split-no-transpose",
        "oracle",
        "the heads are split without a transpose: (B, L, E) "
        "viewed as (B, H, L, D) mixes positions and heads; view as (B, L, H, D), then "
        ".transpose(1, 2)",
        split_transposed=False,
    ),
    Mistake(
        "merge-no-transpose",
        "oracle",
        "the heads are merged without a transpose: (B, H, L, D) "
        "viewed as (B, L, E) mixes positions and heads; .transpose(1, 2) first, then "
        ".reshape(B, L, E)",
        merge_transposed=False,
    ),
    Mistake(
        "split-merge-no-transpose",
        "oracle",
        "the heads are split and merged without a "
        "transpose: (B, L, E) viewed as (B, H, L, D) and back; view as (B, L, H, D) and "
        ".transpose(1, 2) (and back the same way)",
        split_transposed=False,
        merge_transposed=False,
    ),
]
CAUSAL_MISTAKES = [
    Mistake(
        "causal-diagonal",
        "causal",
        "the causal mask hides the diagonal: query i may attend "
        "keys j < i, so it never sees itself (and query 0 sees nothing); the rule is j <= i "
        "(torch.tril(ones(L, L)) keeps the diagonal; triu(..., diagonal=1) is what to block)",
        rule="j<i",
    ),
    Mistake(
        "causal-ignored",
        "causal",
        "the causal option is accepted but has no effect: every query attends every key, the "
        "future included; mask keys j > i (scores.masked_fill(triu(ones(L, L), 1), -inf))",
        rule="all",
    ),
    Mistake(
        "causal-flipped",
        "causal",
        "the causal mask is flipped: query i attends keys j >= i, the "
        "future, and not the past; keep j <= i (lower triangle, tril)",
        rule="j>=i",
    ),
    Mistake(
        "causal-flipped-strict",
        "causal",
        "the causal mask is flipped and hides the diagonal: "
        "query i attends only keys j > i; keep j <= i (lower triangle, tril)",
        rule="j>i",
    ),
]
FILL_MISTAKES = [
    Mistake(
        "fill-tiny",
        "",
        "masked scores are filled with a tiny number (like 1e-20) instead of "
        "-inf: a score of about 0 is an ordinary score, so masked keys keep weight "
        "exp(0)/Σ like any other; fill with float('-inf') (and make a row with no key give 0)",
        fill=MASKED_TINY,
    ),
    Mistake(
        "fill-positive",
        "",
        "masked scores are filled with a large positive number instead of "
        "-inf: the masked keys then take nearly all the weight; fill with float('-inf')",
        fill=MASKED_POSITIVE,
    ),
]
PADDING_QUERIES = Mistake(
    "padding-queries",
    "padding",
    "the padding mask is broadcast over the queries (rows) instead "
    "of the keys (columns): a (B, L) mask must become (B, 1, 1, L) (mask[:, None, None, :]) so "
    "that every query ignores the padded keys; as (B, 1, L, 1) it blanks the padded queries and "
    "lets real queries attend padding",
    padding_axis="queries",
)


MASK_MISTAKES = ("fill-tiny", "fill-positive", "padding-queries")


@dataclass(frozen=True)
class Finding:
    """The mistake that reproduces the output, with the heads that fit and how close it is."""

    mistake: Mistake
    heads: int
    error: float
    numbers: dict[str, int]

    def explain(self) -> str:
        return self.mistake.text.format(**self.numbers)


def candidates(setting: Setting, per_head: bool) -> list[Mistake]:
    """The right computation first, then each mistake that this setting can show."""
    found = [RIGHT, *MISTAKES]
    if per_head:  # a function is given q, k, v per head: it never splits or merges heads
        found = [m for m in found if m.split_transposed and m.merge_transposed]
    if setting.causal:
        found += CAUSAL_MISTAKES
    masked = "causal" if setting.causal else ("padding" if setting.keep is not None else "")
    if masked:
        found += [replace(m, check=masked) for m in FILL_MISTAKES]
    if setting.keep is not None:
        found.append(PADDING_QUERIES)
    return found


def _heads(x: torch.Tensor, heads: int, transposed: bool) -> torch.Tensor:
    batch, length, features = x.shape
    if transposed:  # (B, L, E) -> (B, H, L, D)
        return x.view(batch, length, heads, features // heads).transpose(1, 2)
    return x.reshape(batch, heads, length, features // heads)


def _allowed(setting: Setting, mistake: Mistake, length: int) -> torch.Tensor | None:
    """(B or 1, 1, L, L) bool: may query i attend key j under this (possibly wrong) rule."""
    allowed = None
    if setting.causal:
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        rules = {"j<=i": j <= i, "j<i": j < i, "j>=i": j >= i, "j>i": j > i, "all": j >= 0}
        allowed = rules[mistake.rule][None, None]
    if setting.keep is not None:
        keep = setting.keep
        rows = keep[:, None, None, :] if mistake.padding_axis == "keys" else None
        if rows is not None:
            allowed = rows if allowed is None else allowed & rows
    return allowed


def predict(cap: Capture, heads: int, setting: Setting, mistake: Mistake) -> torch.Tensor:
    """What an implementation with ``mistake`` outputs from these Q, K, V: (B, L, Ev)."""
    numbers = _numbers(cap, heads, setting)
    kv_heads = numbers["Hkv"]
    q = _heads(cap.q, heads, mistake.split_transposed)  # (B, H, L, D)
    k = _heads(cap.k, kv_heads, mistake.split_transposed)  # (B, Hkv, L, D)
    v = _heads(cap.v, kv_heads, mistake.split_transposed)  # (B, Hkv, L, Dv)
    if kv_heads != heads:  # grouped-query: key/value head j serves query heads j*g … j*g+g-1
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scale = SCALES[mistake.scale][0](numbers["D"], numbers["E"], numbers["Dv"], numbers["d_in"])
    allowed = _allowed(setting, mistake, q.shape[-2])
    plain = not mistake.scale_after_softmax and mistake.softmax_dim == -1
    if plain and mistake.fill == -math.inf:  # the contract's computation: qkv's reference
        out = attention(q, k, v, mask=allowed, scale=scale, backend="reference")
    else:  # the textbook formula with this mistake in it
        scores = q @ k.transpose(-2, -1) * (1.0 if mistake.scale_after_softmax else scale)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, mistake.fill)
        weights = torch.softmax(scores, dim=mistake.softmax_dim)
        if mistake.scale_after_softmax:
            weights = weights * scale
        out = weights @ v
    batch, _, length, _ = out.shape
    if mistake.merge_transposed:
        merged = out.transpose(1, 2).reshape(batch, length, -1)
    else:
        merged = out.reshape(batch, length, -1)
    return cap.finish(merged)


def _numbers(cap: Capture, heads: int, setting: Setting) -> dict[str, int]:
    width = cap.q.shape[-1]
    size = width // heads
    kv_heads = cap.k.shape[-1] // size  # fewer than heads: grouped-query attention
    return {
        "H": heads,
        "Hkv": kv_heads,
        "E": width,
        "D": size,
        "Dv": cap.v.shape[-1] // kv_heads,
        "d_in": setting.d_in or width,
    }


def _fits(cap: Capture, heads: int) -> bool:
    """Whether Q, K, V split into ``heads`` query heads (and a divisor of them for K, V)."""
    width, k_width, v_width = cap.q.shape[-1], cap.k.shape[-1], cap.v.shape[-1]
    if width % heads or k_width % (width // heads):
        return False
    kv_heads = k_width // (width // heads)
    return kv_heads > 0 and heads % kv_heads == 0 and v_width % kv_heads == 0


def rows_to_compare(setting: Setting, cap: Capture) -> torch.Tensor:
    """(B, L) bool: the queries whose output the contract fixes (padded queries are free)."""
    rows = torch.ones(cap.observed.shape[:2], dtype=torch.bool)
    return rows if setting.keep is None else rows & setting.keep


def error(cap: Capture, predicted: torch.Tensor, rows: torch.Tensor) -> float:
    """Largest difference over the compared rows (inf if the shapes differ or NaN appears)."""
    if predicted.shape != cap.observed.shape:
        return math.inf
    return difference(predicted[rows], cap.observed[rows])


def head_counts(cap: Capture, known: int | None) -> list[list[int]]:
    """The head counts to try, in rounds: the known count first (when it fits), then every
    other count that splits the widths (1 first) — a count read from an attribute can be wrong."""
    every = [h for h in range(1, cap.q.shape[-1] + 1) if _fits(cap, h)]
    if known is None or known not in every:
        return [every]
    return [[known], [h for h in every if h != known]]


def diagnose(
    cap: Capture, setting: Setting, known_heads: int | None, mistakes: Iterable[Mistake] = ()
) -> Finding | None:
    """The first candidate (the right computation first) that reproduces the output."""
    rows = rows_to_compare(setting, cap)
    limit = tolerance(cap.observed)
    chosen = list(mistakes) or candidates(setting, cap.per_head)
    for counts in head_counts(cap, known_heads):
        for mistake in chosen:
            for heads in counts:
                miss = error(cap, predict(cap, heads, setting, mistake), rows)
                if miss <= limit:
                    return Finding(mistake, heads, miss, _numbers(cap, heads, setting))
    return None


def right_error(cap: Capture, setting: Setting, heads: int) -> float:
    return error(cap, predict(cap, heads, setting, RIGHT), rows_to_compare(setting, cap))


def fit_scale(cap: Capture, setting: Setting, heads: int) -> tuple[float, float]:
    """The one scale s for which softmax(QKᵀ·s)V comes closest (golden-section search on log s),
    and how close; for outputs that no named scale explains."""
    rows = rows_to_compare(setting, cap)
    width = cap.q.shape[-1] // heads

    def miss(log_scale: float) -> float:
        trial = replace(RIGHT, scale="head")
        factor = math.exp(log_scale) * math.sqrt(width)  # head scale times this = s
        predicted = predict(replace(cap, q=cap.q * factor), heads, setting, trial)
        return error(cap, predicted, rows)

    low, high = math.log(1e-4), math.log(1e2)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if miss(a) < miss(b):
            high = b
        else:
            low = a
    best = (low + high) / 2
    return math.exp(best), miss(best)
