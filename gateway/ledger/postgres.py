"""Optional copy of the ledger into a PostgreSQL table (`ledger.postgres`), and queries over it.

The file ledger stays the record of truth, as with the Redis stream: the writer hands each committed
group of lines to `submit`, which only appends to a bounded queue (the oldest group is dropped, and
its records counted, past `max_pending_batches`). A thread decodes the lines and inserts each group
in one transaction (psycopg's `executemany`, pipelined). When PostgreSQL is down or slow, the group
waits and is retried with a growing pause (0.1 s to 5 s); nothing here blocks the writer or a request.

Each row carries `source` (random per gateway process) and `seq` (its line's number in that process),
the table's primary key: a group whose commit succeeded but whose answer was lost is sent again and
its rows are skipped (`ON CONFLICT DO NOTHING`), so the table holds each record once. A group that
PostgreSQL refuses for its content rather than its availability (a value out of range) is inserted
row by row and the refused rows are counted and dropped, so one bad record cannot stall the rest.

Counters, exported as `tokenway_ledger_postgres_*`: inserted, dropped (queue full, or still queued at
shutdown), rejected (refused rows), errors (failed round trips), pending_batches.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql as pgsql

from gateway.app.settings import LedgerPostgresConfig
from gateway.ledger.sinks import QueuedSender
from gateway.ledger.sqlstore import COLUMNS, INDEXED, POSTGRES_TYPES, SqlError, entry_to_row
from gateway.ledger.writer import decode

log = logging.getLogger("tokenway.ledger")

_QUERY_CONNECT_S = 10
_FETCH_ROWS = 1000
_READ_VERBS = ("select", "with", "values", "table", "(")


def ensure_table(conn: psycopg.Connection[Any], table: str) -> None:
    """Create the table and its indexes when missing, and add the columns a newer version has."""
    ident = pgsql.Identifier(table)
    cols = pgsql.SQL(", ").join(
        pgsql.SQL("{} {}").format(pgsql.Identifier(name), pgsql.SQL(POSTGRES_TYPES[kind])) for name, kind in COLUMNS
    )
    with conn.transaction():
        conn.execute(
            pgsql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ({}, source text NOT NULL, seq bigint NOT NULL,"
                " PRIMARY KEY (source, seq))"
            ).format(ident, cols)
        )
        for name, kind in COLUMNS:
            conn.execute(
                pgsql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    ident, pgsql.Identifier(name), pgsql.SQL(POSTGRES_TYPES[kind])
                )
            )
        for name in INDEXED:
            conn.execute(
                pgsql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ({})").format(
                    pgsql.Identifier(f"{table}_{name}"), ident, pgsql.Identifier(name)
                )
            )


class PostgresSink(QueuedSender):
    """A ledger BatchSink (writer.py) inserting every committed group into PostgreSQL."""

    def __init__(self, config: LedgerPostgresConfig) -> None:
        super().__init__(config.max_pending_batches, "ledger-postgres")
        self.config = config
        self.source = uuid.uuid4().hex[:16]
        self._conn: psycopg.Connection[Any] | None = None
        names = [*(name for name, _ in COLUMNS), "source", "seq"]
        self._insert = pgsql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING").format(
            pgsql.Identifier(config.table),
            pgsql.SQL(", ").join(pgsql.Identifier(n) for n in names),
            pgsql.SQL(", ").join(pgsql.Placeholder() for _ in names),
        )
        self.inserted_total = 0
        self.rejected_total = 0
        self._start()

    def stats(self) -> dict[str, float]:
        return {
            "postgres_inserted_total": self.inserted_total,
            "postgres_dropped_total": self.dropped_total,
            "postgres_rejected_total": self.rejected_total,
            "postgres_errors_total": self.errors_total,
            "postgres_round_trips_total": self.round_trips_total,
            "postgres_round_trip_seconds_total": self.round_trip_seconds_total,
            "postgres_pending_batches": self.pending_batches(),
        }

    def _closed(self) -> None:
        with self._cond:
            left = sum(len(lines) for _, lines in self._queue)
            if left and self._thread.is_alive():
                self._queue.clear()  # the thread gives up at its next failure
                self.dropped_total += left
                log.error("usage ledger: %d records not copied to PostgreSQL at shutdown", left)

    def _dropped_at_stop(self, records: int) -> None:
        log.error("usage ledger: %d records not copied to PostgreSQL at shutdown", records)

    def _exiting(self) -> None:
        self._disconnect()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            timeout_ms = int(self.config.timeout_s * 1000)
            conn = psycopg.connect(
                self.config.dsn,
                connect_timeout=max(1, round(self.config.timeout_s)),
                options=f"-c statement_timeout={timeout_ms}",
                application_name="tokenway-ledger",
            )
            try:
                ensure_table(conn, self.config.table)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # a broken connection: nothing left to lose
                log.debug("closing the ledger's PostgreSQL connection failed: %s", exc)

    def _rows(self, first_seq: int, lines: Sequence[bytes]) -> list[tuple[Any, ...]]:
        rows = []
        for i, line in enumerate(lines):
            try:
                entry = decode(line)
            except ValueError:
                self.rejected_total += 1  # the writer encoded it: cannot happen short of a bug
                continue
            rows.append((*entry_to_row(entry, postgres=True), self.source, first_seq + i))
        return rows

    def _send(self, first_seq: int, lines: Sequence[bytes]) -> bool:
        started_s = time.perf_counter()
        try:
            conn = self._connection()
            rows = self._rows(first_seq, lines)
            refused = 0
            try:
                with conn.transaction(), conn.cursor() as cur:
                    cur.executemany(self._insert, rows)
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                log.warning("usage ledger: PostgreSQL refused a group (%s); inserting its rows one by one", exc)
                refused = self._insert_each(conn, rows)
        except psycopg.Error as exc:
            self.errors_total += 1
            if self.errors_total == 1 or self.errors_total % 100 == 0:
                log.warning("usage ledger: PostgreSQL insert failed (%d failures): %s", self.errors_total, exc)
            self._disconnect()
            return False
        finally:
            self.round_trips_total += 1
            self.round_trip_seconds_total += time.perf_counter() - started_s
        self.inserted_total += len(rows) - refused
        return True

    def _insert_each(self, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> int:
        """Insert rows one at a time; returns how many PostgreSQL refused (counted, dropped)."""
        refused = 0
        for row in rows:
            try:
                with conn.transaction():
                    conn.execute(self._insert, row)
            except (psycopg.DataError, psycopg.IntegrityError):
                refused += 1
        self.rejected_total += refused
        return refused


# -- read-only queries -----------------------------------------------------------------------


def query_postgres(dsn: str, sql: str) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
    """Column names and rows of the caller's `sql`, in a READ ONLY transaction through a server-side
    cursor (rows arrive `_FETCH_ROWS` at a time: bounded memory). SqlError when it cannot run."""
    try:
        conn = psycopg.connect(dsn, connect_timeout=_QUERY_CONNECT_S, application_name="tokenway-usage-sql")
    except psycopg.Error as exc:
        raise SqlError(f"cannot connect to PostgreSQL: {exc}".strip()) from None
    conn.read_only = True
    cursor = conn.cursor(name="tokenway_usage_sql")
    cursor.itersize = _FETCH_ROWS
    try:
        cursor.execute(sql.strip().rstrip(";"))
    except psycopg.Error as exc:
        conn.close()
        raise SqlError(_explain(sql, exc)) from None
    columns = [d.name for d in cursor.description or ()]

    def rows() -> Iterator[tuple[Any, ...]]:
        try:
            yield from cursor
        except psycopg.Error as exc:
            raise SqlError(_explain(sql, exc)) from None
        finally:
            conn.close()

    return columns, rows()


def _explain(sql: str, exc: psycopg.Error) -> str:
    message = str(exc).strip()
    writes = isinstance(exc, psycopg.errors.ReadOnlySqlTransaction) or "data-modifying" in message
    if writes or not sql.lstrip().lower().startswith(_READ_VERBS):
        return f"{message}: only read-only queries (SELECT, WITH ... SELECT) run on the usage table"
    return message
