"""Keys and tenants in a local SQLite file (the embedded default: `state: memory`, `var/keys.sqlite3`).

One process owns the file. Every call runs in a worker thread (sqlite3 blocks), serialised by a
lock over one connection; the gateway only calls it when an operator changes something or, every
few seconds, to save last-use times, never per request. WAL journaling keeps a crash from
corrupting the file and lets `tokenway keys list` read it while the gateway writes.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from policies.keys.store import Change, Kind, Snapshot

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (kind TEXT NOT NULL, name TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (kind, name));
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS last_used (id TEXT PRIMARY KEY, at_s REAL NOT NULL);
INSERT OR IGNORE INTO meta (k, v) VALUES ('version', 0);
"""


class SqliteDirectoryStore:
    name = "sqlite"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn(self._db)

        return await asyncio.to_thread(locked)

    async def load(self) -> Snapshot:
        def read(db: sqlite3.Connection) -> Snapshot:
            snapshot = Snapshot(_version(db))
            for kind, name, doc in db.execute("SELECT kind, name, doc FROM docs"):
                if kind in snapshot.docs:
                    snapshot.docs[kind][name] = doc
            return snapshot

        return await self._run(read)

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        def write(db: sqlite3.Connection) -> int:
            db.execute("BEGIN IMMEDIATE")
            try:
                if doc is None:
                    db.execute("DELETE FROM docs WHERE kind = ? AND name = ?", (kind, name))
                else:
                    db.execute("INSERT OR REPLACE INTO docs (kind, name, doc) VALUES (?, ?, ?)", (kind, name, doc))
                db.execute("UPDATE meta SET v = v + 1 WHERE k = 'version'")
                version = _version(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return version

        return await self._run(write)

    async def fetch(self, kind: Kind, name: str) -> str | None:
        def read(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT doc FROM docs WHERE kind = ? AND name = ?", (kind, name)).fetchone()
            return None if row is None else str(row[0])

        return await self._run(read)

    async def version(self) -> int:
        return await self._run(_version)

    async def touch(self, last_used: dict[str, float]) -> None:
        rows = list(last_used.items())

        def write(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT INTO last_used (id, at_s) VALUES (?, ?) "
                "ON CONFLICT(id) DO UPDATE SET at_s = max(at_s, excluded.at_s)",
                rows,
            )

        if rows:
            await self._run(write)

    async def last_used(self) -> dict[str, float]:
        def read(db: sqlite3.Connection) -> dict[str, float]:
            return {str(i): float(t) for i, t in db.execute("SELECT id, at_s FROM last_used")}

        return await self._run(read)

    async def put(self, kind: Kind, name: str, doc: str | None, version: int | None) -> None:
        """Keep a document as another store wrote it (this file as that store's durable copy):
        the version is the other store's, kept when it is newer, never incremented here."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                _put(db, kind, name, doc)
                if version is not None:
                    db.execute("UPDATE meta SET v = max(v, ?) WHERE k = 'version'", (version,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._run(write)

    async def replace_all(self, snapshot: Snapshot) -> None:
        """Make this file hold exactly `snapshot` (a whole copy of the store it backs)."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM docs")
                for kind, docs in snapshot.docs.items():
                    for name, doc in docs.items():
                        _put(db, kind, name, doc)
                db.execute("UPDATE meta SET v = ? WHERE k = 'version'", (snapshot.version,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._run(write)

    def changes(self) -> AsyncIterator[Change] | None:
        return None

    async def close(self) -> None:
        await self._run(lambda db: db.close())


def _put(db: sqlite3.Connection, kind: str, name: str, doc: str | None) -> None:
    if doc is None:
        db.execute("DELETE FROM docs WHERE kind = ? AND name = ?", (kind, name))
    else:
        db.execute("INSERT OR REPLACE INTO docs (kind, name, doc) VALUES (?, ?, ?)", (kind, name, doc))


def _version(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT v FROM meta WHERE k = 'version'").fetchone()
    return int(row[0]) if row else 0
