"""`tokenway usage report` and `tokenway usage sql`: the ledger read back from the shell.

## `usage report`

`tokenway usage report`: read the ledger and print usage per group (table, csv or json).

The gateway CLI adds it with `add_usage_parser(subparsers)`; the parser's `func` default is
`run_usage`, which returns the exit status. `python -m gateway.ledger.cli usage report ...` runs it
standalone. The ledger directory comes from `--dir`, else from `ledger.dir` of `--config`'s
gateway.yaml (`${ENV}` resolved; a relative one is relative to the working directory, where the
gateway and the Docker image write it: docs/configuration.md), else `var/usage`.

## `usage sql`

`tokenway usage sql "SELECT ..."`: the caller's SQL over the ledger, as a table, CSV or JSON.

By default the embedded store (sqlstore.py) beside the ledger found as `usage report` finds it
(`--dir`, else `ledger.dir` of `--config`, else `var/usage`) is brought up to date, then queried
read-only; `--dsn postgresql://...` queries the PostgreSQL table the gateway's sink fills instead
(postgres.py). Rows stream to stdout: CSV and JSON hold one row at a time, the table sizes its
columns on the first `_TABLE_SAMPLE` rows and streams the rest, so a query returning ten million rows
needs no more memory than one returning ten. Exit status: 0, 1 when the ledger directory is
missing, 2 when the query cannot run (bad SQL, a write, an unreachable database), with the reason on
stderr and never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

import orjson

from gateway.app.settings import LedgerConfig
from gateway.ledger.outcomes import OutcomeReport, is_outcome, render_outcomes
from gateway.ledger.reader import ReadStats, files_in_window, iter_entries
from gateway.ledger.report import FORMATS, ReportBuilder, ReportError, render
from gateway.ledger.sqlstore import SqlError
from policies.types import parse_duration_s, parse_iso_s

SQL_FORMATS = ("table", "csv", "json")
_TABLE_SAMPLE = 1000


def add_sql_parser(usage_sub: Any) -> argparse.ArgumentParser:
    sql: argparse.ArgumentParser = usage_sub.add_parser(
        "sql",
        help="run a read-only SQL query over the ledger (table `usage`)",
        description="Load new ledger lines into the SQLite store beside the ledger (or use --dsn's "
        "PostgreSQL), then run one read-only query over the `usage` table: one column per ledger field "
        '(docs/governance.md#sql-spend-tokenway-usage-sql). Example: tokenway usage sql "SELECT tenant, sum(cost_usd) '
        'FROM usage GROUP BY 1"',
    )
    sql.add_argument("query", help="one SQL statement (SELECT or WITH ... SELECT)")
    sql.add_argument("--format", choices=SQL_FORMATS, default="table")
    sql.add_argument("--dir", default=None, help="ledger directory (default: ledger.dir of --config)")
    sql.add_argument("--config", default=None, help="gateway.yaml to read ledger.dir from")
    sql.add_argument("--store", default=None, help="the SQLite file (default: DIR/usage.sqlite)")
    sql.add_argument("--no-ingest", action="store_true", help="query the store as it is, without loading new lines")
    sql.add_argument(
        "--dsn",
        default=None,
        help="query PostgreSQL (the table ledger.postgres fills) instead: postgresql://user@host/db",
    )
    sql.set_defaults(func=run_sql)
    return sql


def run_sql(args: argparse.Namespace) -> int:
    """Handler of `usage sql`; rows to stdout, warnings and errors to stderr; the exit status."""

    def fail(message: str, status: int = 2) -> int:
        print(f"tokenway usage sql: {message}", file=sys.stderr)
        return status

    try:
        if args.dsn:
            try:
                from gateway.ledger.postgres import query_postgres
            except ImportError as exc:
                return fail(f"--dsn needs psycopg: pip install 'tokenway[postgres]' ({exc})")

            columns, rows = query_postgres(args.dsn, args.query)
        else:
            from gateway.ledger.sqlstore import db_path, ingest, query

            directory = _ledger_dir(args)
            if not directory.is_dir():
                where = (
                    "" if directory.is_absolute() else f" ({Path.cwd() / directory}: relative to the working directory)"
                )
                return fail(f"no ledger directory {directory}{where}", 1)
            store = Path(args.store) if args.store else db_path(directory)
            if not args.no_ingest:
                ingest(directory, store=store, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
            columns, rows = query(store, args.query)
        render_rows(columns, rows, args.format, sys.stdout)
    except SqlError as exc:
        return fail(str(exc))
    except (ValueError, OSError) as exc:  # the config, the directory, the store's file
        return fail(str(exc))
    except sqlite3.Error as exc:  # the store itself (locked past the busy timeout, not a database)
        return fail(f"the SQL store: {exc}")
    return 0


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, Decimal):  # PostgreSQL's sum() of bigint is numeric
        return int(value) if value == value.to_integral_value() else float(value)
    return value


def render_rows(columns: Sequence[str], rows: Iterator[tuple[Any, ...]], fmt: str, out: TextIO) -> None:
    """Write `rows` to `out` as they come (the table buffers its first _TABLE_SAMPLE rows)."""
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else _json_value(v) for v in row])
        return
    if fmt == "json":
        out.write("[")
        sep = "\n"
        for row in rows:
            doc = dict(zip(columns, (_json_value(v) for v in row), strict=True))
            out.write(sep + orjson.dumps(doc, default=str).decode())
            sep = ",\n"
        out.write("\n]\n" if sep != "\n" else "]\n")
        return
    sample = [[_text(v) for v in row] for row in islice(rows, _TABLE_SAMPLE)]
    widths = [max(len(c), *(len(r[i]) for r in sample)) if sample else len(c) for i, c in enumerate(columns)]
    numeric = [bool(sample) and all(_is_number(r[i]) for r in sample) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out.write(line(columns) + "\n" + "  ".join("-" * w for w in widths) + "\n")
    count = 0
    for cells in sample:
        out.write(line(cells) + "\n")
        count += 1
    for row in rows:
        out.write(line([_text(v) for v in row]) + "\n")
        count += 1
    out.write(f"({count:,} row{'s' if count != 1 else ''})\n")


def _is_number(text: str) -> bool:
    if text == "NULL":
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


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
