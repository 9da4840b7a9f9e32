"""The code base is ruff-clean: lint rules and formatting (configured in pyproject.toml)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = ["src", "tests", "examples", "benchmarks"]


def _ruff() -> list[str]:
    executable = pathlib.Path(sys.executable).with_name("ruff")
    found = str(executable) if executable.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip('ruff is not installed: pip install -e ".[test]"')
    return [found]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run(
        [*_ruff(), *command, *CODE], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
