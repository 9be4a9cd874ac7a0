"""`tokenway usage sql "SELECT ..."`: the caller's SQL over the ledger, as a table, CSV or JSON.

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
import csv
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from decimal import Decimal
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

import orjson

from gateway.ledger.sqlstore import SqlError

FORMATS = ("table", "csv", "json")
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
    sql.add_argument("--format", choices=FORMATS, default="table")
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
            from gateway.ledger.cli import _ledger_dir
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
        render(columns, rows, args.format, sys.stdout)
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


def render(columns: Sequence[str], rows: Iterator[tuple[Any, ...]], fmt: str, out: TextIO) -> None:
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
