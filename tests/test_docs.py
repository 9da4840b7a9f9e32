"""The docs state the present: every file they name exists, and ``benchmarks/`` holds what its
README lists (current results and scripts, no logs of past runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/*.md")])
# `path/to/file.ext` in backquotes: a repository path when it has a folder and an extension.
NAMED_PATH = re.compile(r"`((?:src|docs|benchmarks|examples|tests)/[\w./-]+\.\w+)`")
# Bare file names of src/qkv/backends/flash/ that the docs use without the folder.
BARE_NAME = re.compile(r"`(\w+\.(?:py|cpp))`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = [p for p in NAMED_PATH.findall(text) if not (ROOT / p).exists()]
    names = {p.name for p in (ROOT / "src").rglob("*") if p.is_file()}
    names |= {p.name for p in (ROOT / "benchmarks").iterdir()}
    missing += [n for n in BARE_NAME.findall(text) if n not in names]
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_benchmarks_holds_only_what_its_readme_lists() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    files = [p.name for p in (ROOT / "benchmarks").iterdir() if p.name != "README.md"]
    assert files
    unlisted = [name for name in files if name not in readme]
    assert not unlisted, f"benchmarks/ holds files its README does not list: {unlisted}"
