"""``qkv check --examples``: the checker on each tutorial's implementation, re-typed in
``examples/tutorials``, with what each tutorial gets wrong found and the correct ones passing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.checker.report import Report
from qkv.checker.run import check, load
from qkv.checker.target import CheckError

FOLDER = Path(__file__).resolve().parents[3] / "examples" / "tutorials"


@dataclass(frozen=True)
class Example:
    """One implementation, the checks it must fail (none: it is correct) and why."""

    file: str
    name: str
    fails: frozenset[str]
    defect: str
    flash: bool = False  # graded by qkv check --flash


EXAMPLES = (
    Example("tutorial_000_single_head.py", "SingleHeadAttention", frozenset(), "none"),
    Example(
        "tutorial_001_the_cat_sat.py",
        "attend",
        frozenset({"fully-masked"}),
        "mask True = blocked (detected); a row with no key gives NaN",
    ),
    Example(
        "tutorial_001_the_cat_sat.py",
        "MultiHeadAttention",
        frozenset({"fully-masked"}),
        "mask True = blocked (detected); a row with no key gives NaN",
    ),
    Example("tutorial_002_causal.py", "CausalSelfAttention", frozenset(), "none"),
    Example("tutorial_003_three_levels.py", "SelfAttentionV1", frozenset(), "none"),
    Example("tutorial_003_three_levels.py", "SelfAttentionV2", frozenset(), "none"),
    Example(
        "tutorial_003_three_levels.py",
        "SelfAttentionV3",
        frozenset({"padding"}),
        "masked scores filled with 1e-20",
    ),
    Example(
        "tutorial_004_single_token.py",
        "SelfAttention",
        frozenset({"oracle", "scale"}),
        "scaled by 1/√d_in, not 1/√d_k",
    ),
    Example("corrected.py", "attend", frozenset(), "none (001 corrected)"),
    Example("corrected.py", "SelfAttentionV3", frozenset(), "none (003 corrected)"),
    Example("corrected.py", "SelfAttention", frozenset(), "none (004 corrected)"),
    Example("flash_attention.py", "FlashAttention", frozenset(), "none", flash=True),
    Example(
        "flash_attention_no_rescale.py",
        "FlashAttention",
        frozenset({"oracle", "lse", "backward"}),
        "the running sum is not rescaled when the maximum grows",
        flash=True,
    ),
)


def example(file: str, name: str) -> Example:
    """The example ``name`` of the tutorial file ``file``."""
    for found in EXAMPLES:
        if (found.file, found.name) == (file, name):
            return found
    raise KeyError(f"no example {file}:{name}")


def check_example(example: Example, folder: Path = FOLDER) -> Report:
    spec = f"{folder / example.file}:{example.name}"
    return check(load(spec), name=f"{example.file}:{example.name}", flash=example.flash)


def run_examples(console: Any, folder: Path = FOLDER) -> int:
    """Check every example; 0 when each fails exactly the checks its tutorial's defect fails."""
    if not folder.is_dir():
        message = f"no tutorials at {folder}: they ship with qkv's source checkout (examples/)"
        _say(console, f"error: {message}")
        return 2
    as_expected = 0
    for example in EXAMPLES:
        try:
            report = check_example(example, folder)
        except CheckError as error:
            _say(console, f"✗ {example.file}:{example.name} could not run: {error}")
            continue
        failed = set(report.failed)
        matched = failed == example.fails
        as_expected += matched
        verdict = "as expected" if matched else f"expected {sorted(example.fails) or 'none'}"
        found = ", ".join(sorted(failed)) or "every check passes"
        _say(console, f"{'✓' if matched else '✗'} {example.file}:{example.name}")
        _say(console, f"    tutorial's defect: {example.defect}; found: {found} ({verdict})")
        for result in report.checks:
            if result.status == "fail":
                _say(console, f"    {result.id}: {result.detail}")
    _say(console, f"\n{as_expected} of {len(EXAMPLES)} implementations graded as expected")
    return 0 if as_expected == len(EXAMPLES) else 1


def _say(console: Any, text: str) -> None:
    if console is None:
        print(text)
    else:
        from rich.markup import escape

        console.print(escape(text), soft_wrap=False)
