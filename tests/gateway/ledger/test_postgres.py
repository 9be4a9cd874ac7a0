"""The PostgreSQL sink and `usage sql --dsn`, against a real throwaway cluster (conftest's postgres_dsn)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from gateway.app.settings import LedgerConfig, LedgerPostgresConfig, RedisStreamConfig
from gateway.ledger import open_ledger
from gateway.ledger.cli import main
from gateway.ledger.postgres import PostgresSink
from gateway.ledger.writer import encode, record_to_entry
from tests.gateway.ledger.records import make_record
from tests.support.polling import wait_for
from tests.support.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


@pytest.fixture
def table(postgres_dsn: str) -> Iterator[str]:
    name = f"usage_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")


def select(dsn: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def test_the_writer_copies_every_record(postgres_dsn: str, table: str, tmp_path: Path) -> None:
    config = LedgerConfig(dir=str(tmp_path), fsync=False, postgres=LedgerPostgresConfig(dsn=postgres_dsn, table=table))
    writer = open_ledger(config)
    assert writer is not None
    for i in range(250):
        writer.append(make_record(i, started_at_unix_s=time.time() - 60))
        if i % 50 == 0:
            writer.flush_sync()
    writer.close_sync()
    stats = writer.stats()
    assert stats["postgres_inserted_total"] == 250
    assert stats["postgres_dropped_total"] == stats["postgres_errors_total"] == 0
    n, cost, ids = select(postgres_dsn, f"SELECT count(*), sum(cost_usd), count(DISTINCT request_id) FROM {table}")[0]
    assert n == ids == 250
    assert cost == pytest.approx(sum(make_record(i).cost_usd for i in range(250)))
    (typed,) = select(postgres_dsn, f"SELECT stream FROM {table} LIMIT 1")[0]
    assert typed is False  # typed columns: a boolean, not 0


def test_a_group_sent_again_is_stored_once(postgres_dsn: str, table: str) -> None:
    sink = PostgresSink(LedgerPostgresConfig(dsn=postgres_dsn, table=table))
    lines = [encode(make_record(i)) for i in range(10)]
    try:
        assert sink._send(0, lines)  # the commit landed but its answer was lost: the group is retried
        assert sink._send(0, lines)
    finally:
        sink.close_sync()
    assert select(postgres_dsn, f"SELECT count(*) FROM {table}") == [(10,)]


def test_odd_values_do_not_stall_the_copy(postgres_dsn: str, table: str) -> None:
    entry = record_to_entry(make_record(1))
    odd = {**entry, "request_id": "nul\x00id", "http_status": 10**30, "next_version_field": [1, "\x00"]}
    sink = PostgresSink(LedgerPostgresConfig(dsn=postgres_dsn, table=table))
    sink.submit([encode(make_record(0)), json.dumps(odd).encode() + b"\n"])
    sink.close_sync()
    assert sink.stats()["postgres_inserted_total"] == 2
    row = select(postgres_dsn, f"SELECT request_id, http_status, other FROM {table} WHERE http_status IS NULL")[0]
    assert row[0] == "nul\ufffdid"
    assert row[2] == {"http_status": 10**30, "next_version_field": [1, "\ufffd"]}


def test_an_unreachable_database_never_blocks_and_drops_with_a_count() -> None:
    dsn = f"postgresql://tokenway@127.0.0.1:{free_port()}/postgres"  # nothing listens there
    sink = PostgresSink(LedgerPostgresConfig(dsn=dsn, timeout_s=0.5, max_pending_batches=3))
    started = time.monotonic()
    for i in range(10):
        sink.submit([encode(make_record(i))])
    assert time.monotonic() - started < 1.0  # submit only queues
    wait_for(lambda: sink.stats()["postgres_errors_total"] >= 2, timeout_s=20, what="two failed connections")
    assert sink.stats()["postgres_pending_batches"] <= 3
    assert sink.stats()["postgres_dropped_total"] >= 7  # the oldest went when the queue was full
    sink.close_sync(timeout_s=2)
    stats = sink.stats()
    assert stats["postgres_inserted_total"] == 0
    assert stats["postgres_dropped_total"] == 10  # everything accounted for


def test_usage_sql_dsn_reads_and_cannot_write(
    postgres_dsn: str, table: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = PostgresSink(LedgerPostgresConfig(dsn=postgres_dsn, table=table))
    sink.submit([encode(make_record(i)) for i in range(30)])
    sink.close_sync()
    sql = f"SELECT tenant, count(*) AS requests, sum(cost_usd) AS cost FROM {table} GROUP BY 1 ORDER BY 1"
    assert main(["usage", "sql", sql, "--dsn", postgres_dsn, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(r["tenant"], r["requests"]) for r in got] == [("acme", 10), ("globex", 10), ("initech", 10)]
    assert sum(r["cost"] for r in got) == pytest.approx(sum(make_record(i).cost_usd for i in range(30)))
    for bad in (
        f"DELETE FROM {table}",
        f"WITH gone AS (DELETE FROM {table} RETURNING 1) SELECT count(*) FROM gone",
        f"DROP TABLE {table}",
    ):
        assert main(["usage", "sql", bad, "--dsn", postgres_dsn]) == 2
        err = capsys.readouterr().err
        assert "read-only" in err and "Traceback" not in err
    assert main(["usage", "sql", "SELEC 1", "--dsn", postgres_dsn]) == 2
    assert "syntax error" in capsys.readouterr().err
    assert select(postgres_dsn, f"SELECT count(*) FROM {table}") == [(30,)]


def test_redis_stream_and_postgres_both_receive_every_record(
    postgres_dsn: str, table: str, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    import redis

    stream = f"{redis_prefix}:usage"
    config = LedgerConfig(
        dir=str(tmp_path),
        fsync=False,
        redis_stream=RedisStreamConfig(url=redis_url, stream=stream),
        postgres=LedgerPostgresConfig(dsn=postgres_dsn, table=table),
    )
    writer = open_ledger(config)
    assert writer is not None
    for i in range(40):
        writer.append(make_record(i))
    writer.close_sync()
    stats = writer.stats()
    assert stats["redis_exported_total"] == stats["postgres_inserted_total"] == 40
    assert redis.Redis.from_url(redis_url).xlen(stream) == 40
    assert select(postgres_dsn, f"SELECT count(*) FROM {table}") == [(40,)]
