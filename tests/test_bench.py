"""``qkv bench``: runs end to end on tiny sizes, counts work correctly, records what it measured.

Nothing here checks a speed: timings are the benchmark's output, not a test.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from qkv import bench, cli


def test_a_small_run_writes_the_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--lengths", "16,32", "--dtypes", "float32,bfloat16", "--heads", "2"]
    argv += ["--dim", "8", "--repeats", "2", "--backends", "flash,reference"]
    argv += ["--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    table = capsys.readouterr().out
    assert "vs torch" in table and "GFLOP/s" in table and "% mm" in table
    report = json.loads(out_json.read_text())
    assert set(report["matmul_gflops"]) == {"float32", "bfloat16"}
    results = report["results"]
    # 2 levels x 2 passes x 2 dtypes x 2 causal x 2 lengths, each for torch, flash, reference
    assert len(results) == 2 * 2 * 2 * 2 * 2 * 3
    for result in results:
        assert len(result["all_ms"]) == 2 and result["median_ms"] > 0
        assert result["gflops"] > 0 and result["percent_of_matmul"] > 0
        if result["implementation"] == "torch":
            assert result["vs_torch"] == 1.0
        if sys.platform == "linux":
            assert result["memory_mib"] is not None and result["memory_mib"] >= 0
    assert {r["level"] for r in results} == {"functional", "module"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reference_too_long_for_memory_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--lengths", "64", "--dtypes", "float32", "--passes", "forward"]
    argv += ["--levels", "functional", "--causal", "no", "--backends", "reference,flash"]
    argv += ["--reference-max-length", "32", "--repeats", "1", "--no-memory", "--heads", "1"]
    assert cli.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " 64 " in line]
    assert len(rows) == 3
    assert "skipped: T > --reference-max-length 32" in next(r for r in rows if "reference" in r)


def test_bad_choices_are_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtypes", "float64"])
    assert "float32,bfloat16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--lengths", "0"])


@pytest.mark.parametrize("causal, pairs", [(False, 16), (True, 10)])
def test_flops_count_the_pairs_that_may_attend(causal: bool, pairs: int) -> None:
    shape = bench.Shape(batch=2, heads=3, dim=5)
    forward = bench.Case("functional", "forward", "float32", causal, 4)
    assert shape.flops(forward) == 4 * 2 * 3 * pairs * 5  # Q Kᵀ and P V, 2 flops per multiply-add
    both = bench.Case("functional", "forward+backward", "float32", causal, 4)
    assert shape.flops(both) == 3.5 * shape.flops(forward)
    module = bench.Case("module", "forward", "float32", causal, 4)
    projections = 4 * 2 * 2 * 4 * 15**2  # q, k, v and out: (B·T, E) @ (E, E), E = 15
    assert shape.flops(module) == shape.flops(forward) + projections


def test_decoding_with_a_cache_gives_the_outputs_of_recomputing() -> None:
    result = bench.decode_benchmark(tokens=12, repeats=2)
    assert result["kv_cache_seconds"] > 0 and result["recompute_seconds"] > 0
    assert len(result["kv_cache_seconds_all"]) == len(result["recompute_seconds_all"]) == 2
    assert result["max_abs_difference"] < 1e-5
    assert result["max_abs_difference_vs_one_pass"] < 1e-5


@pytest.mark.skipif(sys.platform != "linux", reason="peak memory is read from Linux's rusage")
def test_memory_check_runs_in_a_fresh_process() -> None:
    check = bench.memory_check(512, bench.Shape(batch=1, heads=2, dim=8), threads=1)
    assert check["length"] == 512 and check["backend"] == "flash"
    assert check["peak_process_mib"] >= check["baseline_process_mib"] > 0
    assert math.isclose(check["naive_scores_mib"], 2 * 512 * 512 * 4 / 2**20)
