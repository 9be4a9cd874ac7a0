"""A key store write the disk refuses says so: SQLite ends the transaction itself on a full disk, and
the store's own ROLLBACK then raised "no transaction is active", hiding the cause from the operator
(the admin API's 503 `store_unavailable` names it; bench/chaos/resources.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from policies.keys.store import SqliteDirectoryStore


async def test_a_full_disk_is_named_and_the_store_writes_again_after(tmp_path: Path) -> None:
    store = SqliteDirectoryStore(tmp_path / "keys.sqlite3")
    try:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count={pages}")  # the file may not grow: a full disk
        with pytest.raises(sqlite3.OperationalError, match="full"):
            await store.write("key", "k1", '{"id": "k1", "padding": "' + "x" * 100_000 + '"}')
        store._db.execute("PRAGMA max_page_count=1073741823")  # space again
        assert await store.write("key", "k1", '{"id": "k1"}') >= 1
        assert await store.fetch("key", "k1") == '{"id": "k1"}'
    finally:
        await store.close()
