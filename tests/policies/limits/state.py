"""Reading a bucket's state straight from whichever store holds it (tests only)."""

from __future__ import annotations

from policies.limits import memory_store
from policies.limits.admission import Admission
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.plan import BucketSpec, BudgetSpec


async def bucket_used(admission: Admission, spec: BucketSpec, now_s: float) -> float:
    store = admission.store
    if isinstance(store, MemoryStore):
        state = store._buckets.get(spec.key)
        return 0.0 if state is None else memory_store.drained(state.used, state.updated_at_s, now_s, spec.rate_per_s)
    assert isinstance(store, FailoverStore)
    raw = await store.redis.client.hmget(store.redis.key("b", spec.key), "u", "t")
    if raw[0] is None or raw[1] is None:
        return 0.0
    return memory_store.drained(float(raw[0]), float(raw[1]), now_s, spec.rate_per_s)


async def budget_spent(admission: Admission, spec: BudgetSpec) -> float:
    store = admission.store
    if isinstance(store, MemoryStore):
        budget = store._budgets.get(spec.key)
        return 0.0 if budget is None else budget.spent_usd
    assert isinstance(store, FailoverStore)
    raw = await store.redis.client.hget(store.redis.key("u", spec.key), "s")
    return 0.0 if raw is None else float(raw)


async def active_leases(admission: Admission, key: str, now_s: float) -> int:
    store = admission.store
    if isinstance(store, MemoryStore):
        return store._leases.active(key, now_s)
    assert isinstance(store, FailoverStore)
    return int(await store.redis.client.zcount(store.redis.key("c", key), f"({now_s}", "+inf"))
