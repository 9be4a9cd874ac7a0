"""A stalled Redis (a redis-server the test owns, stopped with SIGSTOP and resumed with SIGCONT): a
reservation whose reply times out may still have run once Redis resumes. Whatever the policy decides
(fail_open admits locally, fail_closed answers 503), the reservation Redis made is undone, so no
ticket, lease or bucket charge is left behind and the shared budget ends equal to what the requests
really cost."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.types import Rejection, Usage
from tests.policies.limits.redis_proc import RedisProcess
from tests.policies.limits.support import facts, policy, principal
from tests.support.polling import wait_for_async

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

PREFIX = "ambiguous-test"
LIMITS = [{"scope": "key", "tpd": 100_000, "max_concurrent": 4}]
BUDGETS = [{"scope": "tenant", "usd_per_day": 1000.0}]


def doc(store_failure: str, failures: int = 1) -> dict[str, Any]:
    return {
        "admission": {
            "store_failure": store_failure,
            "local_precheck": False,
            "breaker": {"failure_threshold": failures, "open_s": 0.2},
        },
        "limits": LIMITS,
        "budgets": BUDGETS,
    }


@pytest.fixture
async def connect(own_redis: RedisProcess) -> AsyncIterator[Callable[..., Admission]]:
    made: list[Admission] = []

    def factory(store_failure: str, failures: int = 1) -> Admission:
        store = FailoverStore(RedisStore.from_url(own_redis.url, prefix=PREFIX, timeout_s=0.1))
        admission = Admission(policy(**doc(store_failure, failures)), store)
        made.append(admission)
        return admission

    yield factory
    for admission in made:
        await admission.close()


def leftovers(own_redis: RedisProcess) -> dict[str, int]:
    """Tickets and leases still in Redis (every request of the test has finished by now)."""
    client = own_redis.client()
    tag = "{" + PREFIX + "}:"
    leases = sum(int(client.zcard(key)) for key in client.scan_iter(match=tag + "c:*"))
    return {"tickets": int(client.zcard(tag + "tickets")), "leases": leases}


def shared_spend(own_redis: RedisProcess) -> float:
    client = own_redis.client()
    return float(client.hget("{" + PREFIX + "}:u:tenant|usd_per_day|t1", "s") or 0.0)


def tokens_used(own_redis: RedisProcess) -> float:
    client = own_redis.client()
    return float(client.hget("{" + PREFIX + "}:b:key|tpd|k1", "u") or 0.0)


async def settle_all(adm: Admission, tickets: list[Admitted]) -> float:
    """Settle each ticket with 10 output tokens; returns what they really cost (the ledger's sum)."""
    for ticket in tickets:
        await adm.settle(ticket, Usage(prompt_tokens=100, completion_tokens=10), model="big")
    return sum(t.actual_cost_usd or 0.0 for t in tickets)


async def drained(adm: Admission) -> None:
    store = adm.store
    assert isinstance(store, FailoverStore)
    await adm.drain()
    await wait_for_async(lambda: store.status()["pending_settlements"] + store.status()["pending_voids"] == 0)
    await store.drain()


async def one(adm: Admission, served: list[Admitted]) -> None:
    """One request: admitted ones run briefly and are kept for settling."""
    result = await adm.admit(facts(principal(adm.policy)), "big")
    if isinstance(result, Admitted):
        await asyncio.sleep(0.01)
        served.append(result)


@pytest.mark.parametrize("store_failure", ["fail_closed", "fail_open"])
async def test_a_reservation_that_ran_after_its_timeout_is_undone(
    own_redis: RedisProcess, connect: Callable[..., Admission], store_failure: str
) -> None:
    adm = connect(store_failure)
    who = principal(adm.policy)
    served: list[Admitted] = []
    before = await adm.admit(facts(who), "big")
    assert isinstance(before, Admitted) and before.source == "redis"
    served.append(before)
    # The command waits in the stopped server's socket buffer and runs when it resumes: its reply
    # times out on our side although Redis will run it.
    with own_redis.stalled(0.6):
        stalled = await adm.admit(facts(who), "big")
    if store_failure == "fail_closed":
        assert isinstance(stalled, Rejection) and stalled.code == "limiter_unavailable"
    else:
        assert isinstance(stalled, Admitted) and stalled.source == "local"
        served.append(stalled)
    await asyncio.sleep(0.7)  # the server runs again: the stalled reservation has run in Redis
    cost = await settle_all(adm, served)
    await drained(adm)
    assert leftovers(own_redis) == {"tickets": 0, "leases": 0}
    assert shared_spend(own_redis) == pytest.approx(cost, rel=1e-9, abs=1e-12)
    # the shared bucket holds what the served requests really used (a local one's charged after the
    # fact), and nothing of the reservation that ran late (less a little refill)
    assert tokens_used(own_redis) == pytest.approx(110.0 * len(served), abs=10.0)


async def test_a_lease_is_not_locked_out_by_a_stall(own_redis: RedisProcess, connect: Callable[..., Admission]) -> None:
    """max_concurrent 4: four reservations lost in a stall must not hold the key's leases for the TTL."""
    adm = connect("fail_closed")
    who = principal(adm.policy)
    warm = await adm.admit(facts(who), "big")  # a pooled connection exists: the stall hits sent commands
    assert isinstance(warm, Admitted)
    await settle_all(adm, [warm])
    with own_redis.stalled(0.6):
        lost = await asyncio.gather(*(adm.admit(facts(who), "big") for _ in range(4)))
    assert all(isinstance(r, Rejection) for r in lost)
    await asyncio.sleep(0.7)
    await drained(adm)
    tickets = []
    for _ in range(4):
        ticket = await adm.admit(facts(who), "big")
        assert isinstance(ticket, Admitted), ticket
        tickets.append(ticket)
    await settle_all(adm, tickets)
    await drained(adm)
    assert leftovers(own_redis) == {"tickets": 0, "leases": 0}


async def test_a_sigstopped_redis_leaks_nothing(own_redis: RedisProcess, connect: Callable[..., Admission]) -> None:
    """Five stalls of a stopped redis-server under a steady stream of requests (both policies)."""
    assert own_redis.proc is not None
    pid = own_redis.proc.pid
    for store_failure in ("fail_open", "fail_closed"):
        adm = connect(store_failure, failures=3)
        served: list[Admitted] = []
        spend_before = shared_spend(own_redis)

        for _ in range(5):
            tasks = [asyncio.ensure_future(one(adm, served)) for _ in range(10)]
            await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGSTOP)
            tasks += [asyncio.ensure_future(one(adm, served)) for _ in range(10)]
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGCONT)
            await asyncio.gather(*tasks)
        cost = await settle_all(adm, served)
        await drained(adm)
        assert leftovers(own_redis) == {"tickets": 0, "leases": 0}, store_failure
        assert shared_spend(own_redis) - spend_before == pytest.approx(cost, rel=1e-6), store_failure


async def test_local_state_of_a_short_failure_does_not_outlive_it(
    own_redis: RedisProcess, connect: Callable[..., Admission]
) -> None:
    """One failed call (the breaker stays closed) admits locally; a later failed call must start from
    what Redis reported since, not from the numbers of the first."""
    adm = connect("fail_open", failures=3)
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    with own_redis.stalled(0.3):
        first = await adm.admit(facts(who), "big")
    assert isinstance(first, Admitted) and first.source == "local"
    await asyncio.sleep(0.4)
    await settle_all(adm, [first])
    back = await adm.admit(facts(who), "big")
    assert isinstance(back, Admitted) and back.source == "redis"
    assert store.status()["breaker"] == "closed"
    assert store.local.status()["buckets"] == 0 and store.local.status()["budgets"] == 0
    await settle_all(adm, [back])
    await drained(adm)
