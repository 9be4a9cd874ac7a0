from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.app.settings import LedgerConfig
from gateway.ledger import open_ledger
from gateway.ledger.reader import ReadStats, iter_entries, ledger_files
from gateway.ledger.writer import LedgerWriter
from tests.gateway.ledger.records import make_record


def read_ids(directory: Path) -> list[str]:
    return [e["request_id"] for e in iter_entries(directory)]


def config(tmp_path: Path, **overrides: object) -> LedgerConfig:
    return LedgerConfig.model_validate({"dir": str(tmp_path / "usage"), "commit_interval_ms": 20, **overrides})


async def test_close_writes_every_record_in_order(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path))
    for i in range(500):
        writer.append(make_record(i))
    await writer.close()
    assert read_ids(writer.dir) == [f"req-{i:08d}" for i in range(500)]
    stats = writer.stats()
    assert stats["appended_total"] == stats["written_total"] == 500
    assert stats["dropped_total"] == 0 and stats["pending_records"] == 0
    # one file, fsynced as it closed; the sync thread adds at most one fsync per group commit
    assert stats["files_total"] == 1
    assert stats["files_total"] <= stats["fsyncs_total"] <= stats["commits_total"] + stats["files_total"]


async def test_flush_makes_records_readable_while_open(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path, commit_interval_ms=60_000))  # only the flush can commit
    writer.append(make_record(1))
    writer.append(make_record(2))
    assert await writer.flush()
    assert read_ids(writer.dir) == ["req-00000001", "req-00000002"]
    await writer.close()


async def test_records_are_committed_in_groups_without_a_flush(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path, commit_interval_ms=10))
    for i in range(200):
        writer.append(make_record(i))
    while writer.written_total < 200:  # the writer thread commits on its own
        await _sleep(0.01)
    assert writer.commits_total <= 200
    assert len(read_ids(writer.dir)) == 200
    await writer.close()


async def test_rotation_by_size_keeps_lines_whole(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path, rotate_bytes=4096))
    for i in range(300):
        writer.append(make_record(i))
        await writer.flush()  # one record per group: files end before they would pass 4096 bytes
    await writer.close()
    files = ledger_files(writer.dir)
    assert len(files) > 5
    assert all(f.read_bytes().endswith(b"\n") for f in files)
    assert all(f.stat().st_size <= 4096 for f in files)
    stats = ReadStats()
    ids = [e["request_id"] for e in iter_entries(writer.dir, stats=stats)]
    assert ids == [f"req-{i:08d}" for i in range(300)]
    assert stats.corrupt_lines == stats.torn_lines == 0


async def test_rotation_at_utc_midnight_and_on_restart(tmp_path: Path) -> None:
    now = [datetime(2025, 3, 1, 23, 59, 59, tzinfo=UTC).timestamp()]
    writer = LedgerWriter(config(tmp_path), wall_clock_s=lambda: now[0])
    writer.append(make_record(1))
    await writer.flush()
    now[0] += 2  # 2025-03-02 00:00:01
    writer.append(make_record(2))
    await writer.flush()
    await writer.close()
    again = LedgerWriter(config(tmp_path), wall_clock_s=lambda: now[0])
    again.append(make_record(3))
    await again.close()
    names = [f.name for f in ledger_files(writer.dir)]
    assert names == ["usage-20250301-001.jsonl", "usage-20250302-001.jsonl", "usage-20250302-002.jsonl"]
    assert read_ids(writer.dir) == ["req-00000001", "req-00000002", "req-00000003"]


async def test_no_file_without_records(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path))
    await writer.close()
    assert ledger_files(writer.dir) == []


async def test_retention_deletes_old_files_of_its_prefix_only(tmp_path: Path) -> None:
    directory = tmp_path / "usage"
    directory.mkdir()
    for name in ("usage-20200101-001.jsonl", "other-20200101-001.jsonl", "usage-20991231-001.jsonl"):
        (directory / name).write_text("")
    writer = LedgerWriter(config(tmp_path, retain_days=30))
    writer.append(make_record(1))
    await writer.close()
    names = sorted(p.name for p in directory.iterdir())
    assert "usage-20200101-001.jsonl" not in names
    assert {"other-20200101-001.jsonl", "usage-20991231-001.jsonl"} <= set(names)


async def test_append_after_close_is_dropped_and_counted(tmp_path: Path) -> None:
    writer = LedgerWriter(config(tmp_path))
    await writer.close()
    writer.append(make_record(1))
    assert writer.stats()["dropped_total"] == 1
    await writer.close()  # idempotent


async def test_disk_errors_are_retried_and_overflow_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = LedgerWriter(config(tmp_path, max_pending_records=50))
    writer.append(make_record(0))
    await writer.flush()
    real_write = os.write
    calls = [0]

    def flaky_write(fd: int, data: bytes | memoryview) -> int:
        # as POSIX does it: a short write returns its count, the next call reports the full disk
        calls[0] += 1
        if calls[0] == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky_write)
    for i in range(1, 31):
        writer.append(make_record(i))
    await writer.flush(timeout_s=0.5)  # the failed group is kept for retry
    for i in range(31, 101):
        writer.append(make_record(i))
    await writer.close()
    stats = writer.stats()
    assert stats["write_errors_total"] == 1
    assert stats["dropped_total"] > 0
    assert stats["written_total"] + stats["dropped_total"] == 101
    read = ReadStats()
    ids = [e["request_id"] for e in iter_entries(writer.dir, stats=read)]
    assert read.corrupt_lines == 0, "the half-written group is completed, not duplicated"
    assert ids[:31] == [f"req-{i:08d}" for i in range(31)]
    assert len(ids) == len(set(ids)) == stats["written_total"]


async def test_a_disk_that_keeps_failing_is_logged_once_then_its_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer retries a failed write every interval: a full disk logged each time flooded the log
    with tracebacks (ten a second); one with its traceback per spell, and one when writes work again."""
    writer = LedgerWriter(config(tmp_path, commit_interval_ms=10))
    real_write = os.write
    failures = [0]

    def full_disk(fd: int, data: bytes | memoryview) -> int:
        if failures[0] < 20:
            failures[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with caplog.at_level(logging.WARNING, logger="tokenway.ledger"):
        writer.append(make_record(0))
        assert await writer.flush(timeout_s=10)
        await writer.close()
    assert writer.stats()["write_errors_total"] == 20
    logged = [r for r in caplog.records if r.name == "tokenway.ledger"]
    assert [r.exc_info is not None for r in logged] == [True, False], [r.getMessage() for r in logged]
    assert "work again" in logged[-1].getMessage()
    assert [e["request_id"] for e in iter_entries(writer.dir)] == ["req-00000000"]


class ListSink:
    def __init__(self) -> None:
        self.groups: list[list[bytes]] = []
        self.closed = False

    def submit(self, lines: Sequence[bytes]) -> None:
        self.groups.append(list(lines))

    def stats(self) -> dict[str, float]:
        return {"sink_groups_total": len(self.groups)}

    def close_sync(self, timeout_s: float = 5.0) -> None:
        self.closed = True


async def test_sink_gets_each_committed_group_and_is_closed(tmp_path: Path) -> None:
    sink = ListSink()
    writer = LedgerWriter(config(tmp_path), sink=sink)
    for i in range(10):
        writer.append(make_record(i))
    await writer.close()
    assert sum(len(g) for g in sink.groups) == 10
    assert sink.closed
    assert writer.stats()["sink_groups_total"] == len(sink.groups)


def test_open_ledger_honours_enabled(tmp_path: Path) -> None:
    assert open_ledger(config(tmp_path, enabled=False)) is None
    writer = open_ledger(config(tmp_path))
    assert isinstance(writer, LedgerWriter)
    writer.close_sync()


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
