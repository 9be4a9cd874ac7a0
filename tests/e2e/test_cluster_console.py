"""The console across replicas: two real gateways sharing one Redis, each asked for `/admin/activity`,
show the requests both served, each tail row naming its replica, and the usage page counts both
ledgers through the ledger's Redis stream; a replica that stops drops out of the live views."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.policy import hash_key
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, running, start_gateway, start_sim, static_pool, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"


def activity(url: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(url + "/admin/activity", timeout=10).json()
    return found


def test_every_replica_shows_the_traffic_of_all(tmp_path: Path, own_redis: RedisProcess) -> None:
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    policies = {
        "tenants": {"t": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key(TEST_KEY)}],
        "models": {MODEL: {"default_max_tokens": 8}},
    }
    state = {"backend": "redis", "redis_url": own_redis.url}
    with running(engines):
        pools = [static_pool("llama", MODEL, engines.urls)]
        stream = {"url": own_redis.url, "stream": "usage-test"}  # each its own ledger directory, one stream

        def gateway(i: int) -> Any:
            ledger = {"dir": str(tmp_path / f"ledger{i}"), "commit_interval_ms": 10, "redis_stream": stream}
            return start_gateway(tmp_path / f"gw{i}", pools=pools, policies=policies, state=state, ledger=ledger)

        one, other = gateway(0), gateway(1)
        with running(one, other):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            auth = {"Authorization": f"Bearer {TEST_KEY}"}
            for gw, n in ((one, 3), (other, 5)):
                for _ in range(n):
                    assert httpx.post(gw.base_url + "/chat/completions", json=body, headers=auth, timeout=30).is_success

            def both_seen() -> dict[str, Any] | None:
                doc = activity(one.url)
                return doc if doc["summary"]["requests"] == 8 and len(doc["replicas"]) == 2 else None

            doc = wait_for(both_seen, timeout_s=20, what="the other replica's activity")
            assert len(doc["tail"]) == 8 and len({row["replica"] for row in doc["tail"]}) == 2
            assert [row["ts"] for row in doc["tail"]] == sorted((row["ts"] for row in doc["tail"]), reverse=True)
            wait_for(  # the other's view of this one lags by at most one publish (2 s)
                lambda: activity(other.url)["summary"]["requests"] == 8,
                timeout_s=20,
                what="the first replica's activity",
            )

            def usage_of_both() -> dict[str, Any] | None:  # the usage page: every replica's ledger, by the stream
                doc: dict[str, Any] = httpx.get(one.url + "/admin/usage?since=1h", timeout=10).json()
                return doc if doc["total"]["requests"] == 8 else None

            usage = wait_for(usage_of_both, timeout_s=20, what="both replicas' records in the stream")
            assert usage["source"] == "redis-stream" and "covers_since" not in usage
            stop_process(other.proc)
            wait_for(
                lambda: len(activity(one.url)["replicas"]) == 1, timeout_s=30, what="the stopped replica to drop out"
            )
