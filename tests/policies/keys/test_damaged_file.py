"""The key store's SQLite file read back damaged (bench/chaos/disk_fuzz.py): a file that is there but
cannot be read whole stops start-up with one line naming it (`KeyStoreDamaged`), never a traceback
and never a store served with its keys silently missing; a file that is not there is a first start,
said so in the log."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from policies.keys.store import KeyStoreDamaged, SqliteDirectoryStore
from policies.loader import PolicyFileError


def _store_with_keys(path: Path, count: int = 300) -> None:
    async def fill() -> None:
        store = SqliteDirectoryStore(path)
        for n in range(count):
            await store.write("key", f"key-{n}", f'{{"id": "key-{n}", "padding": "{"x" * 200}"}}')
        await store.close()

    asyncio.run(fill())


def test_a_file_that_is_not_a_database_stops_start_up_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    path.write_bytes(b"2594\n" + b"not a database" * 100)
    with pytest.raises(KeyStoreDamaged) as caught:
        SqliteDirectoryStore(path)
    assert isinstance(caught.value, PolicyFileError)  # start-up prints its one line (gateway/app/server.py)
    assert str(path) in str(caught.value) and "restore the file from a backup" in str(caught.value)
    assert path.read_bytes().startswith(b"2594\n")  # nothing written over what is left of it


def test_an_empty_file_is_not_read_as_an_empty_store(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    path.write_bytes(b"")
    with pytest.raises(KeyStoreDamaged, match="empty"):
        SqliteDirectoryStore(path)


def test_a_directory_in_the_files_place_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    path.mkdir()
    with pytest.raises(KeyStoreDamaged):
        SqliteDirectoryStore(path)


def test_pages_overwritten_inside_the_file_fail_its_check(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    _store_with_keys(path)
    data = bytearray(path.read_bytes())
    page = 4096 * 3  # a b-tree page of the documents, past the header SQLite checks at open
    data[page : page + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(KeyStoreDamaged):
        SqliteDirectoryStore(path)


def test_a_missing_file_is_a_first_start_said_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "var" / "keys.sqlite3"
    with caplog.at_level(logging.WARNING, logger="policies.keys.store"):
        store = SqliteDirectoryStore(path)
    assert any(str(path) in r.getMessage() and "not found" in r.getMessage() for r in caplog.records)
    asyncio.run(store.close())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="policies.keys.store"):
        again = SqliteDirectoryStore(path)  # there now: opened without a word
    assert not caplog.records
    asyncio.run(again.close())


def test_a_last_use_that_is_no_number_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    _store_with_keys(path, count=1)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO last_used (id, at_s) VALUES ('good', 5.0), ('text', 'abc'), ('blob', x'ff')")
    db.commit()
    db.close()

    async def read() -> dict[str, float]:
        store = SqliteDirectoryStore(path)
        try:
            return await store.last_used()
        finally:
            await store.close()

    assert asyncio.run(read()) == {"good": 5.0}


def test_a_document_whose_bytes_are_no_longer_utf8_costs_that_document_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file passes SQLite's check (its pages are whole) but one document's text is no longer
    UTF-8: the load reads every other document, and says how many it read with replacement characters."""
    path = tmp_path / "keys.sqlite3"
    _store_with_keys(path, count=3)
    db = sqlite3.connect(path)
    db.execute("UPDATE docs SET doc = CAST(x'7b22696422ff' AS TEXT) WHERE name = 'key-1'")  # {"id"\xff
    db.commit()
    db.close()

    async def read() -> tuple[dict[str, str], str | None]:
        store = SqliteDirectoryStore(path)
        try:
            return (await store.load()).docs["key"], await store.fetch("key", "key-1")
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, logger="policies.keys.store"):
        docs, fetched = asyncio.run(read())
    assert sorted(docs) == ["key-0", "key-1", "key-2"] and docs["key-0"].startswith('{"id": "key-0"')
    assert docs["key-1"] == fetched == '{"id"\ufffd'  # read as what it is: no key (index.py names it)
    assert any("1 documents hold bytes that are not UTF-8" in r.getMessage() for r in caplog.records)
