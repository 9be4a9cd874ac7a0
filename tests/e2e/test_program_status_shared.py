"""`/admin/status` counts agent programs across gateway replicas (`state: redis`, a pool with a
program slot reserve): each gateway shows its own programs and, under `cluster`, the fleet's, a
program whose calls two gateways carry counted once (docs/agents.md#program-slot-reserve).

Real processes: one simulated engine, two `tokenway serve` sharing one real Redis (the replicas'
stream carries the counts), the official `openai` client. Conditions are polled, never timed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import Gateway, http_get, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"
KEY = "sk-program-status-0001"


@pytest.fixture
def gateways(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[list[Gateway]]:
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=4.0, args=["--max-num-seqs", "8"])
    policies = {
        "tenants": {"fair": {"program_fairness": {"half_life_s": 60}}},
        "keys": [{"id": "fair", "tenant": "fair", "sha256": hash_key(KEY)}],
        "models": {MODEL: {}},
    }
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix}

    def start(i: int) -> Gateway:
        return start_gateway(
            tmp_path / f"gw{i}",
            pools=[static_pool("llama", MODEL, engines.urls, max_num_seqs=8)],
            policies=policies,
            flow_control={"enabled": True, "saturation": {"program_reserve_slots": 2}},
            state={**state, "replicas": {"id": f"gw{i}"}},
            predictor={"enabled": False},
            ledger={"enabled": False},
        )

    with running(engines), ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
        with running(*started):
            yield started


def _call(gw: Gateway, program: str) -> Any:
    client = openai.OpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"A long step of {program}."}],
        max_tokens=400,
        extra_body={"ignore_eos": True},
        extra_headers={"x-tokenway-program": program},
    )


def _programs(gw: Gateway) -> dict[str, Any]:
    status, text = http_get(gw.url + "/admin/status")
    assert status == 200, text
    found: dict[str, Any] = orjson.loads(text)["flow"]["programs_active"].get("llama/fair", {})
    return found


def test_each_gateway_shows_the_fleets_programs_counting_a_shared_one_once(gateways: list[Gateway]) -> None:
    first, second = gateways
    wide, solo = f"wide-{uuid.uuid4().hex[:8]}", f"solo-{uuid.uuid4().hex[:8]}"
    fleet = {"programs": 2, "inflight": 4, "waiting_programs": 0}
    with ThreadPoolExecutor(4) as pool:
        calls: list[Future[Any]] = [
            pool.submit(_call, first, wide),
            pool.submit(_call, first, wide),
            pool.submit(_call, second, wide),
            pool.submit(_call, second, solo),
        ]
        # while all four calls run: each gateway its own share, the same fleet under `cluster`
        wait_for(lambda: _programs(first).get("cluster") == fleet, what="the first gateway seeing the fleet")
        wait_for(lambda: _programs(second).get("cluster") == fleet, what="the second gateway seeing the fleet")
        mine, theirs = _programs(first), _programs(second)
        assert (mine["programs"], mine["inflight"]) == (1, 2)
        assert (theirs["programs"], theirs["inflight"]) == (2, 2)
        for call in calls:
            assert call.result(timeout=120).choices[0].finish_reason == "length"
    wait_for(lambda: _programs(first).get("cluster", {}).get("inflight", 0) == 0, what="the fleet's calls ended")
