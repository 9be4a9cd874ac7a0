"""A key's spend for the admin key list: one peek of its day and month counters, in memory and Redis,
equal to what its full standing reports."""

from __future__ import annotations

import pytest

from policies.limits.memory_store import MemoryStore
from policies.limits.plan import Charge
from policies.limits.redis_store import RedisStore
from policies.limits.standing import key_spend, standing
from policies.policy import Policy
from tests.policies.limits.support import policy, principal

MODELS = ("big", "small")


def tracked() -> Policy:
    return policy(
        admission={"track_key_spend": True},
        budgets=[{"scope": "tenant", "usd_per_day": 100.0}],
    )


async def _charged(store: MemoryStore | RedisStore) -> None:
    p = tracked()
    who = principal(p)
    plan = p.admission_plan(who, "big")
    out = await store.reserve(plan, Charge("t1", [0.0] * len(plan.buckets), 0.25))
    assert out.admitted
    spend = await key_spend(store, p, who, MODELS)
    assert spend == {"day": 0.25, "month": 0.25}
    full = await standing(store, p, who, MODELS)
    assert full["spend_usd"] == spend


async def test_a_keys_spend_is_its_counters_in_memory() -> None:
    await _charged(MemoryStore())


@pytest.mark.redis
async def test_a_keys_spend_is_its_counters_in_redis(redis_url: str, redis_prefix: str) -> None:
    store = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)
    try:
        await _charged(store)
    finally:
        await store.close()


async def test_a_key_without_a_counter_has_no_spend() -> None:
    p = policy()
    assert await key_spend(MemoryStore(), p, principal(p), MODELS) == {"day": None, "month": None}
