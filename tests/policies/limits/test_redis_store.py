"""The Redis scripts themselves: one slot, Redis's clock, NOSCRIPT recovery, expiry, idempotent settle."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from redis.crc import key_slot

from policies.limits import memory_store
from policies.limits.plan import Charge, Plan, Settlement
from policies.limits.redis_store import RedisStore
from tests.policies.limits.support import policy, principal

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


def full_plan() -> Plan:
    p = policy(
        limits=[{"scope": "key", "tpm": 6000, "max_concurrent": 5}, {"scope": "global", "rpm": 100}],
        budgets=[{"scope": "tenant", "usd_per_day": 1.0, "usd_per_month": 10.0}],
    )
    return p.admission_plan(principal(p), "big")


async def test_every_key_of_a_request_lives_in_one_cluster_slot(store: RedisStore, redis_prefix: str) -> None:
    plan = full_plan()
    out = await store.reserve(plan, Charge("t1", [1100.0, 1.0], 0.01))
    assert out.admitted
    keys = [k async for k in store.client.scan_iter(match=f"{{{redis_prefix}}}:*")]
    assert len(keys) == 1 + 2 + 1 + 2  # tickets, two buckets, one lease set, two budgets
    assert len({key_slot(k) for k in keys}) == 1


async def test_the_script_uses_redis_time(store: RedisStore) -> None:
    seconds, micros = await store.client.time()
    out = await store.reserve(full_plan(), Charge("t1", [1.0, 1.0], 0.0))
    assert abs(out.now_s - (seconds + micros / 1e6)) < 5.0


async def test_a_flushed_script_cache_is_reloaded(store: RedisStore) -> None:
    plan = full_plan()
    assert (await store.reserve(plan, Charge("t1", [1.0, 1.0], 0.0))).admitted
    await store.client.script_flush()
    assert (await store.reserve(plan, Charge("t2", [1.0, 1.0], 0.0))).admitted
    await store.client.script_flush()
    assert await store.apply(plan, Settlement("t2", "redis", [0.0, 0.0], 0.0, [0, 0], 0.0))


async def test_idle_state_expires(store: RedisStore) -> None:
    plan = full_plan()
    await store.reserve(plan, Charge("t1", [6000.0, 1.0], 0.0))
    bucket_ttl_ms = await store.client.pttl(store.key("b", plan.buckets[0].key))
    assert 60_000 < bucket_ttl_ms <= 61_000  # a full 6000-token bucket drains in 60 s
    lease_ttl_ms = await store.client.pttl(store.key("c", plan.leases[0].key))
    assert 0 < lease_ttl_ms <= (plan.settings.lease_ttl_s + 1) * 1000
    assert await store.client.ttl(store.key("u", plan.budgets[0].key)) > 0


async def test_settle_applies_once(store: RedisStore) -> None:
    plan = full_plan()
    out = await store.reserve(plan, Charge("t1", [1100.0, 1.0], 0.04))
    settlement = Settlement("t1", "redis", [-990.0, 0.0], -0.03, out.budget_periods, 0.01)
    assert await store.apply(plan, settlement) is True
    assert await store.apply(plan, settlement) is False
    used = float(await store.client.hget(store.key("b", plan.buckets[0].key), "u") or 0)
    assert used == pytest.approx(110.0, abs=1.0)
    assert await store.client.zcard(store.key("c", plan.leases[0].key)) == 0


async def test_fail_open_charges_are_pushed_once(store: RedisStore) -> None:
    plan = full_plan()
    now = datetime(2025, 6, 15, tzinfo=UTC).timestamp()
    periods = [memory_store.period_id("day", now), memory_store.period_id("month", now)]
    settlement = Settlement("local-1", "local", [0.0, 0.0], 0.0, periods, 0.25)
    assert await store.charge_budgets(plan, settlement, now_s=now) is True
    assert await store.charge_budgets(plan, settlement, now_s=now) is False
    out = await store.reserve(plan, Charge("t1", [1.0, 1.0], 0.0), now_s=now)
    assert out.budget_spent == [0.25, 0.25]


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC),
        datetime(2024, 3, 1, tzinfo=UTC),
        datetime(2025, 12, 31, 23, 59, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC),
        datetime(2100, 3, 1, tzinfo=UTC),
    ],
    ids=["leap-day", "march", "new-years-eve", "new-year", "2100"],
)
async def test_lua_calendar_matches_python(store: RedisStore, moment: datetime) -> None:
    plan = full_plan()
    now = moment.timestamp()
    out = await store.reserve(plan, Charge(f"t-{now}", [0.0, 0.0], 0.0), now_s=now)
    assert out.budget_periods == [memory_store.period_id("day", now), memory_store.period_id("month", now)]


async def test_budget_resets_when_the_period_changes(store: RedisStore) -> None:
    plan = full_plan()
    day = datetime(2025, 6, 15, 23, 0, tzinfo=UTC).timestamp()
    await store.reserve(plan, Charge("a", [0.0, 0.0], 0.9), now_s=day)
    assert not (await store.reserve(plan, Charge("b", [0.0, 0.0], 0.2), now_s=day)).admitted
    out = await store.reserve(plan, Charge("c", [0.0, 0.0], 0.2), now_s=day + 3600)
    assert out.admitted and out.budget_spent == [0.0, 0.9]  # a new day; the month carries on
