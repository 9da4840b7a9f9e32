"""``qkv bench``: runs end to end on tiny sizes, counts work correctly, records what it measured.

Nothing here checks a speed: timings are the benchmark's output, not a test.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from qkv import cli
from qkv.backends.flash import kernel
from qkv.bench import arguments, auto, cases, decode, isa, memory, report, runs, timing, wall


def test_a_small_run_writes_the_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    out_json.write_text(json.dumps({"decode": {"speedup": 12.0}}))  # another benchmark's entry
    argv = ["bench", "--lengths", "16,32", "--dtypes", "float32,bfloat16", "--heads", "2"]
    argv += ["--dim", "8", "--repeats", "2", "--backends", "flash,reference"]
    argv += ["--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    captured = capsys.readouterr()
    assert "vs torch" in captured.out and "GFLOP/s" in captured.out and "% mm" in captured.out
    report = json.loads(out_json.read_text())
    assert report["decode"] == {"speedup": 12.0}  # kept
    assert set(report["matmul_gflops"]) == {"float32", "bfloat16"}
    assert report["machine"]["processor"]
    results = report["results"]
    # 2 levels x 2 passes x 2 dtypes x 2 causal x 2 lengths, each for torch, flash, reference
    count = 2 * 2 * 2 * 2 * 2
    assert len(results) == count * 3
    for result in results:
        assert len(result["all_ms"]) == 2 and result["median_ms"] > 0
        assert result["gflops"] > 0 and result["percent_of_matmul"] > 0
        if result["implementation"] == "torch":
            assert result["vs_torch"] == 1.0
        if sys.platform == "linux":
            assert result["memory_mib"] is not None and result["memory_mib"] >= 0
    assert {r["level"] for r in results} == {"functional", "module"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one progress line per case on stderr, with each implementation's time and ratio
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(progress) == count
    assert progress[0].startswith(f"[1/{count}] functional forward float32 full T=16: torch ")
    assert all("flash" in line and "x)" in line and "reference" in line for line in progress)


def test_another_benchmarks_entry_names_its_own_machine_and_keeps_the_tables(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bench.json"
    table = {"machine": {"processor": "A"}, "shape": {"batch": 1}, "build": {"isa": "native"}}
    path.write_text(json.dumps({**table, "results": [1], "auto": [2]}))
    run = {"machine": {"processor": "B"}, "shape": {"batch": 2}, "build": {"isa": "avx2"}}
    report.write_json(str(path), {**run, "paged": {"speedup": 1.5}, "arguments": [3]})
    written = json.loads(path.read_text())
    assert {name: written[name] for name in table} == table  # the main table's machine
    assert written["results"] == [1] and written["auto"] == [2] and written["arguments"] == [3]
    assert written["paged"] == {
        "speedup": 1.5,
        "machine": {"processor": "B"},
        "build": {"isa": "avx2"},
    }
    fresh = tmp_path / "fresh.json"  # a new file: the run's machine is the file's
    report.write_json(str(fresh), {**run, "paged": {"speedup": 1.5}})
    assert json.loads(fresh.read_text())["machine"] == {"processor": "B"}


@pytest.mark.parametrize(
    ("option", "module", "extra"),
    [
        (["--plot", "out.png"], "matplotlib", "explain"),
        (["--continuous", "2"], "transformers", "hf"),
    ],
)
def test_an_option_without_its_optional_dependency_stops_before_measuring(
    option: list[str],
    module: str,
    extra: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before the dependency was checked")

    monkeypatch.setattr(runs, "measure", measured)
    monkeypatch.setattr(timing, "matmul_rate", measured)
    assert cli.main(["bench", "--lengths", "16", *option]) == 2
    err = capsys.readouterr().err
    assert f"{option[0]} needs {module}" in err and f'pip install "qkv[{extra}]"' in err


def test_progress_lines_are_flushed_as_they_are_written(capfd: pytest.CaptureFixture[str]) -> None:
    timing.progress("case 1: torch 1.00 ms")
    assert capfd.readouterr().err == "case 1: torch 1.00 ms\n"


def test_a_reference_too_long_for_memory_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--lengths", "64", "--dtypes", "float32", "--passes", "forward"]
    argv += ["--levels", "functional", "--causal", "no", "--backends", "reference,flash"]
    argv += ["--reference-max-length", "32", "--repeats", "1", "--no-memory", "--heads", "1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if " 64 " in line]
    assert len(rows) == 3
    assert "skipped: T > --reference-max-length 32" in next(r for r in rows if "reference" in r)
    assert "reference skipped" in captured.err


def test_bad_choices_are_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtypes", "float64"])
    assert "float32,bfloat16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--lengths", "0"])


@pytest.mark.parametrize("causal, pairs", [(False, 16), (True, 10)])
def test_flops_count_the_pairs_that_may_attend(causal: bool, pairs: int) -> None:
    shape = cases.Shape(batch=2, heads=3, dim=5)
    forward = cases.Case("functional", "forward", "float32", causal, 4)
    assert shape.flops(forward) == 4 * 2 * 3 * pairs * 5  # Q Kᵀ and P V, 2 flops per multiply-add
    both = cases.Case("functional", "forward+backward", "float32", causal, 4)
    assert shape.flops(both) == 3.5 * shape.flops(forward)
    module = cases.Case("module", "forward", "float32", causal, 4)
    projections = 4 * 2 * 2 * 4 * 15**2  # q, k, v and out: (B·T, E) @ (E, E), E = 15
    assert shape.flops(module) == shape.flops(forward) + projections


class FakeMachine:
    """A clock that only the stand-in matrix product advances, at ``gflops`` GFLOP/s."""

    def __init__(self, gflops: float) -> None:
        self.gflops, self.now, self.sizes = gflops, 0.0, []

    def clock(self) -> float:
        return self.now

    def product(self, a: torch.Tensor, b: torch.Tensor) -> None:
        n = a.shape[0]
        self.sizes.append(n)
        self.now += 2 * n**3 / (self.gflops * 1e9)


@pytest.mark.parametrize("gflops", [0.3, 5.0, 2000.0])
def test_the_matmul_probe_stays_within_its_time_budget(gflops: float) -> None:
    # 0.3 GFLOP/s: torch's bfloat16 product on a CPU without bfloat16 units, where a fixed
    # 2048³ probe took a minute per product.
    fake = FakeMachine(gflops)
    rate = timing.matmul_rate(
        torch.float32, budget_s=0.5, target_s=0.05, product=fake.product, clock=fake.clock
    )
    assert fake.now <= 0.5
    assert math.isclose(rate, gflops, rel_tol=1e-6)
    assert max(fake.sizes) <= 4096 and len(fake.sizes) >= 2


def test_the_whole_probe_shares_one_budget_among_the_dtypes() -> None:
    from qkv.bench.command import matmul_rates

    rates = matmul_rates(("float32", "bfloat16"), budget_s=0.2)
    assert set(rates) == {"float32", "bfloat16"} and all(r > 0 for r in rates.values())


def test_decoding_with_a_cache_gives_the_outputs_of_recomputing() -> None:
    result = decode.decode_benchmark(tokens=12, repeats=2)
    assert result["kv_cache_seconds"] > 0 and result["recompute_seconds"] > 0
    assert len(result["kv_cache_seconds_all"]) == len(result["recompute_seconds_all"]) == 2
    assert result["max_abs_difference"] < 1e-5
    assert result["max_abs_difference_vs_one_pass"] < 1e-5
    assert "x faster" in decode.format_decode(result)


def test_a_decoding_case_is_set_against_the_bandwidth_read_in_its_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = torch.ones(1 << 16)
    row = wall.decode_case(2, 40, (4, 2), 16, torch.float32, 3, probe)
    assert row["bandwidth_bytes_per_second"] > 0 and row["kv_bytes"] == 2 * 2 * 2 * 40 * 16 * 4
    assert all(row[f"{name}_seconds"] > 0 for name in ("contiguous", "paged", "sdpa"))
    assert row["max_abs_difference"] < 1e-5
    monkeypatch.setattr(wall, "SHAPES", ((2, 40),))
    monkeypatch.setattr(wall, "HEADS", ((4, 2),))
    monkeypatch.setattr(wall, "DIMS", (16,))
    monkeypatch.setattr(wall, "BANDWIDTH_BYTES", 1 << 18)
    result = wall.wall_benchmark(repeats=2)
    for case in result["cases"]:  # each case's share is of its own rounds' reading
        rate = case["kv_bytes"] / case["contiguous_seconds"]
        expected = 100 * rate / case["bandwidth_bytes_per_second"]
        assert math.isclose(case["percent_of_bandwidth"], expected)
    readings = sorted(case["bandwidth_bytes_per_second"] for case in result["cases"])
    assert math.isclose(result["bandwidth_bytes_per_second"], (readings[0] + readings[1]) / 2)
    assert set(result["lowest_percent_of_bandwidth"]) == {"float32", "bfloat16"}
    assert "bw GB/s" in wall.format_wall(result)


def test_the_auto_table_gives_each_backend_and_the_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    scenarios = {
        "tiny causal": auto.Scenario(1, 2, 2, 8, 8, causal=True),
        "tiny padded, grouped, backward": auto.Scenario(2, 4, 2, 8, 8, padding=0.5, backward=True),
    }
    rows = auto.auto_benchmark(repeats=2, scenarios=scenarios)
    assert [row["scenario"] for row in rows] == list(scenarios)
    for row in rows:
        assert set(row["ms"]) == set(auto.BACKENDS) and all(ms > 0 for ms in row["ms"].values())
        assert row["auto"] in auto.BACKENDS
        assert row["auto_vs_fastest"] >= 1.0
    table = auto.format_auto(rows)
    assert "auto/fastest" in table and "tiny padded, grouped, backward" in table
    assert len(capsys.readouterr().err.splitlines()) == len(scenarios)


def test_the_arguments_table_times_each_argument_against_the_plain_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "arguments.json"
    argv = ["bench", "--arguments", "64", "--heads", "2", "--dim", "8", "--repeats", "2"]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["arguments"]
    assert [(r["pass"], r["variant"]) for r in rows] == [
        (p, v) for p in cases.PASSES for v in arguments.VARIANTS
    ]
    for row in rows:
        assert row["ms"] > 0 and row["path"] in ("kernel", "loop")
        if row["variant"] == "causal":
            assert row["vs_causal"] == 1.0
    # the compiled kernel takes them all, where it is built (the loop otherwise)
    assert {r["path"] for r in rows} == {"kernel" if kernel.load() is not None else "loop"}
    captured = capsys.readouterr()
    assert "vs causal" in captured.out and "+ window=T/32" in captured.out
    assert len(captured.err.splitlines()) == len(cases.PASSES)


@pytest.mark.skipif(sys.platform != "linux", reason="peak memory is read from Linux's /proc")
def test_memory_check_runs_in_a_fresh_process() -> None:
    check = memory.memory_check(512, cases.Shape(batch=1, heads=2, dim=8), threads=1)
    assert check["length"] == 512 and check["backend"] == "flash"
    assert check["peak_process_mib"] >= check["baseline_process_mib"] > 0
    assert math.isclose(check["naive_scores_mib"], 2 * 512 * 512 * 4 / 2**20)
    packed = memory.memory_check(
        512, cases.Shape(batch=1, heads=2, dim=8), 1, "64 packed documents"
    )
    assert packed["variant"] == "64 packed documents" and packed["peak_process_mib"] > 0
    assert "causal, 64 packed documents" in memory.format_memory_check(packed)
    with pytest.raises(ValueError, match="variant must be one of"):
        memory.memory_check(512, cases.Shape(batch=1, heads=2, dim=8), 1, "dense")


@pytest.mark.skipif(sys.platform != "linux", reason="peak memory is read from Linux's /proc")
def test_a_workers_peak_is_its_own_not_its_parents() -> None:
    """Linux hands a process started from a larger one that one's peak as ru_maxrss: the worker
    reads its own (VmHWM), so a bench that holds much memory when it starts one does not show
    up in the figure."""
    ballast = torch.ones(3 * 2**26)  # 768 MiB resident here while the worker runs
    check = memory.memory_check(256, cases.Shape(batch=1, heads=1, dim=8), threads=1)
    assert check["baseline_process_mib"] <= check["peak_process_mib"]
    assert check["peak_process_mib"] < ballast.numel() * ballast.element_size() / 2**20
    del ballast


def test_an_isa_run_holds_torch_to_the_same_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # set by the user: kept
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    env = isa.environment("avx2")
    assert env["QKV_FLASH_ISA"] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and env["ONEDNN_MAX_CPU_ISA"] == "ALL"
    monkeypatch.setattr(kernel, "ISA", "native")
    assert isa.needs_fresh_process("avx2") and not isa.needs_fresh_process("native")
    assert not isa.needs_fresh_process(None)
    monkeypatch.setenv("QKV_BENCH_ISA", "avx2")  # in the fresh process
    assert not isa.needs_fresh_process("avx2")


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= kernel.cpu_flags() or not kernel.ENABLED,
    reason="needs an x86 CPU with AVX2 and the kernel switched on",
)
def test_an_avx2_run_names_its_build_first(capfd: pytest.CaptureFixture[str]) -> None:
    """The AVX2 build (built once and cached, as in test_kernel.py) measured in a fresh process,
    its first line naming the build; the JSON records it."""
    arguments = "--lengths 32 --dtypes float32 --passes forward --levels functional --causal no"
    code = cli.main(["bench", "--isa", "avx2", *arguments.split(), "--repeats", "1", "--no-memory"])
    assert code == 0
    first = capfd.readouterr().out.splitlines()[0]
    assert first.startswith("flash kernel: --isa avx2 (AVX2, 256-bit vectors)"), first
    assert "torch's CPU kernels: AVX2" in first


def test_the_build_line_says_when_there_is_no_kernel() -> None:
    line = isa.describe({"isa": "native", "built": False, "torch_capability": "AVX512"})
    assert "not built" in line and "torch's CPU kernels: AVX512" in line
