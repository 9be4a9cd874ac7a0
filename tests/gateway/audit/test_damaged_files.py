"""The audit log's files read back damaged (bench/chaos/disk_fuzz.py): a directory in the current file's
place is set aside at start (else every admin change would be made, answered and never recorded), a
line longer than any record is passed over a chunk at a time, and a file longer than the writer lets
one grow is read from its last `rotate_bytes` only."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.app.settings import AuditConfig
from gateway.audit.store import AuditLog, Change, Query, encode, stamp


def change(n: int) -> Change:
    return Change("admin-token", "127.0.0.1", "PATCH", "/admin/keys/{key_id}", 200, target=f"key-{n}")


def test_a_directory_where_the_current_file_goes_is_set_aside_and_changes_are_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "audit.jsonl").mkdir()
    with caplog.at_level(logging.WARNING, logger="tokenway.audit"):
        audit = AuditLog(AuditConfig(dir=str(tmp_path)))
    try:
        audit.append(change(1))
        found, _ = audit.read(Query())
        assert [r["target"] for r in found] == ["key-1"]
        assert (tmp_path / "audit.jsonl.corrupt-1").is_dir()
        assert len(caplog.records) == 1 and "set aside" in caplog.records[0].getMessage()
    finally:
        audit.close()


def test_records_around_a_huge_line_are_read_and_the_line_is_never_held(tmp_path: Path) -> None:
    first, second = encode(stamp(change(1), 1_796_000_000.0)), encode(stamp(change(2), 1_796_000_001.0))
    (tmp_path / "audit.jsonl").write_bytes(first + b"x" * (3 << 20) + b"\n" + second)
    audit = AuditLog(AuditConfig(dir=str(tmp_path), rotate_bytes=64 << 20))
    try:
        found, _ = audit.read(Query())
        assert [r["target"] for r in found] == ["key-2", "key-1"]
    finally:
        audit.close()


def test_a_file_longer_than_the_writer_lets_one_grow_is_read_from_its_tail(tmp_path: Path) -> None:
    old, new = encode(stamp(change(1), 1_796_000_000.0)), encode(stamp(change(2), 1_796_000_001.0))
    rotate = 8192
    (tmp_path / "audit.jsonl").write_bytes(old + b"y" * (1 << 20) + b"\n" + new)
    audit = AuditLog(AuditConfig(dir=str(tmp_path), rotate_bytes=rotate))
    try:
        assert len(audit._lines_of(tmp_path / "audit.jsonl")) == 1  # the tail: the newest record only
        found, _ = audit.read(Query())
        assert [r["target"] for r in found] == ["key-2"]
    finally:
        audit.close()
