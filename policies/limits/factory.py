"""Building the store the gateway's state setting asks for (no Redis URL = in memory, one process)."""

from __future__ import annotations

from policies.limits.admission import Store
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.redis_store import RedisStore


def make_store(redis_url: str | None, *, prefix: str = "tokenway", timeout_s: float = 0.1) -> Store:
    """`MemoryStore` without a URL; else Redis behind the breaker and fail-open/closed handling.

    `timeout_s` bounds each Redis call (connect and read): it is the most a failing Redis can add to
    a request before the breaker opens.
    """
    if not redis_url:
        return MemoryStore()
    return FailoverStore(RedisStore.from_url(redis_url, prefix=prefix, timeout_s=timeout_s))
