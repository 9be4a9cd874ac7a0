"""Settling without waiting (`Admission.settle_soon`, `FailoverStore.apply_soon`) and the raw script
connection (`ScriptPipe`): the settlement is on Redis's connection before the call returns, so this
process's next reservation sees it; a stalled or failing Redis never blocks the caller, and the
settlement still lands exactly once (a replay of one that ran late is a no-op); a reservation whose
caller went away while Redis stalled is undone; and the connection works under uvloop, which the
gateway runs on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop

from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.plan import Charge, Settlement
from policies.limits.redis_store import RedisStore
from policies.limits.scriptpipe import ScriptPipe
from policies.types import Usage
from tests.policies.limits.redis_proc import RedisProcess
from tests.policies.limits.support import facts, policy, principal
from tests.policies.limits.test_ambiguous import drained, leftovers, tokens_used
from tests.support.polling import wait_for_async

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

T0 = 1_000_000.0
PREFIX = "ambiguous-test"  # what test_ambiguous's helpers read


@pytest.fixture
async def shared(redis_url: str, redis_prefix: str) -> AsyncIterator[Admission]:
    adm = Admission(
        policy(limits=[{"scope": "key", "tpm": 100_000, "max_concurrent": 5}]),
        FailoverStore(RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)),
    )
    yield adm
    await adm.close()


@pytest.fixture
async def stalling(own_redis: RedisProcess) -> AsyncIterator[Callable[[], Admission]]:
    made: list[Admission] = []

    def factory() -> Admission:
        doc = {
            "admission": {"store_failure": "fail_closed", "local_precheck": False, "breaker": {"failure_threshold": 3}},
            "limits": [{"scope": "key", "tpd": 100_000, "max_concurrent": 4}],
        }
        adm = Admission(policy(**doc), FailoverStore(RedisStore.from_url(own_redis.url, prefix=PREFIX, timeout_s=0.1)))
        made.append(adm)
        return adm

    yield factory
    for adm in made:
        await adm.close()


async def test_the_next_reservation_sees_a_settlement_not_waited_for(shared: Admission) -> None:
    store = shared.store
    assert isinstance(store, FailoverStore)
    assert isinstance(store.redis.pipeline, ScriptPipe)  # a plain TCP client gets the raw connection
    who = principal(shared.policy)
    plan = shared.policy.admission_plan(who, "big")
    tickets: list[Admitted] = []
    writes = store.redis.pipeline.batches
    for i in range(20):
        ticket = await shared.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0)
        assert isinstance(ticket, Admitted) and ticket.source == "redis"
        tickets.append(ticket)
        assert shared.settle_soon(ticket, Usage(100, 10), model="big", now=T0) is not None  # nothing awaited
        outcome = await store.redis.reserve(plan, Charge(f"probe-{i}", [0.0], 0.0), T0)
        assert outcome.bucket_used == [pytest.approx(110.0 * (i + 1))]  # the settlement ran first
        assert outcome.lease_active == [0]  # its lease went back before the probe's was taken
        await store.redis.apply(plan, Settlement(f"probe-{i}", "redis", [0.0], 0.0, outcome.budget_periods, 0.0))
    await shared.drain()
    # per request: the reservation; the settlement, which waited and went out with the probe; the
    # probe's own settlement (awaited here, so not held back)
    assert store.redis.pipeline.batches - writes == 3 * 20
    assert shared.settle_soon(tickets[0], Usage(100, 10), model="big", now=T0) is None  # once only


async def test_a_stalled_redis_does_not_hold_up_a_settlement_and_it_lands_once(
    own_redis: RedisProcess, stalling: Callable[[], Admission]
) -> None:
    adm = stalling()
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    tickets = []
    for _ in range(4):
        ticket = await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big")
        assert isinstance(ticket, Admitted) and ticket.source == "redis"
        tickets.append(ticket)
    with own_redis.stalled(0.6):
        pending = [adm.settle_soon(t, Usage(100, 10), model="big") for t in tickets]
        assert all(p is not None and not p.done() for p in pending)  # returned while Redis is stopped
        # the 100 ms timeout ends the connection: the settlements wait in the replay queue (they may
        # also have run: the commands sit in the stopped server's socket buffer)
        await wait_for_async(lambda: store.status()["pending_settlements"] == 4 or store.stats["replayed"] > 0)
    await drained(adm)
    assert leftovers(own_redis) == {"tickets": 0, "leases": 0}
    assert tokens_used(own_redis) == pytest.approx(4 * 110.0, abs=10.0)  # each settled once (less refill)


async def test_a_reservation_abandoned_in_a_stall_is_undone(
    own_redis: RedisProcess, stalling: Callable[[], Admission]
) -> None:
    adm = stalling()
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    warm = await adm.admit(facts(who), "big")  # the connection exists: the stall hits a sent command
    assert isinstance(warm, Admitted)
    adm.settle_soon(warm, Usage(100, 10), model="big")
    await adm.drain()
    with own_redis.stalled(0.6):
        task = asyncio.ensure_future(adm.admit(facts(who, prompt_tokens=5000), "big"))
        await asyncio.sleep(0.02)  # written to the stopped server's socket
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.sleep(0.7)  # the server runs again: the abandoned reservation has run, or is refused
    await drained(adm)
    assert store.stats["voided"] >= 1
    assert leftovers(own_redis) == {"tickets": 0, "leases": 0}
    assert tokens_used(own_redis) == pytest.approx(110.0, abs=10.0)  # only the warm request's


def test_the_script_connection_runs_on_uvloop(redis_url: str, redis_prefix: str) -> None:
    async def exercise() -> tuple[bool, bool, int]:
        store = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)
        p = policy(limits=[{"scope": "key", "rpm": 1000}])
        plan = p.admission_plan(principal(p), "big")
        try:
            outcomes = await asyncio.gather(*(store.reserve(plan, Charge(f"t{i}", [1.0], 0.0)) for i in range(8)))
            settled = await store.apply(plan, Settlement("t0", "redis", [0.0], 0.0, outcomes[0].budget_periods, 0.0))
            return all(o.admitted for o in outcomes), settled, store.pipeline.batches
        finally:
            await store.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        admitted, settled, batches = runner.run(exercise())
    assert admitted and settled and batches >= 1


async def test_close_fails_calls_still_waiting_for_a_connection(redis_url: str, redis_prefix: str) -> None:
    store = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)
    p = policy(limits=[{"scope": "key", "rpm": 1000}])
    plan = p.admission_plan(principal(p), "big")
    call = asyncio.ensure_future(store.reserve(plan, Charge("t1", [1.0], 0.0)))
    await asyncio.sleep(0)  # queued, the connection still being opened
    await store.close()
    with pytest.raises(Exception, match="closed"):
        await asyncio.wait_for(call, 10)


async def test_one_stall_counts_once_against_the_breaker(
    own_redis: RedisProcess, stalling: Callable[[], Admission]
) -> None:
    """Ten reservations on one connection that times out fail with one error: the breaker (3 failures)
    hears of it once, and once more for their voids, so a single stall cannot open it by itself."""
    adm = stalling()
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    warm = await adm.admit(facts(who), "big")
    assert isinstance(warm, Admitted)
    adm.settle_soon(warm, Usage(100, 10), model="big")
    await adm.drain()
    with own_redis.stalled(0.6):
        results = await asyncio.gather(*(adm.admit(facts(who), "big") for _ in range(10)))
    assert store.stats["redis_errors"] >= 10
    assert store.breaker.trips == 0 and store.breaker.state == "closed"
    await asyncio.sleep(0.7)
    await drained(adm)
    served = [r for r in results if isinstance(r, Admitted)]
    for ticket in served:
        adm.settle_soon(ticket, Usage(100, 10), model="big")
    await drained(adm)
    assert leftovers(own_redis) == {"tickets": 0, "leases": 0}
