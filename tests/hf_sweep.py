"""Every model family transformers declares, on attn_implementation="qkv" against "eager".

``sweep(model_type)`` builds the family's tiny random float32 model (``hf_tiny``) twice with the
same weights, once on "eager" and once on "qkv", runs the checks below on text and classifies the
family into one outcome:

- ``equal``: qkv equals eager (``hf_checks.ATOL``) in every check that applies.
- ``upstream``: qkv differs from eager only in checks where "sdpa" differs from eager too: a bug
  of the family's own code, shown without qkv (sdpa returns no weights: weights on the padded
  batch whose outputs differ on sdpa too count with them).
- ``refused``: qkv refuses the family with a ValueError naming the model, the reason and the
  alternative: at load, or when a layer passes what qkv cannot apply (then every error is one).
- ``not on qkv``: the model runs but never calls qkv (no attention layer: a state-space model).
- ``not text``: no text input (no ``input_ids``, or eager needs an image or a sound beside them).
- ``cannot build``: no tiny model could be made, or eager fails on its text.
- ``differs`` (qkv wrong) and ``error`` (qkv raises where eager does not): failures.

The checks are ``hf_checks.CHECKS``; a check that eager itself cannot run does not apply.

    python tests/hf_sweep.py [model types] [--jobs N] [--json FILE]

prints the table of outcomes: counts, then a line per family (failures first) with one mark
per check, and a line per check that did not simply pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from hf_checks import (
    CHECKS,
    NotApplicable,
    Setup,
    TextFails,
    difference,
    documents_alone,
    short,
    without_sink_share,
)

from qkv import observers
from qkv.integrations import huggingface

PASSING = ("equal", "upstream", "refused", "not on qkv", "not text")
FAILURES = ("differs", "error")
OUTCOMES = (*PASSING, "cannot build", *FAILURES)
MARKS = {"equal": "=", "differs": "x", "error": "!", "upstream": "u", "n/a": "-"}
TASKS = {  # kind of model: its auto mapping (the first whose class takes input_ids is swept)
    "seq2seq LM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal LM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image-text LM": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "base model": "MODEL_MAPPING_NAMES",
}
NOT_TEXT = (  # inputs beside the text that a family may need
    "pixel_values",
    "pixel_values_videos",
    "image_embeds",
    "input_values",
    "input_features",
    "bbox",
    "visual_feats",
    "state",
)


@dataclasses.dataclass
class Check:
    """One check's result: ``status`` is "equal", "differs", "error", "upstream" or "n/a"."""

    name: str
    status: str
    difference: float = 0.0
    detail: str = ""


@dataclasses.dataclass
class Result:
    """A family's outcome (one of ``OUTCOMES``), why, and each check's result."""

    model_type: str
    outcome: str
    detail: str = ""
    checks: list[Check] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def marks(self) -> str:
        """One mark per check in ``CHECKS`` order (``MARKS``), or "" without checks."""
        return "".join(MARKS[check.status] for check in self.checks)

    def report(self) -> str:
        """One line for the family (with the largest difference of its equal checks), then one
        per check that did not simply pass."""
        marks = f" [{self.marks()}]" if self.checks else ""
        equal = [check.difference for check in self.checks if check.status == "equal"]
        largest = f", max |Δ| {max(equal):.1e}" if equal else ""
        lines = [
            f"{self.model_type}: {self.outcome}{marks} {self.detail} "
            f"({self.seconds:.1f} s{largest})"
        ]
        for check in self.checks:
            if check.status not in ("equal", "n/a"):
                lines.append(
                    f"    {check.name}: {check.status} {check.difference:.3g} {check.detail}"
                )
        return "\n".join(lines)


def family_names() -> list[str]:
    """Every model type of transformers' base, causal-LM and seq2seq-LM auto mappings."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for mapping in ("MODEL_MAPPING_NAMES", TASKS["causal LM"], TASKS["seq2seq LM"]):
        names |= set(getattr(modeling_auto, mapping))
    return sorted(names)


def task_of(model_type: str) -> tuple[str, Any]:
    """(task, model class) of the first mapping whose class takes ``input_ids``, or ("", why
    not) for a family without text input. Raises ImportError for a class that cannot load."""
    from transformers.models.auto import modeling_auto

    found = ""
    for task, mapping in TASKS.items():
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, tuple | list):  # (several classes: the first is the family's own)
            name = name[0]
        if not name:
            continue
        found, model_class = name, _model_class(model_type, name)
        if "input_ids" in inspect.signature(model_class.forward).parameters:
            return task, model_class
    return "", f"{found}.forward takes no input_ids"


def _model_class(model_type: str, name: str) -> Any:
    """transformers' class ``name``, from its top level or else from the family's module."""
    import importlib

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        return getattr(transformers, name)
    except AttributeError:
        module = f"transformers.models.{model_type_to_module_name(model_type)}"
        try:
            return getattr(importlib.import_module(module), name)
        except (AttributeError, ModuleNotFoundError) as error:
            raise ImportError(f"{name} is not in transformers: {short(error)}") from error


def _seeded(check: Callable[[Setup, Any], dict[str, Any]], setup: Setup, model: Any) -> Any:
    """``check`` on ``model`` from one random state: some models draw noise in their forward
    (diffusion_gemma's canvas)."""
    torch.manual_seed(0)
    return check(setup, model)


def run_check(name: str, setup: Setup, model: Any, expected: dict[str, Any]) -> Check:
    """One check of ``model`` against eager's ``expected`` outputs."""
    try:
        got = _seeded(CHECKS[name], setup, model)
    except Exception as error:
        return Check(name, "error", float("inf"), short(error))
    close, gap, where = difference(got, expected)
    if not close and name == "weights":
        close_apart, gap_apart, _ = difference(without_sink_share(got), expected)
        if close_apart:
            return Check(name, "equal", gap_apart, "eager's weights leave the sink's share out")
    return Check(name, "equal" if close else "differs", gap, where)


def _compare_with_sdpa(
    result: Check, setup: Setup, sdpa: Any, expected: dict[str, Any], earlier: list[Check]
) -> None:
    """A qkv check that failed, run on sdpa too: "upstream" where sdpa differs as well. sdpa
    returns no weights: weights of a left-padded batch whose outputs already differ on sdpa too
    are upstream with them."""
    other = run_check(result.name, setup, sdpa, expected)
    if other.status == "differs" and result.status == "differs":
        result.status = "upstream"
    elif (
        result.name == "weights"
        and result.status == "differs"
        and any(check.name == "left padding" and check.status == "upstream" for check in earlier)
    ):
        result.status = "upstream"
        result.detail += "; the left-padded outputs differ on sdpa too"
        return
    if other.status != "equal":
        result.detail += f"; sdpa {other.status} too: {other.difference:.3g} {other.detail}"


def check_family(setup: Setup, ours: Any) -> tuple[list[Check], int]:
    """Every check on qkv, and how many attention calls qkv made in them. Where qkv fails a
    check, the same check on sdpa tells an upstream bug."""
    results, sdpa, counter = [], None, _Counter()
    for name, check in CHECKS.items():
        try:
            expected = _seeded(check, setup, setup.eager)
        except Exception as error:
            reason = str(error) if isinstance(error, NotApplicable) else "eager: " + short(error)
            results.append(Check(name, "n/a", detail=reason))
            continue
        token = observers.activate(counter)
        try:
            result = run_check(name, setup, ours, expected)
        finally:
            observers.deactivate(token)
        if result.status != "equal":
            try:
                sdpa = sdpa or setup.load("sdpa", setup.state)
                _compare_with_sdpa(result, setup, sdpa, expected, results)
            except Exception as error:
                result.detail += f" (no sdpa to compare: {short(error, 120)})"
        elif name == "packed":
            apart = difference(documents_alone(setup, setup.eager), expected)[0]
            result.detail = "documents kept apart" if apart else "read as one sequence"
        results.append(result)
    return results, counter.calls


class _Counter:
    """An observer of qkv's attention calls (``qkv.observers``) that counts them."""

    calls = 0

    def record(self, call: Any, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        self.calls += 1


def _setup(model_type: str, task: str, model_class: Any) -> Setup:
    """The family's setup with grouped-query heads, else, for a family that allows none (multi-
    head latent attention), with as many key/value heads as query heads."""
    try:
        return Setup(model_type, task, model_class, grouped=True)
    except Exception as grouped:
        try:
            return Setup(model_type, task, model_class, grouped=False)
        except Exception:  # (the usual set-up's error tells more than the fallback's)
            raise grouped from grouped.__cause__


def _other_input(error: BaseException) -> str | None:
    """The input beside the text (``NOT_TEXT``) that ``error`` shows missing: named in its
    message, or None where it was raised (a vision tower given no image)."""
    cause = error.__cause__ or error
    frames = [frame for frame, _ in traceback.walk_tb(cause.__traceback__)][-3:]
    message = str(cause).lower()
    for name in NOT_TEXT:
        # (a bare word only where it cannot be an ordinary one: "state" can)
        spelled = ("_" in name or name == "bbox") and re.search(rf"\b{name}\b", message)
        named = f"'{name}'" in message or spelled
        if named or any(frame.f_locals.get(name, 0) is None for frame in frames):
            return name
    return None


def sweep(model_type: str) -> Result:
    """The family's outcome on qkv (see the module's docstring)."""
    start = time.perf_counter()
    result = _sweep(model_type)
    result.seconds = time.perf_counter() - start
    return result


def _sweep(model_type: str) -> Result:
    name = huggingface.register()
    try:
        task, model_class = task_of(model_type)
    except ImportError as error:
        return Result(model_type, "cannot build", short(error))
    if not task:
        return Result(model_type, "not text", model_class)
    model_name = model_class.__name__
    try:
        setup = _setup(model_type, task, model_class)
    except TextFails as error:
        needs = _other_input(error)
        if needs:
            return Result(model_type, "not text", f"{model_name} needs {needs}: {error}")
        return Result(model_type, "cannot build", f"{model_name} fails on text on eager: {error}")
    except Exception as error:
        return Result(model_type, "cannot build", f"{model_name}: {short(error)}")
    model = f"{task} {type(setup.eager).__name__}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = setup.load(name, setup.state)
        model += "".join(f"; {w.message}" for w in caught if 'run on "eager"' in str(w.message))
    except ValueError as error:
        named = type(setup.eager).__name__ in str(error) and f'"{model_type}"' in str(error)
        return Result(model_type, "refused" if named else "error", short(error, 600))
    except Exception as error:
        return Result(model_type, "error", f"{model}: at load: {short(error)}")
    checks, calls = check_family(setup, ours)
    statuses = {check.status for check in checks}
    refusals = [check.detail for check in checks if check.status == "error" and _refusal(check)]
    if refusals and len(refusals) == sum(check.status == "error" for check in checks):
        return Result(model_type, "refused", f"{model}: at call: {refusals[0]}", checks)
    for status in FAILURES:
        if status in statuses:
            return Result(model_type, status, model, checks)
    if calls == 0:
        return Result(model_type, "not on qkv", f"{model}: qkv.attention is never called", checks)
    return Result(model_type, "upstream" if "upstream" in statuses else "equal", model, checks)


def _refusal(check: Check) -> bool:
    """Whether a check's error is qkv refusing the model, by name, with the alternative."""
    return check.detail.startswith("ValueError") and 'attn_implementation="eager"' in check.detail


def quiet() -> None:
    """transformers' warnings and logs off, one thread (the models are tiny)."""
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)


def _sweep_quietly(model_type: str) -> Result:
    """``sweep`` without transformers' warnings; a crash of the sweep itself becomes the
    family's error rather than the end of the table."""
    quiet()
    try:
        return sweep(model_type)
    except Exception as error:
        return Result(model_type, "error", "the sweep itself failed: " + short(error))


def table(results: list[Result], wall: float) -> str:
    """Counts per outcome, then one line per family, failures first. Marks: one per check of
    ``CHECKS`` in order, ``MARKS``."""
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    seconds = [r.seconds for r in results]
    lines = [
        f"{len(results)} families in {wall:.0f} s (median {statistics.median(seconds):.2f} s, "
        f"max {max(seconds):.1f} s per family)",
        ", ".join(f"{o}: {n}" for o, n in counts.items()),
        "checks: " + ", ".join(CHECKS) + "; " + ", ".join(f"{m} {s}" for s, m in MARKS.items()),
        "",
    ]
    for outcome in (*FAILURES, "cannot build", "upstream", "refused", "not on qkv", "not text"):
        lines += [r.report() for r in results if r.outcome == outcome]
    lines += [r.report() for r in results if r.outcome == "equal"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python tests/hf_sweep.py [model types] [--jobs N] [--json FILE]``: the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every family)")
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--json", help="also write every result to this file")
    arguments = parser.parse_args(argv)
    names = arguments.families or family_names()
    start = time.perf_counter()
    if arguments.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(arguments.jobs, maxtasksperchild=20) as pool:
            results = pool.map(_sweep_quietly, names, chunksize=1)
    else:
        results = [_sweep_quietly(name) for name in names]
    print(table(results, time.perf_counter() - start))
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump([dataclasses.asdict(result) for result in results], file, indent=1)


if __name__ == "__main__":
    main()
