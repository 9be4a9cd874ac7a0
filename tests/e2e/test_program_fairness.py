"""Program-fair queueing through a real gateway process and a simulated engine (docs/agents.md).

The engine batches one request at a time and flow control holds everything it cannot start now, so
every request beyond the one running waits in the gateway. One tenant runs two agent programs: a
wide one with eight calls queued, then a program of one call. With the tenant's `program_fairness`
on, the single call goes at the next turn, ahead of the wide program's queue; without it, it waits
behind all of it. The same with the attained service kept in Redis (what several replicas share).
Conditions are polled on `/admin/status`, never timed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import Gateway, SimEngines, http_get, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "llama-3.1-8b"
KEYS = {"fair": "sk-program-fair-0001", "plain": "sk-program-plain-0001"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngines]:
    narrow = start_sim(
        tmp_path_factory.mktemp("program-engines"),
        count=1,
        served_model_name=MODEL,
        time_scale=4.0,
        args=["--max-num-seqs", "1"],
    )
    with running(narrow):
        yield narrow


def gateway(workdir: Path, engines: SimEngines, **sections: Any) -> Gateway:
    doc = {
        "tenants": {"fair": {"program_fairness": {"half_life_s": 60}}, "plain": {}},
        "keys": [{"id": name, "tenant": name, "sha256": hash_key(key)} for name, key in KEYS.items()],
        "models": {MODEL: {}},
    }
    return start_gateway(
        workdir,
        pools=[static_pool("llama", MODEL, engines.urls, max_num_seqs=1)],
        policies=doc,
        flow_control={"enabled": True, "saturation": {"max_engine_waiting": 0}},
        predictor={"worker": "thread", "online_training": False, "prior": {"time_scale": 4.0}},
        backends={"scrape_interval_s": 0.05},
        ledger={"enabled": False},
        **sections,
    )


def chat(gw: Gateway, tenant: str, program: str, max_tokens: int) -> Any:
    client = openai.OpenAI(base_url=gw.base_url, api_key=KEYS[tenant], max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Next step of {program}."}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        extra_headers={"x-tokenway-program": program},
    )


def flow(gw: Gateway) -> dict[str, Any]:
    status, text = http_get(gw.url + "/admin/status")
    assert status == 200, text
    return orjson.loads(text)["flow"]  # type: ignore[no-any-return]


def waiting(gw: Gateway, tenant: str) -> int:
    room = flow(gw)["pools"].get("llama", {})
    return sum(int(band["waiting"].get(tenant, 0)) for band in room.get("bands", {}).values())


def run(gw: Gateway, tenant: str) -> tuple[list[str], int, int]:
    """The wide program's eight calls queued, then the single program's one: (completion order, how
    many had completed when the single call arrived, how many of the wide program waited then)."""
    order: list[str] = []
    lock = threading.Lock()

    def call(label: str, program: str, max_tokens: int) -> None:
        chat(gw, tenant, program, max_tokens)
        with lock:
            order.append(label)

    with ThreadPoolExecutor(max_workers=10) as pool:
        chat(gw, tenant, "warm", 2)  # the first request pays one-off costs
        wide = [pool.submit(call, f"wide{i}", "wide", 120) for i in range(8)]
        wait_for(lambda: waiting(gw, tenant) >= 5, what="the wide program queued", timeout_s=60)
        ahead = waiting(gw, tenant)
        single = pool.submit(call, "single", "single", 24)
        wait_for(lambda: waiting(gw, tenant) >= 1 and len(order) < 8, what="the single call queued", timeout_s=60)
        done_before = len(order)
        single.result(timeout=120)
        for future in wide:
            future.result(timeout=120)
    return order, done_before, ahead


def test_a_programs_single_call_is_not_starved_by_another_programs_queue(tmp_path: Path, engines: SimEngines) -> None:
    gw = gateway(tmp_path / "gw", engines)
    with running(gw):
        order, done_before, ahead = run(gw, "fair")
        # it went at the first turn after it arrived: behind at most the call running then and the
        # one granted as it arrived, ahead of the wide program's queue
        assert ahead >= 4 and order.index("single") <= done_before + 2, (done_before, ahead, order)
        assert len(order) == 9
        assert flow(gw)["programs"]["programs"] >= 2  # wide, single (and warm) tracked for the tenant
        # the same tenant without program fairness: arrival order, behind every wide call queued then
        order, done_before, ahead = run(gw, "plain")
        assert ahead >= 4 and order.index("single") >= done_before + ahead, (done_before, ahead, order)


@pytest.mark.redis
def test_with_the_attained_service_in_redis_the_single_call_goes_next_too(
    tmp_path: Path, engines: SimEngines, redis_url: str, redis_prefix: str
) -> None:
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix}
    gw = gateway(tmp_path / "gw", engines, state=state)
    with running(gw):
        order, done_before, ahead = run(gw, "fair")
        assert ahead >= 4 and order.index("single") <= done_before + 2, (done_before, ahead, order)
        programs = flow(gw)["programs"]
        assert programs["store"] == "redis" and programs["errors"] == 0 and programs["calls"] > 0
