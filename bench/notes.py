"""Hand-written readings of a benchmark report, kept beside it so a regenerated report keeps them.

A report (`bench/results/NAME.md`) is rewritten whole by its renderer, on a new run and on a
`--report-only` rebuild from the raw file; a reading added to it by hand was lost each time. The
reading lives instead in `bench/results/NAME.notes.md` (plain markdown, written by a person), and the
renderer includes it where its readings belong: `section(report_path)` returns its lines under a
heading that names the file, or nothing when there is none. The notes file says which run it reads;
the renderer does not check that it still matches the numbers (a person re-reads after a new run).
"""

from __future__ import annotations

from pathlib import Path

HEADING = "## Reading (hand-written)"


def notes_path(report: Path) -> Path:
    """`autoscale.md` -> `autoscale.notes.md`, beside it."""
    return report.with_name(report.stem + ".notes.md")


def with_plot(text: str, report: Path, title: str) -> str:
    """`text` with the plot's line before its hand-written reading (or at its end)."""
    line = plot_line(report, title)
    if HEADING in text:
        head, _, tail = text.partition(HEADING)
        return f"{head.rstrip()}\n\n{line}\n\n{HEADING}{tail}"
    return f"{text.rstrip()}\n\n{line}\n"


def plot_line(report: Path, title: str) -> str:
    """The markdown line that shows the report's plot (`NAME.png` beside `NAME.md`)."""
    return f"![{title}]({report.with_suffix('.png').name})"


def section(report: Path) -> list[str]:
    """The notes' lines under `HEADING` (a blank line after), or [] without a notes file."""
    path = notes_path(report)
    if not path.exists():
        return []
    body = path.read_text().strip()
    if not body:
        return []
    return [HEADING, "", f"From [{path.name}]({path.name}), kept across re-renders of this report.", "", body, ""]
