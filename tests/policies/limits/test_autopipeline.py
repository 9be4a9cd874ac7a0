"""Calls made in one event-loop turn share one pipelined write; NOSCRIPT and dead connections are
handled per batch without stranding any caller."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from policies.limits.plan import Charge, Plan
from policies.limits.redis_store import RedisStore
from tests.policies.limits.support import policy, principal
from tests.support.procs import free_port

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


def plan() -> Plan:
    p = policy(limits=[{"scope": "key", "rpm": 1000}])
    return p.admission_plan(principal(p), "big")


async def test_concurrent_calls_share_one_write_and_each_gets_its_reply(store: RedisStore) -> None:
    the_plan = plan()
    outcomes = await asyncio.gather(*(store.reserve(the_plan, Charge(f"t{i}", [1.0], 0.0), 1e6) for i in range(50)))
    assert all(o.admitted for o in outcomes)
    assert sorted(o.bucket_used[0] for o in outcomes) == [float(i) for i in range(50)]  # one after another
    assert store.pipeline.calls == 50 and store.pipeline.batches == 1


async def test_a_batch_survives_a_flushed_script_cache(store: RedisStore) -> None:
    the_plan = plan()
    await store.reserve(the_plan, Charge("warm", [1.0], 0.0))
    await store.client.script_flush()
    outcomes = await asyncio.gather(*(store.reserve(the_plan, Charge(f"t{i}", [1.0], 0.0)) for i in range(10)))
    assert all(o.admitted for o in outcomes)


async def test_a_dead_connection_fails_every_caller_of_the_batch() -> None:
    dead = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    the_plan = plan()
    results = await asyncio.gather(
        *(dead.reserve(the_plan, Charge(f"t{i}", [1.0], 0.0)) for i in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    await dead.close()


async def test_a_cancelled_caller_does_not_strand_the_others(store: RedisStore) -> None:
    the_plan = plan()
    tasks = [asyncio.ensure_future(store.reserve(the_plan, Charge(f"t{i}", [1.0], 0.0))) for i in range(5)]
    await asyncio.sleep(0)
    tasks[0].cancel()
    done = await asyncio.gather(*tasks[1:])
    assert all(o.admitted for o in done)


async def test_unpipelined_mode_also_recovers_from_noscript(redis_url: str, redis_prefix: str) -> None:
    plain = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0, batch=False)
    await plain.client.script_flush()
    outcomes = await asyncio.gather(*(plain.reserve(plan(), Charge(f"t{i}", [1.0], 0.0)) for i in range(5)))
    assert all(o.admitted for o in outcomes) and plain.pipeline.batches == 0
    await plain.close()
