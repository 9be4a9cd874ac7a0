"""Programs' attained service in a real Redis, shared by two stores standing for two gateway replicas."""

from __future__ import annotations

import pytest

from policies.flow.redis_counters import RedisPrograms
from tests.support.polling import wait_for_async

pytestmark = pytest.mark.redis


def near(value: float, expected: float) -> bool:
    return abs(value - expected) <= 0.01 * expected + 1e-6


async def test_two_replicas_see_each_others_service(redis_url: str, redis_prefix: str) -> None:
    one = RedisPrograms.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    two = RedisPrograms.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    try:
        one.charge("t", "wide", 4000.0, 3600.0)
        assert one.value("t", "wide", 3600.0) == 4000.0  # visible locally at once, before Redis answers
        await wait_for_async(lambda: one.calls >= 1 and not one.status()["pending"])
        assert near(one.value("t", "wide", 3600.0), 4000.0)
        two.watch("t", "wide", True)  # its requests wait on replica two: it re-reads the program
        await wait_for_async(lambda: near(two.value("t", "wide", 3600.0), 4000.0))
        two.charge("t", "wide", -1000.0, 3600.0)  # a correction made on the other replica
        two.charge("t", "single", 100.0, 3600.0)
        await wait_for_async(lambda: not two.status()["pending"])
        one.watch("t", "single", True)
        await wait_for_async(lambda: near(one.value("t", "single", 3600.0), 100.0))
        one.charge("t", "wide", 0.0, 3600.0)  # a change brings the program's value back with it
        await wait_for_async(lambda: near(one.value("t", "wide", 3600.0), 3000.0))
        assert one.value("u", "wide", 3600.0) == 0.0  # programs are per tenant
        assert one.status()["errors"] == two.status()["errors"] == 0
    finally:
        await one.close()
        await two.close()


async def test_service_decays_in_redis_and_programs_are_bounded(redis_url: str, redis_prefix: str) -> None:
    store = RedisPrograms.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02, max_programs=3)
    try:
        store.charge("t", "p", 1000.0, 0.05)  # a half-life of 50 ms
        await wait_for_async(lambda: not store.status()["pending"])
        store.watch("t", "p", True)
        await wait_for_async(lambda: store.value("t", "p", 0.05) < 10.0)  # the re-reads see it decayed
        for name in ("a", "b", "c", "d"):
            store.charge("t", name, 10.0, 3600.0)
        await wait_for_async(lambda: not store.status()["pending"])
        values, times = store.keys("t")
        assert await store.client.hlen(values) == 3 and await store.client.zcard(times) == 3
        assert store.programs("t") <= 3
    finally:
        await store.close()


async def test_a_failed_call_keeps_the_changes_locally() -> None:
    store = RedisPrograms.from_url("redis://127.0.0.1:1/0", timeout_s=0.05)  # nothing listens there
    try:
        store.charge("t", "p", 500.0, 3600.0)
        await wait_for_async(lambda: store.errors >= 1 and not store.status()["pending"])
        assert near(store.value("t", "p", 3600.0), 500.0)
    finally:
        await store.close()


@pytest.mark.parametrize("corrupt", ["wrong type", "not numbers"])
async def test_programs_holding_what_no_script_wrote_read_as_none_and_are_repaired(
    redis_url: str, redis_prefix: str, corrupt: str
) -> None:
    """A tenant's program keys of another type are replaced, and a value that is not a finite number
    reads as no service: the script answers all the same and no NaN reaches the order."""
    store = RedisPrograms.from_url(redis_url, prefix=redis_prefix, refresh_s=0.02)
    values, times = store.keys("t")
    try:
        if corrupt == "wrong type":
            await store.client.set(values, "x")
            await store.client.set(times, "y")
        else:
            await store.client.hset(values, mapping={"wide": "nan", "other": "inf"})
            await store.client.zadd(times, {"wide": float("-inf"), "other": float("inf")})
        store.charge("t", "wide", 100.0, 3600.0)
        store.watch("t", "other", True)
        await wait_for_async(lambda: store.calls >= 1 and not store.status()["pending"])
        assert store.status()["errors"] == 0
        assert near(store.value("t", "wide", 3600.0), 100.0)
        assert store.value("t", "other", 3600.0) == 0.0
    finally:
        await store.close()
