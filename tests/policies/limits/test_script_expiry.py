"""When the Redis scripts set a key's expiry, now that they leave out the commands that would not move it
(a refund's PEXPIRE, a budget's EXPIRE on every write inside its period): every key still expires, never
before its state has drained or its period has ended, and the counts read the same."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.limits.plan import Charge, Plan, Settlement
from policies.limits.redis_store import RedisStore
from policies.types import RequestSubjects
from tests.policies.limits.support import policy, principal
from tests.policies.limits.test_hierarchy import org_policy

pytestmark = pytest.mark.redis

DAY = datetime(2025, 6, 15, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


def plan_with_budgets() -> Plan:
    p = policy(
        limits=[{"scope": "key", "tpm": 6000}],
        budgets=[{"scope": "tenant", "usd_per_day": 10.0, "usd_per_month": 100.0}],
    )
    return p.admission_plan(principal(p), "big")


async def used(store: RedisStore, plan: Plan) -> float:
    return float(await store.client.hget(store.key("b", plan.buckets[0].key), "u") or 0)


async def test_a_refunded_bucket_keeps_an_expiry_past_its_drain(store: RedisStore) -> None:
    plan = plan_with_budgets()
    out = await store.reserve(plan, Charge("t1", [6000.0], 0.0))
    refund = Settlement("t1", "redis", [-3000.0], 0.0, out.budget_periods, 0.0)
    assert await store.apply(plan, refund)
    assert await used(store, plan) == pytest.approx(3000.0, abs=20.0)
    ttl_ms = await store.client.pttl(store.key("b", plan.buckets[0].key))
    assert 30_000 < ttl_ms <= 61_000  # what is left drains in 30 s: the key outlives it


async def test_a_settlement_that_finds_its_bucket_gone_gives_it_an_expiry(store: RedisStore) -> None:
    plan = plan_with_budgets()
    key = store.key("b", plan.buckets[0].key)
    for ticket, delta in (("refund", -100.0), ("extra", 100.0)):
        out = await store.reserve(plan, Charge(ticket, [200.0], 0.0))
        await store.client.delete(key)  # expired (or evicted) between the reservation and its settlement
        assert await store.apply(plan, Settlement(ticket, "redis", [delta], 0.0, out.budget_periods, 0.0))
        assert await used(store, plan) == pytest.approx(max(delta, 0.0), abs=1.0)
        assert await store.client.pttl(key) > 0


async def test_a_void_keeps_the_bucket_expiring(store: RedisStore) -> None:
    plan = plan_with_budgets()
    charge = Charge("t1", [6000.0], 0.5)
    await store.reserve(plan, charge)
    assert await store.void(plan, charge)
    assert await used(store, plan) == pytest.approx(0.0, abs=20.0)
    assert await store.client.pttl(store.key("b", plan.buckets[0].key)) > 0


async def test_a_budget_expiry_is_set_when_its_period_starts(store: RedisStore) -> None:
    plan = plan_with_budgets()
    day_key, month_key = (store.key("u", budget.key) for budget in plan.budgets)
    out = await store.reserve(plan, Charge("a", [0.0], 1.0), now_s=DAY)
    assert 172_000 < await store.client.ttl(day_key) <= 172_800  # two days: past the day's end
    assert 2_764_000 < await store.client.ttl(month_key) <= 2_764_800  # 32 days: past the month's end
    settle = Settlement("a", "redis", [0.0], -0.25, out.budget_periods, 0.75)
    assert await store.apply(plan, settle, now_s=DAY + 60)
    await store.reserve(plan, Charge("b", [0.0], 1.0), now_s=DAY + 120)
    assert await store.client.ttl(day_key) > 0 and await store.client.ttl(month_key) > 0
    # the next day starts the day budget's period again: its expiry is set anew, the month's is not
    await store.client.expire(day_key, 7200)
    await store.client.expire(month_key, 7200)
    out = await store.reserve(plan, Charge("c", [0.0], 1.0), now_s=DAY + 86_400)
    assert out.budget_spent == [0.0, pytest.approx(1.75)]
    assert await store.client.ttl(day_key) > 172_000
    assert 0 < await store.client.ttl(month_key) <= 7200


async def test_a_fail_open_charge_that_starts_a_period_sets_the_expiry(store: RedisStore) -> None:
    plan = plan_with_budgets()
    day_key = store.key("u", plan.budgets[0].key)
    out = await store.reserve(plan, Charge("a", [0.0], 1.0), now_s=DAY)
    await store.client.expire(day_key, 7200)
    periods = [out.budget_periods[0] + 1, out.budget_periods[1]]  # a local admission the next day
    assert await store.charge_budgets(plan, Settlement("local-1", "local", [0.0], 0.0, periods, 0.5))
    assert await store.client.ttl(day_key) > 172_000
    out = await store.reserve(plan, Charge("b", [0.0], 0.0), now_s=DAY + 86_400)
    assert out.budget_spent == [0.5, 1.5]


async def test_an_agent_runs_budget_expiry_follows_its_last_write(store: RedisStore) -> None:
    p = org_policy(budgets=[{"scope": "program", "usd_per_run": 5.0}])
    plan = p.admission_plan(principal(p), "big", RequestSubjects(program="crawl"))
    run_key = store.key("u", plan.budgets[0].key)
    out = await store.reserve(plan, Charge("a", [0.0] * len(plan.buckets), 1.0), now_s=DAY)
    await store.client.expire(run_key, 7200)
    await store.apply(plan, Settlement("a", "redis", [0.0] * len(plan.buckets), 0.5, out.budget_periods, 1.5))
    assert await store.client.ttl(run_key) > 2_764_000  # a run never resets: 32 days after its last write
    await store.client.expire(run_key, 7200)
    out = await store.reserve(plan, Charge("b", [0.0] * len(plan.buckets), 1.0), now_s=DAY + 86_400 * 40)
    assert out.budget_spent == [1.5]
    assert await store.client.ttl(run_key) > 2_764_000
