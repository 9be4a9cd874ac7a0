"""A report's raw results, kept beside it (`bench/results/raw/NAME-raw.json.gz`), so the report and
its plot re-render from them (`--report-only`) without running the benchmark again: a changed
renderer or new notes cost seconds, and the numbers stay those of the run the notes read."""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Render = Callable[[argparse.Namespace, list[Any], str], str]
Plot = Callable[[list[Any], Path], None]


def raw_path(report: Path) -> Path:
    return report.parent / "raw" / f"{report.stem}-raw.json.gz"


def write(report: Path, args: argparse.Namespace, runs: list[Any], render: Render, plot: Plot) -> Path:
    """The plot (report.png), the report, and the raw file of `args` (less `out`) and `runs`."""
    png = report.with_suffix(".png")
    plot(runs, png)
    report.write_text(render(args, runs, png.name))
    raw = raw_path(report)
    raw.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(raw, "wt") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}, f)
    return raw


def rerender(report: Path, render: Render, plot: Plot) -> None:
    """The report and plot again from the raw file, with the run's own arguments."""
    with gzip.open(raw_path(report), "rt") as f:
        stored = json.load(f)
    png = report.with_suffix(".png")
    plot(stored["runs"], png)
    report.write_text(render(argparse.Namespace(**{**stored["args"], "out": report}), stored["runs"], png.name))
