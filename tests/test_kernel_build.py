"""Building flash's compiled kernel (``backends/flash/build.py``) and ``qkv build``.

torch's extension builder leaves a ``lock`` file behind when a build is killed part-way, and
every later build then waits on it for ever. Here a real build is killed and the next call must
finish; a live builder is waited for a bounded time, saying for whom and where; a build says so
in one line and a cached load says nothing. Only the killed-build test compiles (a minute or two,
in a fresh ``TORCH_EXTENSIONS_DIR``); the others fake torch's builder or hold the lock alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils import cpp_extension

from qkv import cli
from qkv.backends.flash import build, kernel

SRC = Path(__file__).resolve().parents[1] / "src"

# A qkv builder that holds the build lock of the folder argv[1] until it is killed.
_HOLD_LOCK = """
import sys, time
from pathlib import Path
from qkv.backends.flash import build
with build.exclusive(Path(sys.argv[1]), timeout=10):
    print("holding", flush=True)
    time.sleep(600)
"""

# The first flash call on the CPU, which builds (or loads) the kernel; prints whether it is built.
_ATTEND = """
import torch, qkv
from qkv.backends.flash import kernel
q = torch.randn(1, 2, 32, 8)
qkv.attention(q, q, q, causal=True, backend="flash")
print(kernel.build_info()["built"])
"""


def _environment(**variables: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), **variables}


def _fake_builder(monkeypatch: pytest.MonkeyPatch, error: Exception | None = None) -> list[str]:
    """Replace torch's extension builder with one that writes the library at once (or raises
    ``error``); returns the names it was asked to build."""
    built: list[str] = []

    def load(name: str, build_directory: str, **_: object) -> ModuleType:
        if error is not None:
            raise error
        (Path(build_directory) / f"{name}{cpp_extension.LIB_EXT}").touch()
        built.append(name)
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", load)
    return built


def test_a_torch_lock_left_by_a_dead_builder_is_set_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "extension"
    folder.mkdir()
    (folder / "lock").touch()  # what torch's builder leaves when it is killed
    (folder / "flash_cpu.o").write_bytes(b"half an object file")
    with build.exclusive(folder, timeout=1.0):
        assert folder.is_dir() and not any(folder.iterdir())  # an empty folder to build in
    assert "stopped part-way" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["extension", "extension.lock"]


def test_a_live_builder_is_waited_for_a_bounded_time_naming_it_and_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "extension"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(folder)],
        env=_environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        (folder / "lock").touch()  # the live builder's torch lock: not to be taken over
        started = time.monotonic()
        refused = pytest.raises(build.BuildError, match=re.escape(str(folder)))
        with refused as raised, build.exclusive(folder, timeout=1.0):
            pytest.fail("took the lock that another live process holds")
        assert 1.0 <= time.monotonic() - started < 30
        assert f"process {holder.pid}" in str(raised.value) and "QKV_BUILD_TIMEOUT" in str(
            raised.value
        )
        waiting = capsys.readouterr().err
        assert f"waiting for process {holder.pid}" in waiting and str(folder) in waiting
        assert (folder / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    with build.exclusive(folder, timeout=0.0):  # its holder died: the lock is free at once
        assert not (folder / "lock").exists()


def test_a_build_says_so_in_one_line_and_a_cached_load_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = _fake_builder(monkeypatch)
    for _ in range(2):
        build.compile_extension("qkv_test", kernel.SOURCE, [], [], what="a test extension")
    assert built == ["qkv_test", "qkv_test"]  # torch's builder is asked both times
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"qkv: building a test extension in {tmp_path / 'qkv_test'}, once: this takes about a "
        "minute"
    ]


def test_a_failed_build_warns_naming_the_folder_and_flash_runs_its_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "_loaded", {})
    _fake_builder(monkeypatch, RuntimeError("Error building extension"))
    with pytest.warns(RuntimeWarning, match=re.escape(str(kernel.build_folder(kernel.ISA)))):
        assert kernel._build(kernel.ISA) is None


def test_an_unreadable_build_timeout_is_a_value_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QKV_BUILD_TIMEOUT", "ten minutes")
    with pytest.raises(ValueError, match=r"QKV_BUILD_TIMEOUT: expected .* got 'ten minutes'"):
        build.build_timeout()
    monkeypatch.setenv("QKV_BUILD_TIMEOUT", "1.5")
    assert build.build_timeout() == 1.5


def test_qkv_build_exits_with_1_and_the_reason_where_the_kernel_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "_loaded", {})
    monkeypatch.setattr(kernel, "ENABLED", True)
    _fake_builder(monkeypatch, RuntimeError("Error building extension"))
    assert cli.main(["build"]) == 1
    reason = capsys.readouterr().err
    assert "cannot be built here" in reason and "Error building extension" in reason
    assert str(kernel.build_folder(kernel.ISA)) in reason


def test_qkv_build_help_names_the_isas() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "qkv", "build", "--help"],
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "--isa {native,avx512,avx2}" in run.stdout and "qkv build --isa avx2" in run.stdout


def _can_build() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None and kernel.ENABLED


@pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler and the kernel switched on")
def test_qkv_build_prints_what_it_built_and_where(capsys: pytest.CaptureFixture[str]) -> None:
    """In the default cache, which other tests build into too (then this one only loads)."""
    assert cli.main(["build"]) == 0
    printed = capsys.readouterr().out
    assert str(kernel.build_folder(kernel.ISA)) in printed
    assert f"isa: {kernel.ISA}" in printed and "built: True" in printed


def _kill_session(session: int) -> None:
    """SIGKILL every process of a session: the builder started as its leader, ninja, and the
    compiler, which ninja runs in a process group of its own (so killing the builder's group
    would miss it). Scanned again until none is left, in case one started another meanwhile."""
    for _ in range(20):
        found = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):  # the process ended while being read
                state, _, _, process_session = stat.read_text().rsplit(")", 1)[1].split()[:4]
                if int(process_session) == session and state != "Z":
                    found = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(stat.parent.name), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.1)


@pytest.mark.skipif(
    not _can_build() or not Path("/proc/self/stat").exists(),
    reason="needs a C++ compiler, the kernel switched on and Linux's /proc",
)
def test_a_build_killed_part_way_is_started_over_by_the_next_call(tmp_path: Path) -> None:
    """Before qkv held a lock of its own, the second call here waited for ever."""
    environment = _environment(TORCH_EXTENSIONS_DIR=str(tmp_path))
    builder = subprocess.Popen(
        [sys.executable, "-c", _ATTEND],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("*/lock")) and time.monotonic() < deadline:
            assert builder.poll() is None, "the build ended before it could be killed"
            time.sleep(0.2)
        time.sleep(3)  # into the compile
    finally:
        _kill_session(builder.pid)
        builder.wait()
    assert list(tmp_path.glob("*/lock")), "the killed build left no torch lock behind"

    notes = _attend_notes(environment, timeout=600)
    assert len(notes) == 2 and "stopped part-way" in notes[0] and "about a minute" in notes[1]
    assert _attend_notes(environment, timeout=300) == []  # the cached build loads in silence


def _attend_notes(environment: dict[str, str], timeout: float) -> list[str]:
    """Run ``_ATTEND`` in a fresh process; check that the kernel ran; its ``qkv:`` lines."""
    run = subprocess.run(
        [sys.executable, "-c", _ATTEND],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-4000:]
    return [line for line in run.stderr.splitlines() if line.startswith("qkv:")]
