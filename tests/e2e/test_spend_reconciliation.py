"""Spend reconciliation against real gateways: after a mixed load (answers, streams, clients that
leave mid-stream, budget rejections) the keys' enforced spend counters and the ledger agree exactly,
in memory and in Redis across two gateways; a record the ledger dropped, or a counter bumped behind
the gateway's back, shows up as drift on `/admin/status` and in `tokenway_spend_drift_*`."""
# mypy: disable-error-code="arg-type, call-overload"
# (the SDK's TypedDict parameters are passed plain dicts here on purpose: what a user's code sends)

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines, http_get, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA = "llama-3.1-8b"
POLICY: dict[str, Any] = {
    "tenants": {"t1": {}},
    "keys": [
        {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
        {"id": "k2", "tenant": "t1", "sha256": hash_key(OTHER_KEY)},
    ],
    "models": {LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
    "admission": {"track_key_spend": True},
    # k2 runs out of budget part-way: its later requests are refused (nothing may stay charged)
    "budgets": [{"id": "k2-day", "scope": "key", "match": {"key": "k2"}, "usd_per_day": 0.02}],
}
FAST = {"reconcile": {"interval_s": 0.2, "tolerance_usd": 1e-6, "tolerance_ratio": 0.0}}
REQUESTS = 12  # made by `mixed_load`: each leaves one ledger record (answered, aborted or refused)


def reconciliation(gw: Gateway) -> dict[str, Any]:
    status, text = http_get(gw.url + "/admin/status")
    assert status == 200, text
    found: dict[str, Any] = orjson.loads(text)["spend_reconciliation"]
    return found


def ledger_records(gws: list[Gateway]) -> list[dict[str, Any]]:
    """The records in the gateways' ledger files: whole lines only (the writer may be mid-line)."""
    records = []
    for gw in gws:
        for path in Path(gw.workdir, "var", "usage").glob("*.jsonl"):
            data = path.read_bytes()
            records += [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
    return records


def ledger_total(gws: list[Gateway]) -> float:
    return sum(float(record.get("cost_usd") or 0) for record in ledger_records(gws))


def load_recorded(gws: list[Gateway]) -> float:
    """The wall clock once every request of `mixed_load` is in the ledgers' files: a reconciliation
    computed before then may agree with ledgers that lack the last request's record, because its
    counters did not hold that request yet either (a stream's charge and record come after the
    client has read its last chunk)."""
    wait_for(
        lambda: len(ledger_records(gws)) >= REQUESTS,
        timeout_s=20,
        what=lambda: f"{REQUESTS} ledger records, found {len(ledger_records(gws))}",
    )
    return time.time()


def mixed_load(urls: list[str]) -> None:
    """Answers, streams, streams left after their first chunk, and budget refusals, spread over `urls`."""
    for i in range(REQUESTS):
        base = urls[i % len(urls)]
        key = TEST_KEY if i % 3 else OTHER_KEY
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": f"request {i}: tell me a story"}]
        try:
            if i % 4 == 0:
                client.chat.completions.create(model=LLAMA, messages=messages, max_tokens=8)
            elif i % 4 == 1:
                stream = client.chat.completions.create(
                    model=LLAMA,
                    messages=messages,
                    max_tokens=400,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                next(iter(stream))
                stream.close()  # the client leaves mid-answer: charged what was generated
            else:
                list(
                    client.chat.completions.create(
                        model=LLAMA,
                        messages=messages,
                        max_tokens=8,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
        except openai.RateLimitError:
            assert key == OTHER_KEY  # k2's budget
        finally:
            client.close()


def agreed(gw: Gateway, gws: list[Gateway], since: float) -> dict[str, Any] | None:
    """The reconciliation once it has seen both keys and every record, with no drift: one computed
    after `since` (`/admin/status` shows the last tick's, which may be older than the load's end)."""
    found = reconciliation(gw)
    if (found.get("checked_at_unix_s") or 0) <= since:
        return None
    day = (found.get("periods") or {}).get("day")
    if not day or day["keys"] != 2:
        return None
    if day["recorded_usd"] != pytest.approx(ledger_total(gws), abs=1e-9) or day["open_usd"] != 0:
        return None
    return found if day["drift_usd"] < 1e-9 else None


def flagged(gw: Gateway, key: str) -> dict[str, Any] | None:
    rows = [r for r in reconciliation(gw)["over_tolerance"] if r["key"] == key and r["period"] == "day"]
    return rows[0] if rows else None


@pytest.fixture
def engines(sim_factory: Callable[..., SimEngines]) -> SimEngines:
    return sim_factory(count=1, time_scale=20, served_model_name=LLAMA)


def test_memory_books_agree_after_mixed_load(engines: SimEngines, gateway_factory: Callable[..., Gateway]) -> None:
    gw = gateway_factory(pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY, ledger=FAST)
    mixed_load([gw.base_url])
    since = load_recorded([gw])
    found = wait_for(
        lambda: agreed(gw, [gw], since), timeout_s=20, what=lambda: f"agreeing books: {reconciliation(gw)}"
    )
    assert found is not None, reconciliation(gw)
    assert found["store"] == "memory" and found["over_tolerance"] == []
    assert found["periods"]["month"]["drift_usd"] < 1e-9
    _status, text = http_get(gw.url + "/metrics")
    assert 'tokenway_spend_drift_usd{period="day"} 0.0' in text
    assert 'tokenway_spend_drift_keys{period="day"} 0.0' in text


def test_a_record_the_ledger_dropped_shows_as_drift(
    engines: SimEngines, gateway_factory: Callable[..., Gateway]
) -> None:
    # one record waits a minute for the disk; the ledger drops every record after it
    ledger = {**FAST, "max_pending_records": 1, "commit_interval_ms": 60_000}
    gw = gateway_factory(pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY, ledger=ledger)
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0)
    costs = []
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=LLAMA, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8
        )
        costs.append(float(raw.headers["x-tokenway-cost-usd"]))
    dropped = costs[1] + costs[2]  # enforced, never recorded

    def settled() -> dict[str, Any] | None:
        row = flagged(gw, "k1")
        return row if row is not None and abs(row["drift_usd"] - dropped) < 1e-9 else None

    row = wait_for(settled, timeout_s=20)
    assert row is not None, reconciliation(gw)
    assert row["recorded_usd"] == pytest.approx(costs[0], abs=1e-9)


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    name = f"tokenway-test:{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"*{name}*", count=1000):
        client.delete(key)


@pytest.mark.redis
def test_redis_books_agree_across_two_gateways_and_a_bumped_counter_shows(
    engines: SimEngines, gateway_factory: Callable[..., Gateway], redis_url: str, prefix: str
) -> None:
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}
    gws = [
        gateway_factory(
            pools=[static_pool("p", LLAMA, engines.urls)],
            policies=POLICY,
            ledger=FAST,
            state=state,
            predictor={"enabled": False},
        )
        for _ in range(2)
    ]
    mixed_load([gw.base_url for gw in gws])
    since = load_recorded(gws)
    for gw in gws:  # each compares the cluster's counters with both gateways' ledgers
        found = wait_for(
            lambda gw=gw: agreed(gw, gws, since),  # type: ignore[misc]
            timeout_s=20,
            what=lambda gw=gw: f"agreeing books: {reconciliation(gw)}",  # type: ignore[misc]
        )
        assert found is not None, reconciliation(gw)
        assert found["store"] == "redis" and found["over_tolerance"] == []

    redis.Redis.from_url(redis_url).hincrbyfloat("{" + prefix + "}:u:@spend|usd_per_day|k1", "s", 0.5)
    for gw in gws:
        row = wait_for(lambda gw=gw: flagged(gw, "k1"), timeout_s=20)  # type: ignore[misc]
        assert row is not None, reconciliation(gw)
        assert row["drift_usd"] == pytest.approx(0.5, abs=1e-6)  # the bump, and only it
