"""The audit log's record format, redaction, durability and rotation, on real files (and a real
Redis for the copy to the ledger's stream)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from gateway.app.settings import AuditConfig, RedisStreamConfig
from gateway.audit.store import KIND, MAX_LINE_BYTES, REDACTED, AuditLog, Change, Query, decode, encode, redact, stamp
from gateway.ledger.sinks import FIELD, RedisStreamExporter
from tests.support.procs import REPO


def change(n: int = 0, **fields: Any) -> Change:
    base: dict[str, Any] = {
        "actor": "admin-token",
        "client": "127.0.0.1",
        "method": "PATCH",
        "route": "/admin/keys/{key_id}",
        "status": 200,
        "target": f"key-{n}",
        "before": {"limits": {"rpm": n}},
        "after": {"limits": {"rpm": n + 1}},
    }
    return Change(**(base | fields))


class Clock:
    def __init__(self, start_s: float = 1_796_000_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


def test_a_record_names_who_what_when_and_before_and_after() -> None:
    record = stamp(change(4, request_id="req-1"), 1_796_000_000.25)
    assert record["kind"] == KIND and record["v"] == 1
    assert record["time"] == "2026-11-30T00:53:20.250Z" and record["ts"] == 1_796_000_000.25
    assert record["actor"] == "admin-token" and record["client"] == "127.0.0.1"
    assert record["action"] == "PATCH /admin/keys/{key_id}" and record["target"] == "key-4"
    assert record["before"] == {"limits": {"rpm": 4}} and record["after"] == {"limits": {"rpm": 5}}
    assert record["request_id"] == "req-1"
    line = encode(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line.rstrip(b"\n")) == record


def test_secrets_are_redacted_at_any_depth_whatever_the_handler_passed() -> None:
    reply = {
        "key": {"id": "k1", "hint": "tw-…abcd", "sha256": "e3b0c4", "limits": {"rpm": 5}},
        "secret": "tw-very-secret",
        "nested": [{"admin_token": "x", "key_hash": "y", "Authorization": "Bearer z"}],
        "previous_secrets_valid_until": ["2026-12-01T00:00:00Z"],
    }
    record = stamp(change(after=reply), 1_796_000_000.0)
    text = encode(record).decode()
    for secret in ("tw-very-secret", "e3b0c4", "Bearer z"):
        assert secret not in text
    after = record["after"]
    assert after["secret"] == REDACTED and after["key"]["sha256"] == REDACTED
    assert after["nested"][0] == {"admin_token": REDACTED, "key_hash": REDACTED, "Authorization": REDACTED}
    assert after["key"]["limits"] == {"rpm": 5} and after["key"]["hint"] == "tw-…abcd"
    assert after["previous_secrets_valid_until"] == ["2026-12-01T00:00:00Z"]  # times, not secrets
    assert redact({"deep": object()})["deep"].startswith("<object")  # never a failure to record


def test_an_oversized_object_gives_way_to_a_note_and_the_change_is_still_recorded() -> None:
    line = encode(stamp(change(after={"metadata": "x" * (2 * MAX_LINE_BYTES)}), 1_796_000_000.0))
    record = decode(line)
    assert record is not None and len(line) < MAX_LINE_BYTES
    assert record["target"] == "key-0" and str(record["after"]).startswith("omitted")


def test_lines_that_are_not_records_are_skipped() -> None:
    assert decode(b'{"kind": "admin_chan') is None
    assert decode(b'{"request_id": "r1", "ts": 1}') is None  # a usage-ledger line
    assert decode(b"[1, 2]") is None


def test_each_append_is_on_disk_when_it_returns_and_reads_back_newest_first(tmp_path: Path) -> None:
    audit = AuditLog(AuditConfig(dir=str(tmp_path / "audit")), clock=Clock())
    for n in range(5):
        audit.append(change(n))
        lines = (tmp_path / "audit" / "audit.jsonl").read_bytes().splitlines()  # another reader's view
        assert len(lines) == n + 1 and orjson.loads(lines[-1])["target"] == f"key-{n}"
    rows, more = audit.read(Query(limit=3))
    assert [r["target"] for r in rows] == ["key-4", "key-3", "key-2"] and more
    rows, more = audit.read(Query())
    assert len(rows) == 5 and not more
    assert audit.stats()["written_total"] == 5
    audit.close()


def test_filters_by_actor_action_target_and_since(tmp_path: Path) -> None:
    clock = Clock()
    audit = AuditLog(AuditConfig(dir=str(tmp_path)), clock=clock)
    audit.append(change(0, actor="loopback", method="POST", route="/admin/keys"))
    audit.append(change(1, actor="console:ab12cd34ef56"))
    middle_s = clock.now_s
    audit.append(change(2, actor="console:0123456789ab", method="DELETE"))
    audit.append(change(3, method="PUT", route="/admin/pools/{pool}/floor", target="p"))

    def targets(**query: Any) -> list[str]:
        return [r["target"] for r in audit.read(Query(**query))[0]]

    assert targets(actor="console") == ["key-2", "key-1"]
    assert targets(actor="console:ab12cd34ef56") == ["key-1"]
    assert targets(actor="console:ab") == []  # an id, not a prefix of one
    assert targets(action="keys") == ["key-2", "key-1", "key-0"]
    assert targets(action="delete /admin/keys") == ["key-2"]
    assert targets(target="p") == ["p"]
    assert targets(since_s=middle_s) == ["p", "key-2", "key-1"]
    audit.close()


@pytest.mark.slow
def test_rotation_keeps_a_bounded_number_of_files_and_reads_across_them(tmp_path: Path) -> None:
    config = AuditConfig(dir=str(tmp_path), rotate_bytes=4096, keep_files=2)
    audit = AuditLog(config, clock=Clock())
    padding = {"metadata": {"description": "d" * 900}}
    for n in range(30):
        audit.append(change(n, after=padding))
    names = sorted(p.name for p in tmp_path.glob("audit.jsonl*"))
    assert names == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.glob("audit.jsonl*"))
    rows, _ = audit.read(Query(limit=1000))
    targets = [r["target"] for r in rows]
    assert targets[0] == "key-29" and targets == [f"key-{n}" for n in range(29, 29 - len(targets), -1)]
    assert 6 <= len(targets) < 30  # the oldest are gone with the files beyond keep_files
    assert audit.rotations_total > 2
    audit.close()

    smaller = AuditLog(AuditConfig(dir=str(tmp_path), rotate_bytes=4096, keep_files=1), clock=Clock(2e9))
    for n in range(8):
        smaller.append(change(100 + n, after=padding))
    assert sorted(p.name for p in tmp_path.glob("audit.jsonl*")) == ["audit.jsonl", "audit.jsonl.1"]
    smaller.close()


def test_a_torn_last_line_of_a_crash_is_ended_and_skipped(tmp_path: Path) -> None:
    audit = AuditLog(AuditConfig(dir=str(tmp_path)), clock=Clock())
    audit.append(change(0))
    audit.close()
    with open(tmp_path / "audit.jsonl", "ab") as file:  # what a kill -9 mid-write leaves
        file.write(b'{"kind": "admin_change", "v": 1, "ti')
    again = AuditLog(AuditConfig(dir=str(tmp_path)), clock=Clock(2e9))
    assert [r["target"] for r in again.read(Query())[0]] == ["key-0"]
    again.append(change(1))
    assert [r["target"] for r in again.read(Query())[0]] == ["key-1", "key-0"]
    assert len((tmp_path / "audit.jsonl").read_bytes().splitlines()) == 3
    again.close()


def test_a_refused_write_raises_is_counted_and_the_next_one_succeeds(tmp_path: Path) -> None:
    where = tmp_path / "audit"
    audit = AuditLog(AuditConfig(dir=str(where)), clock=Clock())
    audit.append(change(0))
    audit.close()
    shutil.rmtree(where)
    where.write_bytes(b"")  # the directory is gone: the open fails as a full or broken disk would
    with pytest.raises(OSError):
        audit.append(change(1))
    assert audit.errors_total == 1 and audit.written_total == 1
    where.unlink()
    where.mkdir()
    audit.append(change(2))
    assert [r["target"] for r in audit.read(Query())[0]] == ["key-2"]
    audit.close()


WRITER = """
import sys
from gateway.app.settings import AuditConfig
from gateway.audit.store import AuditLog, Change
audit = AuditLog(AuditConfig(dir=sys.argv[1], rotate_bytes=8192, keep_files=100))
for n in range(int(sys.argv[3])):
    audit.append(Change("loopback", None, "DELETE", "/admin/keys/{key_id}", 200, f"{sys.argv[2]}-{n}"))
"""


@pytest.mark.e2e  # real processes: make unit leaves it out, make e2e runs it
def test_processes_sharing_the_directory_take_turns_and_lose_nothing(tmp_path: Path) -> None:
    """Workers of one host write one set of files: under the flock every record lands once, whole,
    in time order, and rotation by one process is followed by the others."""
    count = 150
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name, str(count)], cwd=REPO)
        for name in ("a", "b", "c")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    audit = AuditLog(AuditConfig(dir=str(tmp_path), rotate_bytes=8192, keep_files=100))
    rows, more = audit.read(Query(limit=1000))
    assert not more and len(rows) == 3 * count
    assert sorted(r["target"] for r in rows) == sorted(f"{w}-{n}" for w in "abc" for n in range(count))
    times = [r["ts"] for r in rows]
    assert times == sorted(times, reverse=True)
    files = list(tmp_path.glob("audit.jsonl*"))
    assert len(files) > 3 and all(f.stat().st_size <= 8192 for f in files)
    for name in "abc":  # each writer's own records in its order
        mine = [int(r["target"].split("-")[1]) for r in reversed(rows) if r["target"].startswith(name)]
        assert mine == list(range(count))


@pytest.mark.redis
def test_records_are_copied_to_the_ledgers_redis_stream_under_their_own_key(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    stream = f"{redis_prefix}:audit"
    exporter = RedisStreamExporter(RedisStreamConfig(url=redis_url, stream=stream))
    audit = AuditLog(AuditConfig(dir=str(tmp_path)), sink=exporter, clock=Clock())
    written = [audit.append(change(n)) for n in range(3)]
    audit.close()  # sends what is queued
    entries: Any = redis.Redis.from_url(redis_url).xrange(stream)
    assert [orjson.loads(fields[FIELD]) for _, fields in entries] == written
    assert audit.stats()["redis_exported_total"] == 3
