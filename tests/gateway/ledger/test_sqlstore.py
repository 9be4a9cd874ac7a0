"""The embedded SQL store: incremental ingestion of the ledger files, read-only queries, the CLI."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.app.settings import LedgerConfig
from gateway.ledger.cli import main
from gateway.ledger.reader import iter_entries
from gateway.ledger.sqlstore import SqlError, db_path, entry_to_row, entry_to_sqlite_row, ingest, query
from gateway.ledger.writer import LedgerWriter, encode, record_to_entry
from tests.gateway.ledger.records import make_record

NOW = time.time()


def write(directory: Path, start: int, count: int) -> None:
    """`count` records in a new file (the writer rotates at every start)."""
    writer = LedgerWriter(LedgerConfig(dir=str(directory), fsync=False))
    for i in range(start, start + count):
        writer.append(make_record(i, started_at_unix_s=NOW - 600))
    writer.close_sync()


def rows(directory: Path, sql: str) -> list[tuple[Any, ...]]:
    _, it = query(db_path(directory), sql)
    return list(it)


def count(directory: Path) -> int:
    return int(rows(directory, "SELECT count(*) FROM usage")[0][0])


def test_each_line_is_loaded_once_across_files_and_runs(tmp_path: Path) -> None:
    write(tmp_path, 0, 50)
    stats = ingest(tmp_path, batch_rows=7)  # several transactions per file
    assert (stats.files, stats.rows) == (1, 50)
    assert count(tmp_path) == 50
    assert ingest(tmp_path).rows == 0  # nothing new: nothing read
    write(tmp_path, 50, 30)  # a second run of the gateway: a new file
    stats = ingest(tmp_path)
    assert (stats.files, stats.rows) == (1, 30)
    assert count(tmp_path) == 80
    ids = rows(tmp_path, "SELECT count(DISTINCT request_id) FROM usage")[0][0]
    assert ids == 80


def test_the_active_file_has_only_its_new_lines_added(tmp_path: Path) -> None:
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path), fsync=False))
    try:
        for i in range(10):
            writer.append(make_record(i, started_at_unix_s=NOW - 600))
        assert writer.flush_sync()
        assert ingest(tmp_path).rows == 10
        for i in range(10, 25):
            writer.append(make_record(i, started_at_unix_s=NOW - 600))
        assert writer.flush_sync()
        assert ingest(tmp_path).rows == 15
    finally:
        writer.close_sync()
    assert count(tmp_path) == 25
    assert rows(tmp_path, "SELECT min(request_id), max(request_id) FROM usage")[0] == ("req-00000000", "req-00000024")


def test_rotation_inside_one_run(tmp_path: Path) -> None:
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path), fsync=False, rotate_bytes=4096))
    for i in range(40):
        writer.append(make_record(i, started_at_unix_s=NOW - 600))
        if i % 5 == 4:
            assert writer.flush_sync()
            if i == 19:
                ingest(tmp_path)
    writer.close_sync()
    assert len(list(tmp_path.glob("*.jsonl"))) > 2
    ingest(tmp_path)
    assert count(tmp_path) == 40 == len(list(iter_entries(tmp_path)))


def test_a_torn_last_line_waits_while_its_file_may_grow_then_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "usage-20250101-001.jsonl"
    whole = encode(make_record(1))
    torn = encode(make_record(2))[:40]
    path.write_bytes(whole + torn)
    stats = ingest(tmp_path)
    assert (stats.rows, stats.skipped_lines) == (1, 0)  # the newest file: maybe mid-write
    with path.open("ab") as f:  # the writer finishes the line
        f.write(encode(make_record(2))[40:])
    assert ingest(tmp_path).rows == 1
    with path.open("ab") as f:  # then crashes mid-line
        f.write(encode(make_record(3))[:30])
    assert ingest(tmp_path).rows == 0
    (tmp_path / "usage-20250101-002.jsonl").write_bytes(encode(make_record(4)))  # restarted: a new file
    warnings: list[str] = []
    stats = ingest(tmp_path, warn=warnings.append)
    assert (stats.rows, stats.skipped_lines) == (1, 1)
    assert "torn last line" in warnings[0]
    assert sorted(r[0] for r in rows(tmp_path, "SELECT request_id FROM usage")) == [
        "req-00000001",
        "req-00000002",
        "req-00000004",
    ]


def test_a_whole_last_object_without_its_newline_is_kept_once(tmp_path: Path) -> None:
    path = tmp_path / "usage-20250101-001.jsonl"
    path.write_bytes(encode(make_record(1)) + encode(make_record(2)).rstrip(b"\n"))
    assert ingest(tmp_path).rows == 2
    with path.open("ab") as f:
        f.write(b"\n" + encode(make_record(3)))
    assert ingest(tmp_path).rows == 1
    assert count(tmp_path) == 3 == len(list(iter_entries(tmp_path)))


def test_corrupt_lines_and_unknown_fields(tmp_path: Path) -> None:
    entry = record_to_entry(make_record(1))
    odd = {**entry, "request_id": "req-odd", "input_tokens": "many", "future_field": {"a": 1}}
    lines = [
        orjson.dumps(entry) + b"\n",
        b"not json\n",
        b'{"no_ts": 1}\n',
        orjson.dumps(odd) + b"\n",
    ]
    (tmp_path / "usage-20250101-001.jsonl").write_bytes(b"".join(lines))
    stats = ingest(tmp_path, warn=lambda m: None)
    assert (stats.rows, stats.skipped_lines) == (2, 2)
    (tokens, other) = rows(tmp_path, "SELECT input_tokens, other FROM usage WHERE request_id = 'req-odd'")[0]
    assert tokens is None  # a value that does not fit its column is kept in `other`
    assert json.loads(other) == {"input_tokens": "many", "future_field": {"a": 1}}
    assert rows(tmp_path, "SELECT json_extract(other, '$.future_field.a') FROM usage WHERE other IS NOT NULL") == [(1,)]


@pytest.mark.parametrize("new_records", [3, 8])  # shorter than what was read, and longer
def test_a_new_file_under_a_name_already_read_is_read_as_new(tmp_path: Path, new_records: int) -> None:
    path = tmp_path / "usage-20250101-001.jsonl"
    path.write_bytes(b"".join(encode(make_record(i)) for i in range(5)))
    ingest(tmp_path)
    path.write_bytes(b"".join(encode(make_record(i)) for i in range(100, 100 + new_records)))
    stats = ingest(tmp_path, warn=lambda m: None)
    assert (stats.replaced_files, stats.rows) == (1, new_records)
    assert count(tmp_path) == 5 + new_records  # the old file's rows stay, as a deleted file's do


def test_rows_stay_when_their_files_are_deleted(tmp_path: Path) -> None:
    write(tmp_path, 0, 5)
    ingest(tmp_path)
    for path in tmp_path.glob("*.jsonl"):
        path.unlink()  # retention, or an operator emptying the directory
    write(tmp_path, 5, 5)  # the next run may take the same name again
    ingest(tmp_path, warn=lambda m: None)
    assert count(tmp_path) == 10


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM usage",
        "UPDATE usage SET cost_usd = 0",
        "INSERT INTO usage (ts, file_id) VALUES (1, 1)",
        "DROP TABLE usage",
        "CREATE TABLE x (a)",
        "CREATE TEMP TABLE x (a)",
        "ATTACH DATABASE 'elsewhere.sqlite' AS other",
        "PRAGMA journal_mode=DELETE",
        "PRAGMA query_only=OFF",
        "VACUUM",
        "WITH gone AS (SELECT 1) DELETE FROM usage",
        "UPDATE sqlite_master SET sql = '' WHERE name = 'usage'",
        "PRAGMA writable_schema=ON",
    ],
)
def test_queries_cannot_alter_the_store(tmp_path: Path, sql: str) -> None:
    write(tmp_path, 0, 5)
    ingest(tmp_path)
    with pytest.raises(SqlError, match=r"read-only|not authorized"):
        _, it = query(db_path(tmp_path), sql)
        list(it)
    assert count(tmp_path) == 5
    assert not (tmp_path / "elsewhere.sqlite").exists()
    conn = sqlite3.connect(db_path(tmp_path))
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
        "usage",
        "ledger_files",
    }
    conn.close()


def test_schema_introspection_is_allowed(tmp_path: Path) -> None:
    write(tmp_path, 0, 1)
    ingest(tmp_path)
    names = [r[1] for r in rows(tmp_path, "PRAGMA table_info(usage)")]
    assert {"tenant", "cost_usd", "ts", "extra", "other"} <= set(names)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["usage", "sql", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_totals_match_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, 0, 60)
    sql = "SELECT tenant, count(*) AS requests, sum(cost_usd) AS cost_usd FROM usage GROUP BY tenant ORDER BY tenant"
    status, out, _ = cli(capsys, sql, "--dir", str(tmp_path), "--format", "json")
    assert status == 0
    got = {r["tenant"]: r for r in json.loads(out)}
    assert main(["usage", "report", "--dir", str(tmp_path), "--by", "tenant", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(got) == len(report["groups"]) == 3
    for group in report["groups"]:
        assert got[group["tenant"]]["requests"] == group["requests"]
        assert got[group["tenant"]]["cost_usd"] == pytest.approx(group["cost_usd"])


def test_cli_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, 0, 6)
    sql = "SELECT tenant, count(*) AS n FROM usage GROUP BY 1 ORDER BY 1"
    status, out, _ = cli(capsys, sql, "--dir", str(tmp_path), "--format", "csv")
    assert status == 0 and out.splitlines() == ["tenant,n", "acme,2", "globex,2", "initech,2"]
    status, out, _ = cli(capsys, sql, "--dir", str(tmp_path))
    lines = out.splitlines()
    assert status == 0 and lines[0].split() == ["tenant", "n"] and lines[2].split() == ["acme", "2"]
    assert lines[-1] == "(3 rows)"
    status, out, _ = cli(capsys, "SELECT 1 WHERE 0", "--dir", str(tmp_path), "--format", "json")
    assert status == 0 and json.loads(out) == []


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELEC tenant FROM usage", "syntax error"),
        ("SELECT nope FROM usage", "no such column"),
        ("DELETE FROM usage", "only read-only queries"),
        ("SELECT 1; SELECT 2", "one statement"),
    ],
)
def test_cli_bad_sql_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sql: str, message: str
) -> None:
    write(tmp_path, 0, 3)
    status, out, err = cli(capsys, sql, "--dir", str(tmp_path))
    assert status == 2
    assert err.startswith("tokenway usage sql: ") and message in err
    assert "Traceback" not in err and out == ""


def test_cli_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = cli(capsys, "SELECT 1", "--dir", str(tmp_path / "absent"))
    assert status == 1 and "no ledger directory" in err


def test_cli_store_elsewhere_and_no_ingest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger, store = tmp_path / "usage", tmp_path / "elsewhere.sqlite"
    write(ledger, 0, 4)
    status, out, _ = cli(capsys, "SELECT count(*) FROM usage", "--dir", str(ledger), "--store", str(store))
    assert status == 0 and "4" in out and store.is_file() and not db_path(ledger).exists()
    write(ledger, 4, 4)
    argv = ("SELECT count(*) AS n FROM usage", "--dir", str(ledger), "--store", str(store), "--format", "csv")
    status, out, _ = cli(capsys, *argv, "--no-ingest")
    assert status == 0 and out.splitlines()[1] == "4"
    status, out, _ = cli(capsys, *argv)
    assert status == 0 and out.splitlines()[1] == "8"


def test_two_ingests_at_once_load_each_line_once(tmp_path: Path) -> None:
    """Each batch re-reads its file's offset under SQLite's write lock (two `usage sql` at once)."""
    write(tmp_path, 0, 300)
    write(tmp_path, 300, 300)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ingest(tmp_path, batch_rows=25)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert count(tmp_path) == 600
    assert rows(tmp_path, "SELECT count(DISTINCT request_id) FROM usage") == [(600,)]


def test_the_fast_row_path_equals_the_checked_one() -> None:
    entries = [record_to_entry(make_record(i)) for i in range(40)]
    rich = make_record(1, slo_class="interactive", queue_ms=3.5, cache_write_tokens=7, reasoning_tokens=2, leg=2)
    entries.append(record_to_entry(rich))
    base = entries[0]
    entries += [
        {**base, "stream": 1},  # an integer where a boolean belongs
        {**base, "http_status": True},  # a boolean where an integer belongs
        {**base, "output_tokens": 2**63},  # past 64 bits
        {**base, "cost_usd": 3},  # an integer in a real column fits
        {**base, "newer": "field"},
        {**base, "extra": "not an object"},
    ]
    for entry in entries:
        assert entry_to_sqlite_row(entry) == entry_to_row(entry), entry


def test_json_columns_are_queryable(tmp_path: Path) -> None:
    base = record_to_entry(make_record(1))
    lines = [
        {**base, "request_id": "a", "user": "u-1", "tags": ["team-a", "batch"], "extra": {"slo_class": "fast"}},
        {**base, "request_id": "b", "tags": ["team-a"]},
    ]
    (tmp_path / "usage-20250101-001.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
    ingest(tmp_path)
    tags = "SELECT t.value, count(*) FROM usage, json_each(usage.tags) AS t GROUP BY 1 ORDER BY 1"
    assert rows(tmp_path, tags) == [("batch", 1), ("team-a", 2)]
    slo = "SELECT user, json_extract(extra, '$.slo_class') FROM usage WHERE request_id = 'a'"
    assert rows(tmp_path, slo) == [("u-1", "fast")]
