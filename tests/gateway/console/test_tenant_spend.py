"""A tenant's own spend this UTC day and month (issue 45), summed from the ledger's records rather
than counted at admission: from a replica's ledger files and from the ledger's Redis stream (every
replica's records), kept for a few seconds, bounded by the tenants asked for."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from gateway.app.settings import RedisStreamConfig
from gateway.console.tenant_spend import TenantSpend, period_starts

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp()
DAY, MONTH = period_starts(NOW)


class Clock:
    def __init__(self) -> None:
        self.now_s = NOW

    def __call__(self) -> float:
        return self.now_s


def entry(i: int, tenant: str, cost: float, ts: float, **extra: Any) -> dict[str, Any]:
    return {"v": 1, "ts": ts, "request_id": f"r{i}", "tenant": tenant, "cost_usd": cost, **extra}


ENTRIES = [
    entry(1, "web", 0.5, NOW - 60),  # today
    entry(2, "web", 0.25, DAY - 3600),  # yesterday, this month
    entry(3, "bid", 1.0, NOW - 10),
    entry(4, "web", 9.0, MONTH - 60),  # last month: neither
    entry(5, "web", 0.0, NOW - 5, kind="outcome"),  # a program's outcome, not a request
]


def write_ledger(folder: Path, entries: list[dict[str, Any]]) -> None:
    """Ledger files as the writer names them, one per UTC day (gateway/ledger/reader.py reads them)."""
    for item in entries:
        day = datetime.fromtimestamp(item["ts"], UTC).strftime("%Y%m%d")
        with (folder / f"ledger-{day}-0.jsonl").open("ab") as f:
            f.write(orjson.dumps(item) + b"\n")


async def test_each_tenants_day_and_month_from_the_ledger_files(tmp_path: Path) -> None:
    write_ledger(tmp_path, ENTRIES)
    spend, about = await TenantSpend(tmp_path, None, clock=Clock()).of({"web", "bid", "idle"})
    assert spend == {
        "web": {"day": 0.5, "month": 0.75},
        "bid": {"day": 1.0, "month": 1.0},
        "idle": {"day": 0.0, "month": 0.0},  # a tenant with no record spent nothing
    }
    assert about == {"source": "ledger-files", "as_of": NOW}


async def test_the_totals_are_kept_a_while_then_read_again_and_reset_with_the_day(tmp_path: Path) -> None:
    clock = Clock()
    write_ledger(tmp_path, ENTRIES)
    spend = TenantSpend(tmp_path, None, ttl_s=10.0, clock=clock)
    assert (await spend.of({"web"}))[0]["web"]["day"] == 0.5
    write_ledger(tmp_path, [entry(6, "web", 2.0, NOW - 1)])
    clock.now_s = NOW + 5
    assert (await spend.of({"web"}))[0]["web"]["day"] == 0.5  # within ttl_s: the scan is reused
    clock.now_s = NOW + 11
    assert (await spend.of({"web"}))[0]["web"] == {"day": 2.5, "month": 2.75}
    clock.now_s = DAY + 86_400 + 1  # a new day of the same month
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.0, "month": 2.75}


async def test_no_ledger_directory_is_no_spend(tmp_path: Path) -> None:
    spend, about = await TenantSpend(tmp_path / "none", None, clock=Clock()).of({"web"})
    assert spend == {"web": {"day": 0.0, "month": 0.0}} and about["source"] == "ledger-files"


@pytest.mark.redis
async def test_every_replicas_records_from_the_ledgers_redis_stream(redis_url: str, redis_prefix: str) -> None:
    stream = f"{redis_prefix}:usage"
    client = redis.Redis.from_url(redis_url)
    try:
        for item in sorted(ENTRIES, key=lambda e: e["ts"]):  # stream ids only grow
            client.xadd(stream, {"record": orjson.dumps(item)}, id=f"{int(item['ts'] * 1000)}-0")
        client.xadd(stream, {"record": orjson.dumps(ENTRIES[0])}, id=f"{int(NOW * 1000)}-1")  # delivered twice
        config = RedisStreamConfig(url=redis_url, stream=stream)
        spend, about = await TenantSpend(Path("/nonexistent"), config, clock=Clock()).of({"web", "bid"})
        assert spend == {"web": {"day": 0.5, "month": 0.75}, "bid": {"day": 1.0, "month": 1.0}}
        assert about["source"] == "ledger-redis-stream"
    finally:
        client.delete(stream)
        client.close()


async def test_an_unreachable_stream_raises_for_the_caller_to_fall_back() -> None:
    config = RedisStreamConfig(url="redis://127.0.0.1:1/0", stream="s", timeout_s=0.5)
    with pytest.raises(redis.RedisError):
        await TenantSpend(Path("/nonexistent"), config, clock=Clock()).of({"web"})


async def test_a_refresh_reads_only_what_was_added_and_a_new_month_reads_all_again(tmp_path: Path) -> None:
    clock = Clock()
    write_ledger(tmp_path, ENTRIES)
    spend = TenantSpend(tmp_path, None, ttl_s=10.0, clock=clock)
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.5, "month": 0.75}
    today = tmp_path / f"ledger-{datetime.fromtimestamp(NOW, UTC):%Y%m%d}-0.jsonl"
    text = today.read_bytes()
    today.write_bytes(text.replace(b'"cost_usd":0.5', b'"cost_usd":0.9'))  # a read record changed in place
    write_ledger(tmp_path, [entry(6, "web", 2.0, NOW - 1)])
    clock.now_s = NOW + 11
    assert (await spend.of({"web"}))[0]["web"] == {"day": 2.5, "month": 2.75}  # only the new bytes were read
    clock.now_s = DAY + 86_400 + 1  # a new day of the month: its sums go on, the day's from zero
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.0, "month": 2.75}
    write_ledger(tmp_path, [entry(7, "web", 0.0625, DAY + 86_400 + 0.5)])
    clock.now_s = DAY + 86_400 + 12
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.0625, "month": 2.8125}
    next_month = datetime(2027, 1, 1, 0, 0, 30, tzinfo=UTC).timestamp()
    write_ledger(tmp_path, [entry(8, "web", 0.5, next_month - 1)])
    clock.now_s = next_month  # a new month: one whole scan of it
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.5, "month": 0.5}


async def test_a_record_still_being_written_is_counted_once_when_whole(tmp_path: Path) -> None:
    clock = Clock()
    write_ledger(tmp_path, ENTRIES)
    spend = TenantSpend(tmp_path, None, ttl_s=10.0, clock=clock)
    await spend.of({"bid"})
    today = tmp_path / f"ledger-{datetime.fromtimestamp(NOW, UTC):%Y%m%d}-0.jsonl"
    line = orjson.dumps(entry(7, "bid", 4.0, NOW - 2)) + b"\n"
    with today.open("ab") as f:
        f.write(line[:20])  # the writer's group is half on disk
    clock.now_s = NOW + 11
    assert (await spend.of({"bid"}))[0]["bid"]["day"] == 1.0
    with today.open("ab") as f:
        f.write(line[20:])
    clock.now_s = NOW + 22
    assert (await spend.of({"bid"}))[0]["bid"]["day"] == 5.0
    clock.now_s = NOW + 33
    assert (await spend.of({"bid"}))[0]["bid"]["day"] == 5.0


async def test_a_file_replaced_by_a_shorter_one_is_read_again_whole(tmp_path: Path) -> None:
    clock = Clock()
    write_ledger(tmp_path, ENTRIES)
    spend = TenantSpend(tmp_path, None, ttl_s=10.0, clock=clock)
    assert (await spend.of({"web"}))[0]["web"]["month"] == 0.75
    today = tmp_path / f"ledger-{datetime.fromtimestamp(NOW, UTC):%Y%m%d}-0.jsonl"
    today.write_bytes(orjson.dumps(entry(8, "web", 0.125, NOW - 3)) + b"\n")
    clock.now_s = NOW + 11
    assert (await spend.of({"web"}))[0]["web"] == {"day": 0.125, "month": 0.375}


@pytest.mark.redis
async def test_the_stream_is_read_on_from_the_last_entry_and_a_trimmed_gap_is_said(
    redis_url: str, redis_prefix: str
) -> None:
    stream = f"{redis_prefix}:usage"
    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    try:
        for item in sorted(ENTRIES, key=lambda e: e["ts"]):
            client.xadd(stream, {"record": orjson.dumps(item)}, id=f"{int(item['ts'] * 1000)}-0")
        spend = TenantSpend(Path("/nonexistent"), RedisStreamConfig(url=redis_url, stream=stream), clock=clock)
        spend.ttl_s = 10.0
        assert (await spend.of({"web"}))[0]["web"] == {"day": 0.5, "month": 0.75}
        client.xadd(stream, {"record": orjson.dumps(ENTRIES[2])}, id=f"{int(NOW * 1000)}-1")  # re-delivered later
        client.xadd(stream, {"record": orjson.dumps(entry(9, "web", 1.5, NOW + 1))}, id=f"{int(NOW * 1000) + 1000}-0")
        clock.now_s = NOW + 11
        spent, about = await spend.of({"web", "bid"})
        assert spent == {"web": {"day": 2.0, "month": 2.25}, "bid": {"day": 1.0, "month": 1.0}}
        assert "covers_since" not in about
        for n in range(3):  # more than the cap between two reads: the entry last read is trimmed away
            stamp = int(NOW * 1000) + 2000 + n
            client.xadd(stream, {"record": orjson.dumps(entry(10 + n, "bid", 0.25, stamp / 1000))}, id=f"{stamp}-0")
        client.xtrim(stream, maxlen=2, approximate=False)
        clock.now_s = NOW + 22
        spent, about = await spend.of({"bid"})
        assert spent["bid"]["day"] == 1.5 and about["covers_since"] == (int(NOW * 1000) + 2001) / 1000
    finally:
        client.delete(stream)
        client.close()


async def test_each_agent_runs_calls_tokens_and_dollars_this_month(tmp_path: Path) -> None:
    """The Programs page's rows for runs no run rule counts (docs/agents.md#live-programs-in-the-console)."""
    write_ledger(
        tmp_path,
        [
            entry(
                1, "web", 0.5, NOW - 60, program="run-a", key_id="k1", model="m1", input_tokens=100, output_tokens=20
            ),
            entry(
                2, "web", 0.25, NOW - 30, program="run-a", key_id="k2", model="m2", input_tokens=150, output_tokens=5
            ),
            entry(3, "web", 0.0, NOW - 20, program="run-a", status="rejected", input_tokens=999),  # never admitted
            entry(4, "bid", 0.0, NOW - 10, program="run-a", input_tokens=7, output_tokens=1),  # same id, other tenant
            entry(5, "web", 9.0, MONTH - 60, program="run-b", input_tokens=1),  # last month
            entry(6, "web", 1.0, NOW - 5),  # no program
        ],
    )
    runs, about = await TenantSpend(tmp_path, None, clock=Clock()).runs()
    found = {(r.tenant, r.program): r for r in runs}
    assert set(found) == {("web", "run-a"), ("bid", "run-a")}
    web = found[("web", "run-a")]
    assert (web.calls, web.tokens, web.usd) == (2, 275, 0.75)
    assert (web.first_s, web.last_s, web.key_id, web.model) == (NOW - 60, NOW - 30, "k2", "m2")
    assert (found[("bid", "run-a")].calls, found[("bid", "run-a")].tokens) == (1, 8)
    assert about["source"] == "ledger-files"


async def test_the_runs_kept_are_bounded_the_idlest_going_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gateway.console.tenant_spend.MAX_RUNS", 3)
    write_ledger(tmp_path, [entry(i, "web", 0.1, NOW - 100 + i, program=f"run-{i}") for i in range(5)])
    write_ledger(tmp_path, [entry(9, "web", 0.1, NOW - 1, program="run-0")])  # run-0 called again last
    runs, _ = await TenantSpend(tmp_path, None, clock=Clock()).runs()
    assert [r.program for r in runs] == ["run-3", "run-4", "run-0"]
