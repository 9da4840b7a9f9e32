"""What a check run found: one ``Result`` per check, the ``Report`` card, as text or JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CHECK_IDS = (
    "shapes", "weights", "oracle", "scale", "causal", "padding", "fully-masked", "batch",
    "dropout", "empty", "dtypes", "gradients",
)  # fmt: skip
FLASH_CHECK_IDS = (
    "oracle", "lse", "backward", "causal", "alignment", "odd-lengths", "fully-masked", "dtypes",
    "determinism", "memory", "work",
)  # fmt: skip
KNOWN_IDS = tuple(dict.fromkeys(CHECK_IDS + FLASH_CHECK_IDS))
# A warning is a finding that does not fail the check run: a cost, or a choice with a price.
STATUSES = ("pass", "fail", "warn", "skip")
MARKS = {"pass": "✓", "fail": "✗", "warn": "!", "skip": "–"}
STYLES = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


def number(value: float) -> str:
    """A number in a paragraph: three significant digits."""
    return f"{value:.3g}"


def sentence(text: str) -> str:
    """``text`` with a capital first letter, to start a sentence."""
    return text[:1].upper() + text[1:]


@dataclass(frozen=True)
class Result:
    """One check: its stable id, ``pass``/``fail``/``warn``/``skip`` and a paragraph with the
    numbers."""

    id: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.id not in KNOWN_IDS:
            raise ValueError(f"id must be one of {KNOWN_IDS}, got {self.id!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Report:
    """The report card of one implementation. ``ok``: no check failed."""

    target: str
    checks: list[Result] = field(default_factory=list)
    detected: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(result.status == "fail" for result in self.checks)

    @property
    def failed(self) -> list[str]:
        return [result.id for result in self.checks if result.status == "fail"]

    def __getitem__(self, check_id: str) -> Result:
        for result in self.checks:
            if result.id == check_id:
                return result
        ids = tuple(result.id for result in self.checks)
        raise KeyError(f"no check {check_id!r} in this report; checks: {ids}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "ok": self.ok,
            "checks": [{"id": r.id, "status": r.status, "detail": r.detail} for r in self.checks],
            "detected": self.detected,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False, default=str)

    def text(self) -> str:
        """The card as plain text (no colours): what ``assert_attention`` and logs show."""
        lines = [
            f"qkv check {self.target}: {'ok' if self.ok else 'FAILED: ' + ', '.join(self.failed)}"
        ]
        lines += [f"  {name}: {value}" for name, value in self.detected.items()]
        for result in self.checks:
            lines.append(f"{MARKS[result.status]} {result.id:<13} {result.status}")
            lines.append(f"    {result.detail}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def render(report: Report, console: Any) -> None:
    """The card with rich: what was detected, then one row per check with its paragraph."""
    from rich.markup import escape
    from rich.table import Table

    console.print()
    verdict = "[bold green]ok[/]" if report.ok else "[bold red]failed[/]"
    console.rule(f"[bold]qkv check[/] · {verdict}")
    console.print(f"  [bold]{escape(report.target)}[/]", soft_wrap=True)
    for name, value in report.detected.items():
        console.print(f"  [dim]{escape(name)}:[/] {escape(str(value))}")
    table = Table(show_header=True, header_style="bold", expand=True, show_lines=True)
    table.add_column("", width=1)
    table.add_column("check", no_wrap=True)
    table.add_column("what it found", ratio=1)
    for result in report.checks:
        style = STYLES[result.status]
        mark = f"[{style}]{MARKS[result.status]}[/]"
        table.add_row(mark, f"[{style}]{result.id}[/]", escape(result.detail))
    console.print(table)
    counts = {s: sum(r.status == s for r in report.checks) for s in STATUSES}
    warned = f", {counts['warn']} warned" if counts["warn"] else ""
    console.print(
        f"  {counts['pass']} passed, {counts['fail']} failed{warned}, {counts['skip']} skipped "
        f"in {report.seconds:.2f} s"
    )
