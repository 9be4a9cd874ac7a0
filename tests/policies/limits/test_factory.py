"""The store a gateway gets for its state setting."""

from __future__ import annotations

from policies.limits.failover import FailoverStore, make_store
from policies.limits.memory_store import MemoryStore


async def test_memory_without_a_url_and_redis_behind_failover_with_one() -> None:
    assert isinstance(make_store(None), MemoryStore)
    store = make_store("redis://127.0.0.1:1/0", prefix="gw", timeout_s=0.05)
    assert isinstance(store, FailoverStore) and store.redis.prefix == "gw"
    await store.close()
