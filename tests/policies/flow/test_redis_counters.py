"""Virtual counters in a real Redis, shared by two stores standing for two gateway replicas."""

from __future__ import annotations

import pytest

from policies.flow.order import Counters, MemoryCounters
from policies.flow.redis_counters import RedisCounters
from tests.support.polling import wait_for_async

pytestmark = pytest.mark.redis


async def test_two_replicas_see_each_others_charges(redis_url: str, redis_prefix: str) -> None:
    one = RedisCounters.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    two = RedisCounters.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    try:
        one.charge("pool", 2, "a", 300.0, dispatch=True)
        assert one.value("pool", 2, "a") == 300.0  # visible locally at once, before Redis answers
        await wait_for_async(lambda: one.status()["calls"] == 1 and not one.status()["pending"])
        two.watch("pool", 2, True)  # requests wait on replica two: it re-reads the band
        await wait_for_async(lambda: two.value("pool", 2, "a") == 300.0)
        two.charge("pool", 2, "b", 50.0, dispatch=True)
        two.charge("pool", 2, "a", -100.0, dispatch=False)  # a correction made on the other replica
        await wait_for_async(lambda: not two.status()["pending"])
        one.charge("pool", 2, "c", 1.0, dispatch=True)  # any reply brings the whole band
        await wait_for_async(lambda: one.value("pool", 2, "b") == 50.0 and one.value("pool", 2, "a") == 200.0)
        assert one.last_served("pool", 2) == 0.0  # c's counter before its charge
        assert two.age_s("pool", 2) < 5.0 and one.age_s("other", 0) == float("inf")
        assert one.status()["errors"] == two.status()["errors"] == 0
    finally:
        await one.close()
        await two.close()


async def test_a_lift_is_kept_until_redis_has_it_and_never_lowers(redis_url: str, redis_prefix: str) -> None:
    store = RedisCounters.from_url(redis_url, prefix=redis_prefix)
    try:
        store.charge("pool", 2, "busy", 1000.0, dispatch=True)
        store.lift("pool", 2, "back", 1000.0)
        assert store.value("pool", 2, "back") == 1000.0  # ordering sees the lift at once
        await wait_for_async(lambda: not store.status()["pending"])
        assert store.value("pool", 2, "back") == 1000.0  # and after Redis answered
        store.lift("pool", 2, "back", 10.0)  # a lower floor changes nothing
        await wait_for_async(lambda: not store.status()["pending"])
        assert store.value("pool", 2, "back") == 1000.0
    finally:
        await store.close()


async def test_a_dispatch_takes_off_held_back_refunds_never_below_its_floor(redis_url: str, redis_prefix: str) -> None:
    store = RedisCounters.from_url(redis_url, prefix=redis_prefix)
    try:
        store.charge("pool", 2, "a", 1000.0, dispatch=True)
        store.charge("pool", 2, "a", 100.0, dispatch=True, credit=-300.0)  # waiting all along: all of it
        assert store.value("pool", 2, "a") == 800.0  # the view at once
        await wait_for_async(lambda: not store.status()["pending"])
        assert store.value("pool", 2, "a") == 800.0 and store.last_served("pool", 2) == 700.0
        store.charge("pool", 2, "b", 100.0, dispatch=True, credit=-500.0, floor=600.0)  # coming back
        assert store.value("pool", 2, "b") == 700.0
        await wait_for_async(lambda: not store.status()["pending"])
        assert store.value("pool", 2, "b") == 700.0 and store.last_served("pool", 2) == 600.0
        assert store.status()["errors"] == 0
    finally:
        await store.close()


async def test_an_unreachable_redis_keeps_changes_local() -> None:
    store = RedisCounters.from_url("redis://127.0.0.1:1/0", prefix="tokenway-test-unreachable", timeout_s=0.05)
    try:
        store.charge("pool", 2, "a", 40.0, dispatch=True)
        store.lift("pool", 2, "b", 10.0)
        await wait_for_async(lambda: not store.status()["pending"])
        assert store.status()["errors"] == 1  # the two changes went out in one call
        assert store.status()["changes"] == 2
        assert store.value("pool", 2, "a") == 40.0 and store.value("pool", 2, "b") == 10.0
        assert store.age_s("pool", 2) == float("inf")  # never heard from Redis
    finally:
        await store.close()


async def test_a_batch_of_changes_lands_where_the_changes_one_by_one_would(redis_url: str, redis_prefix: str) -> None:
    """Lifts, credits and charges of one loop turn fold into one call per band; Redis then holds what
    applying them one at a time gives (the memory store is the reference), last served included."""
    store = RedisCounters.from_url(redis_url, prefix=redis_prefix, flush_s=0.001)
    reference = MemoryCounters()

    def ops(counters: Counters) -> None:
        counters.charge("pool", 1, "a", 100.0, dispatch=True)
        counters.lift("pool", 1, "b", 60.0)
        counters.charge("pool", 1, "b", 30.0, dispatch=True)
        counters.charge("pool", 1, "a", -20.0, dispatch=False)
        counters.lift("pool", 1, "a", 500.0)
        counters.charge("pool", 1, "c", 5.0, dispatch=True, credit=-3.0, floor=40.0)  # back: the floor holds
        counters.lift("pool", 1, "c", 2.0)  # below c's counter: nothing
        counters.charge("pool", 1, "a", 7.5, dispatch=True, credit=-200.0)  # waiting all along: all of it
        counters.charge("pool", 1, "b", -10.0, dispatch=False)
        counters.charge("pool", 1, "b", 1.0, dispatch=True, credit=-50.0, floor=70.0)

    try:
        for rounds in range(2):  # the second batch starts from what the first left in Redis
            ops(store)
            ops(reference)
            for tenant in "abc":  # the local view agrees before Redis answers
                assert store.value("pool", 1, tenant) == pytest.approx(reference.value("pool", 1, tenant))
            assert store.last_served("pool", 1) == pytest.approx(reference.last_served("pool", 1))
            await wait_for_async(lambda: not store.status()["pending"])
            assert store.status()["calls"] == rounds + 1
        fresh = RedisCounters.from_url(redis_url, prefix=redis_prefix)  # another replica reads the band
        try:
            fresh.refresh_s = 0.01
            fresh.watch("pool", 1, True)
            await wait_for_async(lambda: fresh.age_s("pool", 1) < 60.0)
            for tenant in "abc":
                assert fresh.value("pool", 1, tenant) == pytest.approx(reference.value("pool", 1, tenant))
            assert fresh.last_served("pool", 1) == pytest.approx(reference.last_served("pool", 1))
        finally:
            await fresh.close()
        assert store.status()["errors"] == 0
    finally:
        await store.close()


@pytest.mark.parametrize("corrupt", ["wrong type", "not numbers"])
async def test_a_band_holding_what_no_script_wrote_reads_as_zero_and_is_repaired(
    redis_url: str, redis_prefix: str, corrupt: str
) -> None:
    """Another replica's version or a hand edit can leave anything in the band's keys: the script
    answers all the same (a key of another type replaced, a counter that is not a finite number read as
    0), and no NaN reaches the order of fair shares."""
    store = RedisCounters.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    counters, last = store.keys("pool", 2)
    try:
        if corrupt == "wrong type":
            await store.client.rpush(counters, "x")
            await store.client.sadd(last, "y")
        else:
            await store.client.hset(counters, mapping={"a": "nan", "b": "inf", "c": "text", "\xff": "-inf"})
            await store.client.set(last, "nan")
        store.charge("pool", 2, "a", 10.0, dispatch=True)
        store.charge("pool", 2, "b", 20.0, dispatch=False)
        await wait_for_async(lambda: store.status()["calls"] != 0 and not store.status()["pending"])
        assert store.status()["errors"] == 0
        assert store.value("pool", 2, "a") == 10.0 and store.value("pool", 2, "b") == 20.0
        assert store.value("pool", 2, "c") == 0.0 and store.last_served("pool", 2) == 0.0
    finally:
        await store.close()
