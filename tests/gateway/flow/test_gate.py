"""The gate with flow control's saturation check in the walk, in process: a saturated pool holds a
request until capacity frees, the fairness account is charged with the prediction and corrected with
the real cost, a band's timeout is answered as the band says, and a client leaving while held leaves
nothing open."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.flow.checks import Saturation
from gateway.flow.gate import Gate
from gateway.flow.queue import FlowQueue
from policies.flow.order import MemoryCounters, band_rank
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.schema import PoliciesConfig
from sim.server import run_sim_instances
from tests.gateway.request.walk import Walk, body_json, build, chat_request, fleet, handle_cancelled_at, policy
from tests.support.polling import wait_for_async

NORMAL = band_rank(0)
SETTINGS = FlowSettings.model_validate({"saturation": {"max_engine_waiting": 0, "max_stats_age_s": 3600}})


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 1, time_scale=50.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def flow_hook(**flow_policy: Any) -> Gate:
    doc = policy().config.model_dump(mode="json")
    doc["flow_control"] = flow_policy
    queue = FlowQueue(MemoryCounters(), recheck_s=0.01)
    holder = PolicyHolder(Policy(PoliciesConfig.model_validate(doc)))
    return Gate(queue, SETTINGS, holder, checks=[Saturation(queue, SETTINGS)])


def no_lease_open(gate: Gate, pool: str) -> bool:
    """Every dispatch's fairness lease was closed: nothing counts as in flight for any tenant."""
    return all(seen.inflight == 0 for seen in gate.queue.activity.active(pool).values())


def saturate(walk: Walk, waiting: int) -> None:
    """The engine reports `waiting` requests queued inside it (as a fresh scrape would)."""
    for endpoint in walk.fleet.endpoints():
        endpoint.stats.waiting = waiting
        endpoint.stats.scraped_at_s = time.monotonic()


async def test_a_saturated_pool_holds_the_request_until_capacity_frees(engines: list[str]) -> None:
    hook = flow_hook()
    walk = build(fleet({"small": engines}), gate=hook)
    saturate(walk, 3)
    task = asyncio.create_task(walk.director.handle(chat_request("small", max_tokens=5, x_tokenway_debug="1"), "chat"))
    await wait_for_async(lambda: hook.queue.depth("small") == 1)
    assert walk.router.dispatched == []  # nothing reached the engine while it was saturated
    saturate(walk, 0)
    hook.queue.notify("small")
    response = await task
    assert response.status == 200 and float(response.headers["x-tokenway-queued-ms"]) >= 0
    flow = dict(part.split("=") for part in response.headers["x-tokenway-flow"].split(";"))
    assert flow["band"] == "normal" and float(flow["cost"]) > 0
    (record,) = walk.records.records
    assert record.reject_reason == "queued" and record.queue_ms and record.queue_ms > 0
    # charged with the prediction at dispatch, corrected to the real cost at the end
    usage = body_json(response)["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    real = usage["prompt_tokens"] - cached + usage["completion_tokens"]
    assert hook.queue.counters.value("small", NORMAL, "t") == pytest.approx(real)
    assert no_lease_open(hook, "small") and walk.endpoints_idle()
    await walk.upstream.close()


async def test_an_open_pool_costs_no_wait(engines: list[str]) -> None:
    hook = flow_hook()
    walk = build(fleet({"small": engines}), gate=hook)
    response = await walk.director.handle(chat_request("small"), "chat")
    assert response.status == 200 and "x-tokenway-queued-ms" not in response.headers
    (record,) = walk.records.records
    assert record.queue_ms is None and record.reject_reason is None
    assert hook.queue.status()["pools"]["small"]["waited"] == 0
    await walk.upstream.close()


@pytest.mark.parametrize(
    ("on_timeout", "status", "code"),
    [(429, 429, "rate_limit_exceeded"), (503, 503, "queue_timeout")],
    ids=["429", "503"],
)
async def test_waiting_out_the_band_is_answered_as_the_band_says(
    engines: list[str], on_timeout: int, status: int, code: str
) -> None:
    hook = flow_hook(bands={"normal": {"max_queue_ms": 30, "on_timeout": on_timeout}})
    walk = build(fleet({"small": engines}), gate=hook)
    saturate(walk, 3)
    response = await walk.director.handle(chat_request("small"), "chat")
    assert response.status == status and response.headers["retry-after"].isdigit()
    assert float(response.headers["x-tokenway-queued-ms"]) > 0
    assert body_json(response)["error"]["code"] == code
    (record,) = walk.records.records
    assert record.reject_reason == "queue_timeout" and record.queue_ms is not None
    assert walk.admission.ends() == {"small-1": ["release"]} and hook.queue.depth("small") == 0
    assert hook.queue.counters.value("small", NORMAL, "t") == 0.0  # never dispatched, never charged
    await walk.upstream.close()


@pytest.mark.slow
async def test_a_client_leaving_at_any_await_while_held_leaves_nothing_open(engines: list[str]) -> None:
    hook = flow_hook()
    walk = build(fleet({"small": engines}), gate=hook)
    saturate(walk, 3)

    async def open_soon() -> None:
        await asyncio.sleep(0.05)
        saturate(walk, 0)
        hook.queue.notify("small")

    at, completed = 0, False
    while not completed and at < 500:
        saturate(walk, 3)
        opener = asyncio.create_task(open_soon())
        cancelled, _ = await handle_cancelled_at(walk, lambda: chat_request("small", stream=True), at)
        await opener
        completed = not cancelled
        ends = walk.admission.ends()
        assert all(len(how) == 1 for how in ends.values()), ends
        assert hook.queue.depth("small") == 0 and no_lease_open(hook, "small") and walk.endpoints_idle()
        at += 1
    assert completed and at > 3
    await walk.upstream.close()
