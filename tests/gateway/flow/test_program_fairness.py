"""Program-fair queueing in the waiting room (a stand-in pool of N slots): inside one tenant, a
program's one call is not starved by another program's forty."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.flow.queue import FlowQueue, FlowRequest
from policies.flow.order import NO_PROGRAM, MemoryCounters, MemoryPrograms
from tests.gateway.flow.test_queue import POOL, Slots, request
from tests.support.polling import wait_for_async


def program_request(name: str, tenant: str, program: str | None, cost: float = 100.0) -> FlowRequest:
    return dataclasses.replace(request(name, tenant, cost=cost), program=program)


async def serve_one_by_one(queue: FlowQueue, slots: Slots, count: int) -> None:
    for _ in range(count):
        slots.release()
        await wait_for_async(lambda n=len(slots.order) + 1: len(slots.order) == n)  # type: ignore[misc]


@pytest.mark.slow
async def test_a_single_call_goes_within_two_grants_of_a_forty_way_program() -> None:
    programs = MemoryPrograms()
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0, programs=programs, program_half_life=lambda t: 60.0)
    slots = Slots(queue, free=0)
    wide = [asyncio.create_task(slots.run(program_request(f"w{i}", "t", "wide"))) for i in range(40)]
    await wait_for_async(lambda: queue.depth(POOL) == 40)
    await serve_one_by_one(queue, slots, 3)  # the wide program has been served lately
    single = asyncio.create_task(slots.run(program_request("single", "t", "single")))
    await wait_for_async(lambda: queue.depth(POOL) == 38)
    await serve_one_by_one(queue, slots, 2)
    assert "single" in slots.order[3:5], slots.order
    assert 99.0 < programs.value("t", "single", 60.0) <= 100.0 < 300.0 < programs.value("t", "wide", 60.0)
    await serve_one_by_one(queue, slots, 36)
    await asyncio.gather(single, *wide)
    assert queue.status()["programs"] == {"store": "memory", "programs": 2}


async def test_without_program_fairness_the_single_call_waits_its_turn() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    wide = [asyncio.create_task(slots.run(program_request(f"w{i}", "t", "wide"))) for i in range(10)]
    await wait_for_async(lambda: queue.depth(POOL) == 10)
    single = asyncio.create_task(slots.run(program_request("single", "t", "single")))
    await wait_for_async(lambda: queue.depth(POOL) == 11)
    await serve_one_by_one(queue, slots, 11)
    await asyncio.gather(single, *wide)
    assert slots.order[-1] == "single"
    assert queue.programs.status()["programs"] == 0  # nothing kept for a tenant without it


async def test_the_correction_at_the_end_uses_the_real_cost_and_anonymous_calls_are_one_group() -> None:
    programs = MemoryPrograms()
    queue = FlowQueue(MemoryCounters(), programs=programs, program_half_life=lambda t: 3600.0 if t == "t" else None)
    slots = Slots(queue, free=10)
    lease = await slots.run(program_request("a", "t", "p", cost=100.0))
    assert 99.9 < programs.value("t", "p", 3600.0) <= 100.0
    lease.finished(actual_cost_tokens=400.0)
    assert 399.0 < programs.value("t", "p", 3600.0) <= 400.0
    for name in ("x", "y"):
        (await slots.run(program_request(name, "t", None, cost=50.0))).finished(None)
    assert 99.0 < programs.value("t", NO_PROGRAM, 3600.0) <= 100.0  # both anonymous calls, one group
    (await slots.run(program_request("z", "u", "p"))).finished(10.0)  # a tenant without it: nothing kept
    assert programs.programs("u") == 0


async def test_a_program_served_long_ago_is_not_held_back_by_it() -> None:
    clock = [0.0]
    programs = MemoryPrograms(now=lambda: clock[0])
    queue = FlowQueue(
        MemoryCounters(), recheck_s=10.0, programs=programs, program_half_life=lambda t: 10.0, now=lambda: clock[0]
    )
    programs.charge("t", "old", 10_000.0, 10.0)  # a burst a while ago
    clock[0] = 100.0  # ten half-lives later: about 10 tokens left
    programs.charge("t", "recent", 500.0, 10.0)
    slots = Slots(queue, free=0)
    tasks = [
        asyncio.create_task(slots.run(program_request("recent", "t", "recent"))),
        asyncio.create_task(slots.run(program_request("old", "t", "old"))),
    ]
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    await serve_one_by_one(queue, slots, 2)
    await asyncio.gather(*tasks)
    assert slots.order == ["old", "recent"]
