"""The Redis stream copy, against a real Redis: every committed record arrives once, and a dead
Redis costs the file ledger nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import redis

from gateway.app.settings import LedgerConfig, RedisStreamConfig
from gateway.ledger.reader import iter_entries
from gateway.ledger.sinks import FIELD, RedisStreamExporter
from gateway.ledger.writer import LedgerWriter
from tests.gateway.ledger.records import make_record
from tests.support.procs import free_port


async def test_committed_records_reach_the_stream(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    stream = f"{redis_prefix}:usage"
    exporter = RedisStreamExporter(RedisStreamConfig(url=redis_url, stream=stream, maxlen=100_000))
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path / "usage"), commit_interval_ms=10), sink=exporter)
    for i in range(2500):  # more than one pipeline chunk
        writer.append(make_record(i))
    await writer.close()  # closes the exporter after sending what is queued
    client = redis.Redis.from_url(redis_url)
    entries: Any = client.xrange(stream)
    ids = [orjson.loads(fields[FIELD])["request_id"] for _, fields in entries]
    assert ids == [f"req-{i:08d}" for i in range(2500)]
    stats = writer.stats()
    assert stats["redis_exported_total"] == 2500 and stats["redis_errors_total"] == 0


async def test_maxlen_caps_the_stream(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    stream = f"{redis_prefix}:capped"
    exporter = RedisStreamExporter(RedisStreamConfig(url=redis_url, stream=stream, maxlen=100))
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path / "usage")), sink=exporter)
    for i in range(3000):
        writer.append(make_record(i))
    await writer.close()
    length = redis.Redis.from_url(redis_url).xlen(stream)
    assert 100 <= length < 3000  # MAXLEN ~ trims whole macro nodes, so a little over the cap


async def test_dead_redis_is_counted_and_the_file_ledger_is_intact(tmp_path: Path) -> None:
    config = RedisStreamConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, max_pending_batches=2)
    exporter = RedisStreamExporter(config)
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path / "usage"), commit_interval_ms=5), sink=exporter)
    for i in range(300):
        writer.append(make_record(i))
        if i % 50 == 0:
            await writer.flush()
    await writer.close()
    assert len(list(iter_entries(writer.dir))) == 300
    stats = writer.stats()
    assert stats["redis_errors_total"] == stats["redis_round_trips_total"] > 0  # every round trip failed
    assert stats["redis_exported_total"] == 0
    assert stats["redis_dropped_total"] == 300 and stats["redis_pending_batches"] == 0  # counted, none kept


async def test_a_stream_key_of_another_type_is_replaced_and_every_record_arrives(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A hand edit (or another program on the prefix) left a string where the stream goes: it holds no
    records, so the exporter replaces it instead of holding every record until someone repairs it."""
    stream = f"{redis_prefix}:usage"
    client = redis.Redis.from_url(redis_url)
    client.set(stream, "not a stream")
    exporter = RedisStreamExporter(RedisStreamConfig(url=redis_url, stream=stream, maxlen=100_000))
    writer = LedgerWriter(LedgerConfig(dir=str(tmp_path / "usage"), commit_interval_ms=10), sink=exporter)
    for i in range(20):
        writer.append(make_record(i))
    await writer.close()
    entries: Any = client.xrange(stream)
    assert [orjson.loads(fields[FIELD])["request_id"] for _, fields in entries] == [f"req-{i:08d}" for i in range(20)]
    assert writer.stats()["redis_exported_total"] == 20
