"""The console across replicas, with nothing configured beyond `state: redis`: two real gateways on
the real Redis, each with its own ledger directory and no `ledger.redis_stream`, take traffic; either
one's live tail, usage report (JSON, CSV and the console's page) and tenant spend show every
replica's requests, each exactly once (the ledger's records meet on the state's own stream by
default); a replica that stops drops out of the live views."""

from __future__ import annotations

import csv
import io
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, running, start_gateway, start_sim, static_pool, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"
OTHER_KEY = "tw-test-other-0000"


@dataclass
class Cluster:
    one: Gateway
    other: Gateway
    redis_url: str
    prefix: str
    sent: dict[str, str]  # request id -> its end user, one distinct user per request
    cost: float


def activity(url: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(url + "/admin/activity", timeout=10).json()
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Cluster]:
    """Two gateways sharing the real Redis (under a prefix of their own), 3 requests through one with
    key k0 and 5 through the other with k1, each request naming its own end user."""
    tmp_path = tmp_path_factory.mktemp("cluster-console")
    prefix = f"tokenway-test:{uuid.uuid4().hex[:12]}"
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    policies = {
        "tenants": {"t": {}},
        "keys": [
            {"id": "k0", "tenant": "t", "sha256": hash_key(TEST_KEY)},
            {"id": "k1", "tenant": "t", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {MODEL: {"default_max_tokens": 8, "price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
    }
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}  # and nothing else
    try:
        with running(engines):
            pools = [static_pool("llama", MODEL, engines.urls)]

            def gateway(i: int) -> Gateway:
                ledger = {"dir": str(tmp_path / f"ledger{i}"), "commit_interval_ms": 10}
                return start_gateway(tmp_path / f"gw{i}", pools=pools, policies=policies, state=state, ledger=ledger)

            one, other = gateway(0), gateway(1)
            with running(one, other):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                sent: dict[str, str] = {}
                cost = 0.0
                for i, (gw, key, n) in enumerate(((one, TEST_KEY, 3), (other, OTHER_KEY, 5))):
                    for j in range(n):
                        headers = {"Authorization": f"Bearer {key}", "x-tokenway-user": f"u{i}-{j}"}
                        answer = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
                        assert answer.is_success, answer.text
                        sent[answer.headers["x-request-id"]] = f"u{i}-{j}"
                        cost += float(answer.headers["x-tokenway-cost-usd"])
                assert len(sent) == 8 and cost > 0
                yield Cluster(one, other, redis_url, prefix, sent, cost)
    finally:
        client = redis.Redis.from_url(redis_url)
        for name in client.scan_iter(match=f"*{prefix}*", count=1000):
            client.delete(name)
        client.close()


def test_the_live_tail_of_either_replica_shows_every_request_once(cluster: Cluster) -> None:
    def both_seen() -> dict[str, Any] | None:
        doc = activity(cluster.one.url)
        return doc if doc["summary"]["requests"] == 8 and len(doc["replicas"]) == 2 else None

    doc = wait_for(both_seen, timeout_s=20, what="the other replica's activity")
    assert sorted(row["request_id"] for row in doc["tail"]) == sorted(cluster.sent)  # each once, none missing
    assert len({row["replica"] for row in doc["tail"]}) == 2
    assert [row["ts"] for row in doc["tail"]] == sorted((row["ts"] for row in doc["tail"]), reverse=True)
    wait_for(  # the other's view of this one lags by at most one publish (2 s)
        lambda: activity(cluster.other.url)["summary"]["requests"] == 8,
        timeout_s=20,
        what="the first replica's activity",
    )


def test_usage_csv_and_tenant_spend_count_every_replicas_records_once(cluster: Cluster) -> None:
    def usage_of_both() -> dict[str, Any] | None:  # every replica's ledger, through the state's stream
        doc: dict[str, Any] = httpx.get(cluster.one.url + "/admin/usage?since=1h&by=user", timeout=10).json()
        return doc if doc["total"]["requests"] >= 8 else None

    usage = wait_for(usage_of_both, timeout_s=20, what="both replicas' records in the stream")
    assert usage["source"] == "redis-stream" and "covers_since" not in usage and "stream_error" not in usage
    assert {row["user"]: row["requests"] for row in usage["rows"]} == {u: 1 for u in cluster.sent.values()}
    assert usage["total"]["requests"] == 8 and usage["total"]["cost_usd"] == pytest.approx(cluster.cost)
    by_key = httpx.get(cluster.other.url + "/admin/usage?since=1h&by=key&format=csv", timeout=10)
    assert by_key.status_code == 200 and by_key.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(by_key.text)))
    assert {row["key_id"]: row["requests"] for row in table} == {"k0": "3", "k1": "5", "TOTAL": "8"}

    tenants = httpx.get(cluster.one.url + "/admin/tenants?spend=1", timeout=10).json()["data"]
    row = next(t for t in tenants if t["name"] == "t")
    assert row["spend_source"]["source"] == "ledger-redis-stream"
    assert row["spend_usd"]["month"] == pytest.approx(cluster.cost, abs=1e-6)
    client = redis.Redis.from_url(cluster.redis_url)
    try:  # the records of both, each once, on the stream under the state's prefix
        assert client.xlen(f"{cluster.prefix}:usage") == 8
    finally:
        client.close()


def test_the_usage_page_says_it_shows_every_replicas_records(cluster: Cluster) -> None:
    """Debian's headless Chromium on one replica's console (loopback, no admin token): the table
    counts the 8 requests of both and the page says where they came from."""
    from tests.e2e.test_console import by_css, page_ready, wait
    from tests.support.browser import chromium, require_browser

    require_browser()
    with chromium() as driver:
        driver.get(cluster.other.url + "/ui")
        wait(driver, by_css("#login-submit")).click()  # loopback without an admin token: an empty token
        wait(driver, page_ready("overview"))
        driver.get(cluster.other.url + "/ui#usage")
        wait(driver, page_ready("usage"))
        shown = wait(driver, by_css("#usage-table")).text
        assert re.search(r"TOTAL\s+8\s+8\s", shown), shown
        assert wait(driver, by_css("#usage-origin")).text == "Every replica's records, from the ledger's Redis stream."
        assert not [e.text for e in driver.find_elements("css selector", "#page .error") if e.text]


def test_a_replica_that_stops_drops_out_of_the_live_views(cluster: Cluster) -> None:
    stop_process(cluster.other.proc)
    wait_for(
        lambda: len(activity(cluster.one.url)["replicas"]) == 1, timeout_s=30, what="the stopped replica to drop out"
    )
