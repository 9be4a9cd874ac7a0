from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from gateway.ledger.reader import ReadStats, iter_entries, ledger_files
from gateway.ledger.writer import encode
from tests.gateway.ledger.records import make_record


def write(path: Path, *chunks: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(chunks))


def test_files_are_read_in_commit_order(tmp_path: Path) -> None:
    for name, i in (("usage-20250102-010.jsonl", 4), ("usage-20250102-002.jsonl", 3),
                    ("usage-20250101-1000.jsonl", 2), ("usage-20250101-999.jsonl", 1)):  # fmt: skip
        write(tmp_path / name, encode(make_record(i)))
    (tmp_path / "notes.txt").write_text("ignored")
    assert [p.name for p in ledger_files(tmp_path)] == [
        "usage-20250101-999.jsonl", "usage-20250101-1000.jsonl", "usage-20250102-002.jsonl", "usage-20250102-010.jsonl",
    ]  # fmt: skip
    assert [e["request_id"] for e in iter_entries(tmp_path)] == [f"req-{i:08d}" for i in (1, 2, 3, 4)]


def test_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    whole = encode(make_record(1))
    torn = encode(make_record(2))[:-40]
    write(tmp_path / "usage-20250101-001.jsonl", whole, torn)
    write(tmp_path / "usage-20250101-002.jsonl", encode(make_record(3)))
    warnings: list[str] = []
    stats = ReadStats()
    ids = [e["request_id"] for e in iter_entries(tmp_path, stats=stats, warn=warnings.append)]
    assert ids == ["req-00000001", "req-00000003"]
    assert stats.torn_lines == 1 and stats.corrupt_lines == 0
    assert len(warnings) == 1 and "usage-20250101-001.jsonl:2: torn last line" in warnings[0]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    write(tmp_path / "usage-20250101-001.jsonl", encode(make_record(1))[:-1])
    stats = ReadStats()
    assert len(list(iter_entries(tmp_path, stats=stats))) == 1
    assert stats.torn_lines == 0


def test_corrupt_line_is_named_by_file_and_line(tmp_path: Path) -> None:
    write(
        tmp_path / "usage-20250101-001.jsonl",
        encode(make_record(1)),
        b'{"v":1,"request_id":"x",GARBAGE\n',
        b"[1,2,3]\n",
        b'{"v":1,"request_id":"no-ts"}\n',
        b"\n",
        encode(make_record(2)),
    )
    warnings: list[str] = []
    stats = ReadStats()
    ids = [e["request_id"] for e in iter_entries(tmp_path, stats=stats, warn=warnings.append)]
    assert ids == ["req-00000001", "req-00000002"]
    assert stats.corrupt_lines == 3
    assert [w.split(": ")[0].rsplit("/", 1)[-1] for w in warnings] == [
        "usage-20250101-001.jsonl:2", "usage-20250101-001.jsonl:3", "usage-20250101-001.jsonl:4",
    ]  # fmt: skip


def test_since_and_until_filter_on_finish_time_and_skip_older_files(tmp_path: Path) -> None:
    day1 = datetime(2025, 1, 1, 12, tzinfo=UTC).timestamp()
    day2 = datetime(2025, 1, 2, 12, tzinfo=UTC).timestamp()
    write(tmp_path / "usage-20250101-001.jsonl", encode(make_record(1, started_at_unix_s=day1)))
    write(
        tmp_path / "usage-20250102-001.jsonl",
        encode(make_record(2, started_at_unix_s=day2)),
        encode(make_record(3, started_at_unix_s=day2 + 3600)),
    )
    stats = ReadStats()
    since = day2 - 60
    ids = [e["request_id"] for e in iter_entries(tmp_path, since_unix_s=since, stats=stats)]
    assert ids == ["req-00000002", "req-00000003"]
    assert stats.files == 1, "a file dated before --since is not opened"
    until = [e["request_id"] for e in iter_entries(tmp_path, since_unix_s=since, until_unix_s=day2 + 60)]
    assert until == ["req-00000002"]
