"""Preemption through the gate, in process: a pool full of one tenant's stream, that tenant's next
request waiting, and another tenant's request arriving. The saturation check cuts the running stream
for it (the streams it may cut are the contexts its `dispatched` hook listed), the newcomer goes on
the freed slot, the cut stream waits its turn in the same room (first of its tenant's) and continues
where it stopped, and nothing stays listed or leased afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet
from backends.types import EndpointState
from gateway.flow.checks import Saturation
from gateway.flow.gate import Gate
from gateway.flow.queue import FlowQueue
from policies.flow.order import MemoryCounters
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from sim.server import run_sim_instances
from tests.gateway.request.walk import QUEUE_KEY, build, chat_request, policy
from tests.support.polling import wait_for_async

SETTINGS = FlowSettings.model_validate({"saturation": {"max_inflight": 1, "preempt": True, "max_stats_age_s": 3600}})


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 1, time_scale=2.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def one_pool(url: str) -> Fleet:
    """One endpoint whose streams may continue after a cut (`migrate_streams`)."""
    config = PoolConfig(
        name="small", model="small", engine="openai", migrate_streams=True, endpoints=[StaticEndpointConfig(url=url)]
    )
    built = Fleet.from_configs([config])
    for endpoint in built.endpoints():
        endpoint.state = EndpointState.READY
        endpoint.served_model = "llama-3.1-8b"
    return built


@pytest.mark.slow
async def test_a_tenant_under_its_share_gets_a_slot_cut_for_it(engines: list[str]) -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=0.01)
    saturation = Saturation(queue, SETTINGS)
    gate = Gate(queue, SETTINGS, PolicyHolder(policy()), checks=[saturation])
    walk = build(one_pool(engines[0]), gate=gate)
    director = walk.director

    def streaming() -> bool:
        running = saturation._running.get("small", [])
        return any(c.outcome is not None and c.outcome.first_token_at_s is not None for c in running)

    long = asyncio.create_task(director.handle(chat_request("small", stream=True, max_tokens=400), "chat"))
    await wait_for_async(streaming)  # tenant t's stream holds the pool's one slot
    behind = asyncio.create_task(director.handle(chat_request("small", stream=True, max_tokens=4), "chat"))
    await wait_for_async(lambda: queue.depth("small") == 1)  # t's next request waits: t is backlogged
    light = asyncio.create_task(director.handle(chat_request("small", key=QUEUE_KEY, max_tokens=4), "chat"))
    responses = await asyncio.gather(long, behind, light)
    assert [r.status for r in responses] == [200, 200, 200]
    assert queue.status()["pools"]["small"]["preempted"] == 1
    cut = next(r for r in walk.records.records if r.completion_tokens == 400)
    assert cut.preempted == 1 and cut.status == "ok"  # cut once, then continued to its whole length
    assert [r.preempted for r in walk.records.records].count(0) == 2
    assert not saturation._running and queue.depth("small") == 0 and walk.endpoints_idle()
    assert all(seen.inflight == 0 for seen in queue.activity.active("small").values())
    await walk.upstream.close()
