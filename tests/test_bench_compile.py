"""``qkv bench --compile`` on a tiny model: its rows, graph breaks, failures, and that every
attention computes the same model (equal first losses). Nothing here checks a speed.

The compiler here is torch.compile's "aot_eager" backend: dynamo and AOTAutograd trace forward
and backward as with inductor, without generating code, so that the test stays fast.
"""

from __future__ import annotations

import argparse
import math

import torch

from qkv.bench import command, report
from qkv.bench import compile as compiled

TINY = compiled.ModelShape(layers=1, d_model=32, heads=2, vocab=64, length=16, batch=1)
# the first losses of different attentions and modes: float32 sums of a few hundred terms
LOSS_TOLERANCE = 64 * torch.finfo(torch.float32).eps


def breaking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sdpa with a graph break before it: fullgraph=True cannot compile it."""
    torch._dynamo.graph_break()
    return compiled.sdpa_causal(q, k, v)


def failing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this attention always fails\nsecond line")


def test_every_attention_gives_the_first_loss_of_sdpa_eager_and_compiled() -> None:
    attentions = {**compiled.ATTENTIONS, "breaking": breaking, "failing": failing}
    result = compiled.compile_benchmark(TINY, 1, attentions=attentions, compiler="aot_eager")
    assert result["model"]["layers"] == 1 and result["repeats"] == 1
    rows = {(row["mode"], row["attention"]): row for row in result["rows"]}
    assert set(rows) == {(mode, name) for mode in compiled.MODES for name in attentions}

    for mode in compiled.MODES:
        failed = rows[mode, "failing"]
        assert failed["failed"] == "RuntimeError: this attention always fails"
        assert failed["seconds"] == [] and math.isnan(failed["median_ms"])
    baseline = rows["eager", compiled.SDPA]["first_loss"]
    assert math.isclose(baseline, math.log(TINY.vocab), rel_tol=0.2)  # random weights: ~log V
    for (mode, name), row in rows.items():
        if name == "failing":
            continue
        assert row["failed"] is None, (mode, name, row["failed"])
        assert math.isclose(row["first_loss"], baseline, rel_tol=LOSS_TOLERANCE), (mode, name)
        assert len(row["seconds"]) == 1 and row["median_ms"] > 0
        assert row["first_steps_seconds"] > 0 and row["vs_sdpa"] > 0
        if mode == "eager":
            assert row["fullgraph"] is None and row["graph_breaks"] is None
        else:  # compiled afresh, not running code compiled for another row
            assert row["graphs"] >= 1, name

    for name in compiled.ATTENTIONS:  # sdpa and qkv (its operator, or its loop) compile whole
        assert rows["compiled", name]["fullgraph"] == "ok", name
        assert rows["compiled", name]["graph_breaks"] == 0, name
    broken = rows["compiled", "breaking"]
    assert broken["fullgraph"].startswith("Unsupported: ")
    assert broken["graph_breaks"] >= 1 and broken["graphs"] >= 2

    table = compiled.format_compile(result, report.machine())
    assert "qkv/sdpa" in table and "1 layers, d_model 32" in table
    assert "failing    failed: RuntimeError: this attention always fails" in table


def test_compile_takes_an_optional_length() -> None:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    assert parser.parse_args([]).compile is None
    assert parser.parse_args(["--compile"]).compile == 1024
    assert parser.parse_args(["--compile", "256"]).compile == 256
