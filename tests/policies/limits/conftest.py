"""Admission fixtures: the same tests run against the memory store and against a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from policies.limits.admission import Admission
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.redis_store import RedisStore
from policies.policy import Policy

AdmissionFactory = Callable[[Policy], Admission]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def make_admission(request: pytest.FixtureRequest) -> AsyncIterator[AdmissionFactory]:
    """`make_admission(policy)` -> an Admission over a fresh memory store or a Redis under a unique prefix."""
    made: list[Admission] = []
    url: str | None = None
    prefix = ""
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("redis_prefix")

    def factory(policy: Policy) -> Admission:
        store: Any = MemoryStore()
        if url is not None:
            store = FailoverStore(RedisStore.from_url(url, prefix=prefix, timeout_s=2.0))
        admission = Admission(policy, store)
        made.append(admission)
        return admission

    yield factory
    for admission in made:
        await admission.close()


@pytest.fixture
async def redis_store(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisStore]:
    """The limiter's Redis store alone, under a unique prefix (tests of its scripts)."""
    opened = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)
    yield opened
    await opened.close()
