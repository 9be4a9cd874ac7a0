"""A client that disconnects cancels its handler mid-admission (the gateway runs with handler
cancellation on): a reservation Redis made anyway is undone, and a settlement under way completes.
(A reservation cancelled before its connection opened is never sent: nothing to undo.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.limits.scriptpipe import ScriptPipe, command
from policies.types import Usage
from tests.policies.limits.state import active_leases, bucket_used
from tests.policies.limits.support import facts, policy, principal

pytestmark = pytest.mark.redis

T0 = 1_000_000.0


@pytest.fixture
async def admission(redis_url: str, redis_prefix: str) -> AsyncIterator[Admission]:
    p = policy(limits=[{"scope": "key", "tpm": 100_000, "max_concurrent": 5}])
    adm = Admission(p, FailoverStore(RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)))
    yield adm
    await adm.close()


async def test_a_cancelled_admission_leaks_no_reservation(admission: Admission) -> None:
    plan = admission.policy.admission_plan(principal(admission.policy), "big")
    who = principal(admission.policy)
    store = admission.store
    assert isinstance(store, FailoverStore) and isinstance(store.redis.pipeline, ScriptPipe)
    await store.redis.pipeline.submit(command(b"PING"), None)  # connected: a command goes out once queued
    task = asyncio.ensure_future(admission.admit(facts(who), "big", now=T0))
    await asyncio.sleep(0)  # the reservation is on its way to Redis
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    await admission.drain()
    assert await store.redis.client.exists(store.redis.key("b", plan.buckets[0].key))  # it was reserved...
    assert await bucket_used(admission, plan.buckets[0], T0) == 0.0  # ... and undone
    assert await active_leases(admission, plan.leases[0].key, T0) == 0


async def test_a_cancelled_settle_still_completes(admission: Admission) -> None:
    who = principal(admission.policy)
    plan = admission.policy.admission_plan(who, "big")
    ticket = await admission.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0)
    assert isinstance(ticket, Admitted)
    task = asyncio.ensure_future(admission.settle(ticket, Usage(100, 10), model="big", now=T0))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await admission.drain()
    assert await bucket_used(admission, plan.buckets[0], T0) == pytest.approx(110)
    assert await active_leases(admission, plan.leases[0].key, T0) == 0
