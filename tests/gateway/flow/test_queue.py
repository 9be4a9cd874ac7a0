"""The waiting room with a stand-in pool of N slots: fast path, flow order, bounds, cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from gateway.flow.queue import (
    REASON_QUEUE_FULL,
    REASON_QUEUE_TIMEOUT,
    REASON_SHED,
    Blocked,
    FlowQueue,
    FlowRequest,
    Lease,
    QueueRejected,
)
from policies.flow.order import MemoryCounters, band_rank
from tests.support.polling import wait_for_async

NORMAL, LOW, HIGH = band_rank(0), band_rank(-1), band_rank(1)
POOL = "p"


class Slots:
    """A pool with `free` batch slots: a request may go while one is free; it takes it when it runs."""

    def __init__(self, queue: FlowQueue, free: int) -> None:
        self.queue = queue
        self.free = free
        self.order: list[str] = []

    def ready(self) -> str | Blocked:
        return "go" if self.free > 0 else Blocked.POOL

    async def run(self, request: FlowRequest, ready: Callable[[], str | Blocked] | None = None) -> Lease:
        _, lease = await self.queue.hold(POOL, request, ready or self.ready)
        self.free -= 1  # dispatched: the slot is taken before the task next yields
        self.order.append(request.request_id)
        return lease

    def release(self, count: int = 1) -> None:
        self.free += count
        self.queue.notify(POOL)


def request(name: str, tenant: str, *, band: int = NORMAL, cost: float = 100.0, weight: float = 1.0,
            wait_s: float = 30.0, body_bytes: int = 0, tag: str = "") -> FlowRequest:  # fmt: skip
    return FlowRequest(name, tenant, band, cost, weight, time.monotonic() + wait_s, body_bytes, tag)


async def test_an_open_pool_dispatches_at_once_and_charges_the_tenant() -> None:
    counters = MemoryCounters()
    queue = FlowQueue(counters)
    slots = Slots(queue, free=1)
    lease = await slots.run(request("r1", "a", cost=300.0, weight=3.0))
    assert lease.queued_s == 0.0 and queue.depth(POOL) == 0
    assert counters.value(POOL, NORMAL, "a") == 100.0  # 300 tokens / weight 3
    lease.finished(actual_cost_tokens=600.0)
    assert counters.value(POOL, NORMAL, "a") == 200.0  # corrected to the real cost
    lease.finished(actual_cost_tokens=9000.0)  # once only
    assert counters.value(POOL, NORMAL, "a") == 200.0


async def test_while_saturated_a_light_tenant_goes_before_a_flood_and_bands_before_both() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    tasks = [asyncio.create_task(slots.run(request(f"a{i}", "a"))) for i in range(10)]
    await wait_for_async(lambda: queue.depth(POOL) == 10)
    slots.release(3)  # a is served three times (one at a time, each visible to the next check)
    await wait_for_async(lambda: len(slots.order) == 3)
    tasks.append(asyncio.create_task(slots.run(request("b0", "b"))))
    tasks.append(asyncio.create_task(slots.run(request("b1", "b"))))
    tasks.append(asyncio.create_task(slots.run(request("low", "c", band=LOW))))
    tasks.append(asyncio.create_task(slots.run(request("high", "a", band=HIGH))))
    await wait_for_async(lambda: queue.depth(POOL) == 11)
    for _ in range(11):
        slots.release()
        await wait_for_async(lambda n=len(slots.order) + 1: len(slots.order) == n)  # type: ignore[misc]
    await asyncio.gather(*tasks)
    # high first; b came back after idling at a's level and then alternates with a by counter; low last
    assert slots.order[3:] == ["high", "b0", "a3", "b1", "a4", "a5", "a6", "a7", "a8", "a9", "low"]


@pytest.mark.slow
async def test_weights_share_a_backlog() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    tasks = [asyncio.create_task(slots.run(request(f"h{i}", "heavy", weight=3.0))) for i in range(40)]
    tasks += [asyncio.create_task(slots.run(request(f"l{i}", "light", weight=1.0))) for i in range(40)]
    await wait_for_async(lambda: queue.depth(POOL) == 80)
    for _ in range(40):
        slots.release()
        await wait_for_async(lambda n=len(slots.order) + 1: len(slots.order) == n)  # type: ignore[misc]
    served = slots.order[:40]
    assert sum(name.startswith("h") for name in served) == 30  # 3 : 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert queue.depth(POOL) == 0


@pytest.mark.slow
async def test_a_request_blocked_for_its_own_reason_passes_the_turn() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    picky = asyncio.create_task(slots.run(request("picky", "a", wait_s=0.3), ready=lambda: Blocked.REQUEST))
    easy = asyncio.create_task(slots.run(request("easy", "b")))
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    slots.release()
    await easy
    assert slots.order == ["easy"]
    with pytest.raises(QueueRejected) as info:
        await picky
    assert info.value.reason == REASON_QUEUE_TIMEOUT and info.value.blocked is Blocked.REQUEST


async def test_timeout_answers_with_retry_after_and_leaves_nothing_behind() -> None:
    waits: list[tuple[str, int, str, float]] = []
    queue = FlowQueue(MemoryCounters(), on_wait=lambda *row: waits.append(row))
    slots = Slots(queue, free=0)
    with pytest.raises(QueueRejected) as info:
        await slots.run(request("r", "a", wait_s=0.05))
    assert info.value.reason == REASON_QUEUE_TIMEOUT and info.value.blocked is Blocked.POOL
    assert info.value.retry_after_s == 1 and info.value.waited_s > 0  # nothing drained yet: the floor
    assert queue.depth(POOL) == 0 and queue.status()["pools"][POOL]["rejected"] == {REASON_QUEUE_TIMEOUT: 1}
    assert waits and waits[0][:3] == (POOL, NORMAL, "a")


async def test_a_cancelled_waiter_leaves_at_once_and_is_never_charged() -> None:
    counters = MemoryCounters()
    queue = FlowQueue(counters, recheck_s=10.0)
    slots = Slots(queue, free=0)
    gone = asyncio.create_task(slots.run(request("gone", "a", body_bytes=1000, tag="interactive")))
    await wait_for_async(lambda: queue.depth(POOL) == 1)
    assert queue.waiting_with(POOL, "interactive") == 1
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    room = queue.status()["pools"][POOL]
    assert (room["waiting"], room["waiting_bytes"], queue.waiting_with(POOL, "interactive")) == (0, 0, 0)
    assert counters.value(POOL, NORMAL, "a") == 0.0
    slots.release()
    assert (await slots.run(request("next", "b"))).queued_s == 0.0  # the room is open again


async def test_a_grant_cancelled_before_it_ran_passes_to_the_next() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    first = asyncio.create_task(slots.run(request("first", "a")))
    second = asyncio.create_task(slots.run(request("second", "b")))
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    slots.free = 1
    queue.notify(POOL)  # grants "first" ...
    first.cancel()  # ... whose client leaves before its task runs
    await second
    assert slots.order == ["second"]
    assert first.cancelled()


async def test_full_room_sheds_lower_bands_first_and_refuses_a_newcomer_of_the_lowest() -> None:
    queue = FlowQueue(MemoryCounters(), room_size=lambda pool: (2, 10**6), recheck_s=10.0)
    slots = Slots(queue, free=0)
    low = [asyncio.create_task(slots.run(request(f"low{i}", "c", band=LOW))) for i in range(2)]
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    with pytest.raises(QueueRejected) as refused:
        await slots.run(request("low2", "c", band=LOW))
    assert refused.value.reason == REASON_QUEUE_FULL
    normal = asyncio.create_task(slots.run(request("normal", "a")))
    with pytest.raises(QueueRejected) as shed:
        await low[1]  # the newest of the lowest band makes room
    assert shed.value.reason == REASON_SHED
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    slots.release(2)
    await normal
    await low[0]
    assert slots.order == ["normal", "low0"]


async def test_a_returning_tenant_is_lifted_to_the_waiting_minimum() -> None:
    counters = MemoryCounters()
    queue = FlowQueue(counters, recheck_s=10.0)
    slots = Slots(queue, free=1)
    counters.charge(POOL, NORMAL, "busy", 5000.0, dispatch=True)
    await slots.run(request("b0", "busy"))
    waiting = asyncio.create_task(slots.run(request("b1", "busy")))
    await wait_for_async(lambda: queue.depth(POOL) == 1)
    back = asyncio.create_task(slots.run(request("r0", "returning")))
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    assert counters.value(POOL, NORMAL, "returning") == counters.value(POOL, NORMAL, "busy")
    slots.release(2)
    await asyncio.gather(waiting, back)
    assert slots.order[1:] == ["b1", "r0"]  # equal counters, as many waiting: the earlier arrival first


async def test_a_gate_that_raises_while_waiting_takes_that_request_out() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)

    def detour() -> str | Blocked:
        if slots.free == 0:
            return Blocked.POOL  # full for everyone
        raise LookupError("shed: sheddable traffic goes first")  # room now, but not for this one

    doomed = asyncio.create_task(slots.run(request("doomed", "a"), ready=detour))
    other = asyncio.create_task(slots.run(request("other", "b")))
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    slots.release()
    with pytest.raises(LookupError):
        await doomed
    await other
    assert slots.order == ["other"] and queue.depth(POOL) == 0


async def test_a_tenant_held_by_the_reserve_passes_the_turn_to_another_tenant() -> None:
    counters = MemoryCounters()
    counters.charge(POOL, NORMAL, "b", 10_000.0, dispatch=True)  # b is far ahead: a comes first in order
    queue = FlowQueue(counters, recheck_s=10.0)
    slots = Slots(queue, free=0)

    def held_tenant(request_tenant: str) -> Callable[[], str | Blocked]:
        return lambda: Blocked.TENANT if request_tenant == "a" else slots.ready()

    flood = [asyncio.create_task(slots.run(request(f"a{i}", "a"), held_tenant("a"))) for i in range(6)]
    light = asyncio.create_task(slots.run(request("b0", "b"), held_tenant("b")))
    await wait_for_async(lambda: queue.depth(POOL) == 7)
    assert queue.activity.active(POOL)["a"].waiting == 6
    slots.release()  # more of a's requests than a round's tries: one answer skips all of them
    lease = await light
    assert slots.order == ["b0"] and queue.activity.active(POOL)["b"].inflight == 1
    lease.finished(None)
    seen = queue.activity.active(POOL)["b"]
    assert seen.inflight == 0 and seen.waiting == 0  # still active: its claim lasts `active_s`
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    assert queue.depth(POOL) == 0 and queue.activity.active(POOL)["a"].waiting == 0


async def test_a_refund_lands_at_the_tenants_next_dispatch_not_when_its_slot_frees() -> None:
    """A request ends exactly when a slot frees: a refund landing then would let the flood win it."""
    counters = MemoryCounters()
    queue = FlowQueue(counters, recheck_s=10.0)
    slots = Slots(queue, free=1)
    running = await slots.run(request("a0", "a", cost=1000.0))
    flood = [asyncio.create_task(slots.run(request(f"a{i}", "a", cost=1000.0))) for i in range(1, 4)]
    await wait_for_async(lambda: queue.depth(POOL) == 3)
    light = asyncio.create_task(slots.run(request("b0", "b", cost=1000.0)))
    await wait_for_async(lambda: queue.depth(POOL) == 4)
    assert counters.value(POOL, NORMAL, "b") == counters.value(POOL, NORMAL, "a") == 1000.0  # lifted to a's
    slots.free += 1
    running.finished(actual_cost_tokens=100.0)  # a's output ran far shorter than predicted; its slot is free
    await wait_for_async(lambda: len(slots.order) == 2)
    assert slots.order == ["a0", "b0"]  # the light tenant wins the freed slot
    await light
    assert counters.value(POOL, NORMAL, "a") == 1000.0 and queue.held_credit(POOL, NORMAL, "a") == -900.0
    slots.release()
    await wait_for_async(lambda: len(slots.order) == 3)
    assert slots.order[2] == "a1"
    assert counters.value(POOL, NORMAL, "a") == 1100.0  # credited at its next dispatch: 1000 - 900 + 1000
    assert queue.held_credit(POOL, NORMAL, "a") == 0.0
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_a_tenant_coming_back_keeps_no_refund_below_the_band_floor() -> None:
    counters = MemoryCounters()
    queue = FlowQueue(counters, recheck_s=10.0)
    slots = Slots(queue, free=1)
    light = await slots.run(request("b0", "b", cost=1000.0))
    flood = [asyncio.create_task(slots.run(request(f"a{i}", "a", cost=1000.0))) for i in range(3)]
    await wait_for_async(lambda: queue.depth(POOL) == 3)
    slots.free += 1
    light.finished(actual_cost_tokens=100.0)  # a refund of 900 held for b's next dispatch
    await wait_for_async(lambda: slots.order == ["b0", "a0"])
    back = asyncio.create_task(slots.run(request("b1", "b", cost=1000.0)))  # nothing of b waits: it comes back
    await wait_for_async(lambda: queue.depth(POOL) == 3)
    slots.release()
    await back
    assert slots.order[2] == "b1"
    # lifted to the floor (a's 1000), and the refund may not take it below: 1000 + 1000, not 100 + 1000
    assert counters.value(POOL, NORMAL, "b") == 2000.0 and queue.held_credit(POOL, NORMAL, "b") == 0.0
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_a_waiter_cancelled_before_its_task_ran_is_passed_over_not_granted() -> None:
    """Cancelling a waiter (its client left, its deadline struck) cancels its future at once; its task
    leaves the room only when it next runs. A slot freeing in between must go to the next one, not
    fail the caller of `notify` (the request whose end freed it) with InvalidStateError."""
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    gone = asyncio.create_task(slots.run(request("gone", "a")))
    await wait_for_async(lambda: queue.depth(POOL) == 1)
    other = asyncio.create_task(slots.run(request("b0", "b")))
    await wait_for_async(lambda: queue.depth(POOL) == 2)
    gone.cancel()
    slots.release()  # in the same step: "gone" is first in order, its future already cancelled
    await other
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert slots.order == ["b0"] and queue.depth(POOL) == 0


async def test_a_resumed_stream_goes_first_of_its_tenants_waiting_requests() -> None:
    """A stream cut to free its slot was admitted before its tenant's waiting requests: it waits
    again ahead of them (not behind its tenant's whole queue, where its band's deadline would end it)."""
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0)
    slots = Slots(queue, free=0)
    tasks = [asyncio.create_task(slots.run(request(f"a{i}", "a"))) for i in range(3)]
    await wait_for_async(lambda: queue.depth(POOL) == 3)
    resumed = FlowRequest("a-cut", "a", NORMAL, 100.0, 1.0, time.monotonic() + 30.0, resumed=True)
    tasks.append(asyncio.create_task(slots.run(resumed)))
    await wait_for_async(lambda: queue.depth(POOL) == 4)
    for _ in range(4):
        slots.release()
        await wait_for_async(lambda n=len(slots.order) + 1: len(slots.order) == n)  # type: ignore[misc]
    await asyncio.gather(*tasks)
    assert slots.order == ["a-cut", "a0", "a1", "a2"]
