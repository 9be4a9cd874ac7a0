"""`tokenway usage report`: read the ledger and print usage per group (table, csv or json).

The gateway CLI adds it with `add_usage_parser(subparsers)`; the parser's `func` default is
`run_usage`, which returns the exit status. `python -m gateway.ledger.cli usage report ...` runs it
standalone. The ledger directory comes from `--dir`, else from `ledger.dir` of `--config`'s
gateway.yaml (`${ENV}` resolved; a relative one is relative to the working directory, where the
gateway and the Docker image write it: docs/configuration.md), else `var/usage`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gateway.app.schema import LedgerConfig
from gateway.ledger.outcomes import OutcomeReport, is_outcome, render_outcomes
from gateway.ledger.reader import ReadStats, files_in_window, iter_entries
from gateway.ledger.report import FORMATS, ReportBuilder, ReportError, render
from gateway.ledger.sqlcli import add_sql_parser
from policies.times import parse_duration_s, parse_iso_s


def parse_time_s(text: str, now_s: float) -> float:
    """A duration back from now ('24h') or an ISO-8601 time/date (UTC when no offset) -> unix s."""
    with contextlib.suppress(ValueError):  # not a duration: try an ISO time
        return now_s - parse_duration_s(text)
    try:
        return parse_iso_s(text)
    except ValueError:
        raise ValueError(f"not a duration or ISO time: {text!r} (e.g. 24h, 7d, 2025-01-31T00:00)") from None


def add_usage_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `usage` (with `report` and `sql`) to a CLI's subparsers; returns the `usage` parser."""
    usage: argparse.ArgumentParser = subparsers.add_parser("usage", help="usage ledger: reports of tokens and cost")
    usage_sub = usage.add_subparsers(dest="usage_command", required=True)
    report = usage_sub.add_parser(
        "report",
        help="requests, tokens, cost, CPM and TTFT per group",
        description="Read the usage ledger and print requests, tokens, cost, cost per million tokens "
        "(CPM) and p50/p90 time to first token per group.",
    )
    report.add_argument("--since", default="24h", help="window start: a duration back (30m, 24h, 7d) or ISO time")
    report.add_argument("--until", default=None, help="window end (default: now), same forms as --since")
    report.add_argument(
        "--by",
        default="tenant,model",
        help="comma-separated group fields (tenant,key,model,adapter,...); `outcome`: cost per successful program "
        "and per unit of value, per tenant and model",
    )
    report.add_argument("--format", choices=FORMATS, default="table")
    report.add_argument("--plot", metavar="PNG", default=None, help="also draw spend over time per group")
    report.add_argument("--dir", default=None, help="ledger directory (default: ledger.dir of --config)")
    report.add_argument("--config", default=None, help="gateway.yaml to read ledger.dir from")
    report.add_argument(
        "--progress", choices=("auto", "on", "off"), default="auto", help="progress bar on stderr (auto: on a terminal)"
    )
    report.set_defaults(func=run_usage)
    add_sql_parser(usage_sub)
    return usage


def run_usage(args: argparse.Namespace) -> int:
    """Handler of `usage report`; prints to stdout, warnings to stderr; returns the exit status."""
    now_s = time.time()
    try:
        since_s = parse_time_s(args.since, now_s) if args.since else None
        until_s = parse_time_s(args.until, now_s) if args.until else None
        directory = _ledger_dir(args)
    except (ValueError, OSError) as exc:
        print(f"tokenway usage report: {exc}", file=sys.stderr)
        return 2
    if not directory.is_dir():
        where = "" if directory.is_absolute() else f" ({Path.cwd() / directory}: relative to the working directory)"
        print(f"tokenway usage report: no ledger directory {directory}{where}", file=sys.stderr)
        return 1
    by = [f for f in args.by.split(",") if f.strip()]
    stats = ReadStats()

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    if [f.strip() for f in by] == ["outcome"]:
        return _outcome_report(directory, since_s, until_s, args, stats, warn)
    try:
        builder = ReportBuilder(by)
        series = None
        if args.plot:
            from gateway.ledger.plot import SpendSeries

            series = SpendSeries(by)
        with _progress(directory, since_s, args.progress) as on_bytes:
            for entry in iter_entries(
                directory, since_unix_s=since_s, until_unix_s=until_s, stats=stats, warn=warn, on_bytes=on_bytes
            ):
                if is_outcome(entry):  # a program's end, not a request (--by outcome reads them)
                    continue
                builder.add(entry)
                if series is not None:
                    series.add(entry)
        sys.stdout.write(render(builder.report(), args.format))
        if series is not None:
            out = series.draw(args.plot)
            print(f"wrote {out}", file=sys.stderr)
    except (ReportError, RuntimeError) as exc:
        print(f"tokenway usage report: {exc}", file=sys.stderr)
        return 2
    return 0


def _outcome_report(
    directory: Path,
    since_s: float | None,
    until_s: float | None,
    args: argparse.Namespace,
    stats: ReadStats,
    warn: Callable[[str], None],
) -> int:
    """`--by outcome` (gateway/ledger/outcomes.py)."""
    report = OutcomeReport()
    with _progress(directory, since_s, args.progress) as on_bytes:
        for entry in iter_entries(
            directory, since_unix_s=since_s, until_unix_s=until_s, stats=stats, warn=warn, on_bytes=on_bytes
        ):
            report.add(entry)
    sys.stdout.write(render_outcomes(report.rows(), args.format))
    return 0


@contextlib.contextmanager
def _progress(directory: Path, since_s: float | None, mode: str) -> Iterator[Callable[[int], None] | None]:
    """A byte-counting progress bar on stderr while the ledger is read: shown when stderr is a
    terminal (`--progress auto`), always (`on`) or never (`off`)."""
    show = mode == "on" or (mode == "auto" and sys.stderr.isatty())
    if not show:
        yield None
        return
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files_in_window(directory, since_s))
    with tqdm(total=total, unit="B", unit_scale=True, desc="reading ledger", file=sys.stderr, leave=False) as bar:
        yield bar.update


def _ledger_dir(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir)
    if args.config:
        from gateway.app.settings import ConfigError, load_settings

        try:
            settings = load_settings(args.config)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        return Path(settings.ledger.dir)  # relative to the working directory, as the gateway writes it
    return Path(LedgerConfig().dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenway")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_usage_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
