"""The embedded SQL store: the ledger's JSON lines loaded into SQLite, beside the files, for `usage sql`.

`ingest(directory)` brings `<directory>/usage.sqlite` up to date before each query. Each file is
remembered by name with the byte offset read so far and a digest of its first line (a new file under
a name already read, after the directory was emptied, is noticed and read as new); only bytes past
the offset are read, so a rotated file is loaded once and the active one has just its new lines
added. Rows and the file's new offset commit in the same transaction, a batch at a time: an
interrupted ingest (or two at once: each transaction re-reads the offset under SQLite's write lock)
never loads a line twice or skips one. Memory is one batch, whatever the ledger's size; SQLite's own
page cache is capped (`_CACHE_KIB`).

Lines follow reader.py's rules: a line that is not a JSON object with a numeric `ts` is skipped and
counted. A last line with no newline is left for later while its file may still grow (the newest file
of its prefix: the writer may be mid-write) and, once a newer file exists, kept when it is a whole
object, else skipped as torn. Rows whose file retention later deletes stay in the store: it keeps the
history the files no longer do.

`query(path, sql)` runs the caller's SQL on a second connection opened read-only (`mode=ro`,
`PRAGMA query_only`) behind an authorizer that allows reading and nothing else (no ATTACH, no PRAGMA
that sets anything), so a query cannot alter the store nor reach another file. Results stream
(`fetchmany`); sorting and grouping spill to temporary files past SQLite's cache, so memory stays
bounded at any row count.

## The `usage` table's columns (`COLUMNS`, `entry_to_row`)

The `usage` table's columns, shared by the embedded SQLite store and the PostgreSQL sink.

One column per ledger field of writer.py, typed, so `sum(cost_usd)` and `WHERE tenant = 'acme'` need
no JSON functions; `extra` (a nested object) stays JSON text, and `other` holds, as one JSON object,
every field this version does not know (a newer writer's) plus any value whose type does not fit
its column (a string where a count belongs). Both stores therefore take every line a reader
accepts: a row is never refused for its content, so one odd record cannot stall a batch. A column
added here later is added to an existing table at the next ingest (older rows keep the field, if any,
in `other`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

from gateway.ledger.reader import _FILE_RE, ledger_files
from gateway.ledger.writer import decode

Kind = Literal["int", "real", "text", "bool", "json"]

# (column, kind) in table order: the ledger fields of writer.py, then `other`.
COLUMNS: tuple[tuple[str, Kind], ...] = (
    ("v", "int"), ("ts", "real"), ("started", "real"), ("request_id", "text"), ("api", "text"),
    ("tenant", "text"), ("key_id", "text"), ("requested_model", "text"), ("model", "text"),
    ("served_model", "text"), ("fallback_from", "text"), ("fallback_reason", "text"), ("pool", "text"),
    ("endpoint", "text"), ("prefill_endpoint", "text"), ("engine", "text"), ("stream", "bool"),
    ("status", "text"), ("http_status", "int"), ("error_code", "text"), ("reject_reason", "text"),
    ("input_tokens", "int"), ("cached_input_tokens", "int"), ("output_tokens", "int"),
    ("cache_write_input_tokens", "int"), ("cache_write_1h_input_tokens", "int"), ("reasoning_tokens", "int"),
    ("usage_source", "text"), ("cost_usd", "real"), ("cache_saved_usd", "real"), ("ttft_s", "real"),
    ("tpot_s", "real"), ("duration_s", "real"), ("gateway_overhead_s", "real"), ("upstream_attempts", "int"),
    ("route_reason", "text"), ("pd_reason", "text"), ("kv_transfer_failed", "bool"), ("batch_id", "text"),
    ("program", "text"), ("user", "text"), ("tags", "json"), ("leg", "int"), ("continues", "text"),
    ("extra", "json"), ("other", "json"),
)  # fmt: skip
FIELDS = tuple(name for name, _ in COLUMNS[:-1])  # the ledger fields with a column of their own
_KNOWN = frozenset(FIELDS)

SQLITE_TYPES: dict[Kind, str] = {"int": "INTEGER", "real": "REAL", "text": "TEXT", "bool": "INTEGER", "json": "TEXT"}
POSTGRES_TYPES: dict[Kind, str] = {
    "int": "bigint",
    "real": "double precision",
    "text": "text",
    "bool": "boolean",
    "json": "jsonb",
}
# What the report groups and filters on most: time windows, tenants, keys, models.
INDEXED = ("ts", "tenant", "key_id", "model")


def _fits(kind: Kind) -> Callable[[Any], bool]:
    if kind == "int":
        return lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    if kind == "real":
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if kind == "text":
        return lambda v: isinstance(v, str)
    if kind == "bool":
        return lambda v: isinstance(v, bool)
    return lambda v: isinstance(v, dict | list)


_CHECKS = tuple((name, kind, _fits(kind)) for name, kind in COLUMNS[:-1])
_ALLOWED: dict[Kind, tuple[type, ...]] = {
    "int": (int,), "real": (int, float), "text": (str,), "bool": (bool,), "json": (dict, list),
}  # fmt: skip
_KINDS = tuple(kind for _, kind in COLUMNS[:-1])
_JSON_AT = tuple(i for i, kind in enumerate(_KINDS) if kind == "json")
_INT_AT = tuple(i for i, kind in enumerate(_KINDS) if kind == "int")
_SIGNATURES: dict[tuple[type, ...], bool] = {}  # the value types of a row -> every one fits its column
_MAX_SIGNATURES = 4096


def _signature_fits(signature: tuple[type, ...]) -> bool:
    fits = _SIGNATURES.get(signature)
    if fits is None:
        fits = all(t is type(None) or t in _ALLOWED[kind] for t, kind in zip(signature, _KINDS, strict=True))
        if len(_SIGNATURES) < _MAX_SIGNATURES:
            _SIGNATURES[signature] = fits
    return fits


def entry_to_sqlite_row(entry: dict[str, Any]) -> tuple[Any, ...]:
    """`entry_to_row` for SQLite, fast: a ledger line's value types follow a handful of patterns, so
    the check is one lookup of the row's type signature (the per-column checks run on a new pattern,
    an unknown field, or an integer past 64 bits); the rest is C-level `map`. The profile of
    bench/usage_sql put the per-column path at most of the loading time."""
    values = list(map(entry.get, FIELDS))
    if not _KNOWN.issuperset(entry) or not _signature_fits(tuple(map(type, values))):
        return entry_to_row(entry)
    for i in _INT_AT:
        v = values[i]
        if v is not None and not -(2**63) <= v < 2**63:
            return entry_to_row(entry)
    for i in _JSON_AT:
        if values[i] is not None:
            values[i] = orjson.dumps(values[i], default=str).decode()
    values.append(None)  # other
    return tuple(values)  # booleans bind as 0/1, integers in REAL columns are stored as REAL


def entry_to_row(entry: dict[str, Any], *, postgres: bool = False) -> tuple[Any, ...]:
    """One row, in COLUMNS order, from a decoded ledger entry. Booleans are 0/1 for SQLite; JSON is
    text; for PostgreSQL, NUL characters (which its text and jsonb refuse) become U+FFFD."""
    row: list[Any] = []
    other: dict[str, Any] | None = None
    for name, kind, fits in _CHECKS:
        value = entry.get(name)
        if value is None:
            row.append(None)
            continue
        if not fits(value):
            other = other if other is not None else {}
            other[name] = value
            row.append(None)
            continue
        if kind == "json":
            value = orjson.dumps(value, default=str).decode()
            if postgres and "\\u0000" in value:
                value = value.replace("\\u0000", "\\ufffd")  # jsonb refuses NUL, even escaped
        elif kind == "text":
            if postgres and "\x00" in value:
                value = value.replace("\x00", "\ufffd")  # so does text
        elif kind == "bool" and not postgres:
            value = int(value)
        elif kind == "real":
            value = float(value)
        row.append(value)
    unknown = {k: v for k, v in entry.items() if k not in _KNOWN}
    if unknown:
        other = {**(other or {}), **unknown}
    text = orjson.dumps(other, default=str).decode() if other else None
    if postgres and text is not None and "\\u0000" in text:
        text = text.replace("\\u0000", "\\ufffd")
    row.append(text)
    return tuple(row)


log = logging.getLogger("tokenway.ledger")

DB_NAME = "usage.sqlite"
TABLE = "usage"
BATCH_ROWS = 20_000  # rows per transaction: a few MiB of Python objects at most
_CACHE_KIB = 64 * 1024  # SQLite page cache of the loading connection (index updates hit it)
_QUERY_CACHE_KIB = 16 * 1024  # and of a query's: also what its sorter holds before spilling to a file
_BUSY_MS = 30_000  # another ingest holding the write lock: wait this long
_HEAD_BYTES = 4096  # the part of a file's first line its identity digest covers
_INSERT = (
    f"INSERT INTO {TABLE} ({', '.join(c for c, _ in COLUMNS)}, file_id) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"
)

Warn = Callable[[str], None]


class SqlError(ValueError):
    """The query cannot run (bad SQL, a write, a missing store): a CLI message, exit status 2."""


@dataclass(slots=True)
class IngestStats:
    files: int = 0  # files with new bytes
    rows: int = 0
    skipped_lines: int = 0
    replaced_files: int = 0
    warnings: list[str] = field(default_factory=list)


def schema_sql() -> list[str]:
    cols = ",\n  ".join(f"{name} {SQLITE_TYPES[kind]}" for name, kind in COLUMNS)
    return [
        f"CREATE TABLE IF NOT EXISTS {TABLE} (\n  {cols},\n  file_id INTEGER NOT NULL\n)",
        "CREATE TABLE IF NOT EXISTS ledger_files (\n  file_id INTEGER PRIMARY KEY,\n  name TEXT NOT NULL UNIQUE,\n"
        "  offset INTEGER NOT NULL,\n  head TEXT NOT NULL,\n  rows INTEGER NOT NULL DEFAULT 0\n)",
        *(f"CREATE INDEX IF NOT EXISTS {TABLE}_{c} ON {TABLE} ({c})" for c in INDEXED),
    ]


def db_path(directory: str | Path) -> Path:
    return Path(directory) / DB_NAME


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=_BUSY_MS / 1000.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")  # queries read while an ingest writes
    conn.execute("PRAGMA synchronous=NORMAL")  # the files stay the record of truth: a lost tail is re-read
    conn.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
    conn.execute("PRAGMA temp_store=FILE")
    return conn


def ingest(
    directory: str | Path, *, store: Path | None = None, warn: Warn | None = None, batch_rows: int = BATCH_ROWS
) -> IngestStats:
    """Load every ledger line of `directory` not yet in its store (`store`, default
    DIR/usage.sqlite); returns what was added."""
    directory = Path(directory)
    stats = IngestStats()

    def warning(message: str) -> None:
        stats.warnings.append(message)
        (warn or log.warning)(message)

    files = ledger_files(directory)
    newest: dict[str, Path] = {}
    for path in files:  # commit order: the last of each prefix may still be written to
        m = _FILE_RE.match(path.name)
        if m is not None:
            newest[m["prefix"]] = path
    conn = _connect(store if store is not None else db_path(directory))
    try:
        for statement in schema_sql():
            conn.execute(statement)
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
        for name, kind in COLUMNS:
            if name not in have:  # a column this version added to a store made by an older one
                conn.execute(f"ALTER TABLE {TABLE} ADD COLUMN {name} {SQLITE_TYPES[kind]}")
        for path in files:
            _ingest_file(conn, path, path in newest.values(), batch_rows, stats, warning)
    finally:
        conn.close()
    return stats


def _head_digest(f: BinaryIO) -> tuple[str, int]:
    """A digest of the file's first line (or first _HEAD_BYTES; its newline left out, which a torn
    write may add later), and how many bytes it covers."""
    f.seek(0)
    head = f.readline(_HEAD_BYTES)
    return hashlib.blake2b(head.rstrip(b"\n"), digest_size=16).hexdigest(), len(head)


def _ingest_file(
    conn: sqlite3.Connection, path: Path, may_grow: bool, batch_rows: int, stats: IngestStats, warning: Warn
) -> None:
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return  # deleted by retention since the listing
    with f:
        _ingest_open_file(conn, path, f, may_grow, batch_rows, stats, warning)


def _ingest_open_file(
    conn: sqlite3.Connection,
    path: Path,
    f: BinaryIO,
    may_grow: bool,
    batch_rows: int,
    stats: IngestStats,
    warning: Warn,
) -> None:
    size = os.fstat(f.fileno()).st_size
    known = conn.execute("SELECT file_id, offset, head FROM ledger_files WHERE name = ?", (path.name,)).fetchone()
    if known is not None and known[1] == size:
        return  # nothing new: the common case, one indexed lookup per file
    head, head_len = _head_digest(f)
    if known is not None and (size < known[1] or (known[1] >= head_len and known[2] != head)):
        # The name now holds another file (the directory was emptied, and a new run took the name again):
        # the old file's rows stay, as rows of deleted files do; its entry is renamed and the new file read.
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE ledger_files SET name = name || '#' || file_id WHERE file_id = ? AND name = ?",
            (known[0], path.name),
        )
        conn.execute("COMMIT")
        stats.replaced_files += 1
        warning(f"{path}: not the file loaded under that name before; read as a new file")
    counted = False
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT file_id, offset FROM ledger_files WHERE name = ?", (path.name,)).fetchone()
            if row is None:
                file_id = conn.execute(
                    "INSERT INTO ledger_files (name, offset, head) VALUES (?, 0, ?)", (path.name, head)
                ).lastrowid
                offset = 0
            else:
                file_id, offset = row
            f.seek(offset)
            rows, consumed = _read_batch(f, path, offset, may_grow, batch_rows, stats, warning)
            if consumed == 0:
                conn.execute("ROLLBACK")
                return
            if not counted:
                stats.files += 1
                counted = True
            conn.executemany(_INSERT, ((*r, file_id) for r in rows))
            conn.execute(
                "UPDATE ledger_files SET offset = ?, rows = rows + ? WHERE file_id = ?",
                (offset + consumed, len(rows), file_id),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        stats.rows += len(rows)


def _read_batch(
    f: BinaryIO, path: Path, offset: int, may_grow: bool, batch_rows: int, stats: IngestStats, warning: Warn
) -> tuple[list[tuple[Any, ...]], int]:
    """Up to `batch_rows` rows from the file position, and the bytes they (and skipped lines) took."""
    rows: list[tuple[Any, ...]] = []
    consumed = 0
    for line in f:
        if not line.endswith(b"\n"):
            # The last line, unfinished or just without its newline (reader.py keeps a whole object).
            try:
                entry = decode(line)
            except ValueError:
                if may_grow:
                    break  # the writer may be mid-line: read it next time
                stats.skipped_lines += 1
                warning(f"{path}: torn last line at byte {offset + consumed} ({len(line)} bytes) skipped")
                consumed += len(line)
                break
            consumed += len(line)
            if _usable(entry, path, offset + consumed - len(line), stats, warning):
                rows.append(entry_to_sqlite_row(entry))
            break
        consumed += len(line)
        if not line.strip():
            continue
        try:
            entry = decode(line)
        except ValueError as exc:
            stats.skipped_lines += 1
            warning(f"{path}: corrupt record at byte {offset + consumed - len(line)} skipped ({exc})")
            continue
        if _usable(entry, path, offset + consumed - len(line), stats, warning):
            rows.append(entry_to_sqlite_row(entry))
            if len(rows) >= batch_rows:
                break
    return rows, consumed


def _usable(entry: dict[str, Any], path: Path, at: int, stats: IngestStats, warning: Warn) -> bool:
    ts = entry.get("ts")
    if isinstance(ts, int | float) and not isinstance(ts, bool):
        return True
    stats.skipped_lines += 1
    warning(f"{path}: record without a numeric ts at byte {at} skipped")
    return False


# -- read-only queries -----------------------------------------------------------------------

_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "table_list"})


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    """Reading only: SELECT, column reads, functions, recursive CTEs, and the PRAGMAs that describe
    the schema without an argument that sets anything."""
    if action in _READ_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and arg1 is not None and arg1.lower() in _READ_PRAGMAS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master" and trigger is None:
        # what SQLite asks while it sets up a table-valued function (json_each, json_tree) for the
        # statement; an UPDATE of the schema itself still fails: the connection is read-only twice over
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def open_readonly(path: Path) -> sqlite3.Connection:
    """A connection that can only read the store (three locks: mode=ro, query_only, the authorizer)."""
    if not path.is_file():
        raise SqlError(f"no SQL store at {path}")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=_BUSY_MS / 1000.0)
    conn.execute("PRAGMA query_only=ON")
    conn.execute(f"PRAGMA cache_size=-{_QUERY_CACHE_KIB}")
    conn.execute("PRAGMA temp_store=FILE")
    conn.set_authorizer(_authorize)
    return conn


def query(path: Path, sql: str, *, chunk_rows: int = 1000) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
    """Column names and a row iterator of the caller's read-only `sql`; SqlError when it cannot run."""
    conn = open_readonly(path)
    try:
        cursor = conn.execute(sql)
    except (sqlite3.Error, sqlite3.Warning) as exc:
        conn.close()
        raise SqlError(_explain(exc)) from None
    columns = [d[0] for d in cursor.description or ()]

    def rows() -> Iterator[tuple[Any, ...]]:
        try:
            while chunk := cursor.fetchmany(chunk_rows):
                yield from chunk
        except sqlite3.Error as exc:
            raise SqlError(_explain(exc)) from None
        finally:
            conn.close()

    return columns, rows()


def _explain(exc: BaseException) -> str:
    message = str(exc)
    if any(
        w in message
        for w in ("not authorized", "authorization denied", "readonly", "query_only", "may not be modified")
    ):
        return f"{message}: only read-only queries (SELECT, WITH ... SELECT) run on the usage store"
    return message
