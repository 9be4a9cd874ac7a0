"""Tickets make every store operation safe to repeat or to send blind, in both stores: a ticket reserved
twice is charged once, a settlement of a ticket the store does not hold (never reserved, already
settled) changes nothing, and in Redis a ticket voided before its reservation ran can never charge."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from policies.limits.memory_store import MemoryStore
from policies.limits.plan import Charge, Plan, Settlement
from policies.limits.redis_store import RedisStore, VoidedTicket
from tests.policies.limits.support import policy, principal

T0 = 1_000_000.0


def plan() -> Plan:
    p = policy(
        limits=[{"scope": "key", "tpd": 100_000, "max_concurrent": 2}],
        budgets=[{"scope": "tenant", "usd_per_day": 10.0}],
    )
    return p.admission_plan(principal(p), "big")


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryStore()
        return
    s = RedisStore.from_url(
        request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"), timeout_s=2.0
    )
    yield s
    await s.close()


async def used_and_active(store: Any, p: Plan) -> tuple[float, int, float]:
    out = await store.reserve(p, Charge("probe", [0.0], 0.0), T0)  # reports the state; charges 0
    await store.apply(p, Settlement("probe", out.source, [0.0], 0.0, out.budget_periods, 0.0), T0)
    return out.bucket_used[0], out.lease_active[0], out.budget_spent[0]


async def test_a_ticket_reserved_twice_is_charged_once(store: Any) -> None:
    p = plan()
    first = await store.reserve(p, Charge("t1", [1000.0], 0.5), T0)
    again = await store.reserve(p, Charge("t1", [1000.0], 0.5), T0)
    assert first.admitted and again.admitted
    assert await used_and_active(store, p) == (1000.0, 1, 0.5)


async def test_settling_an_unknown_or_settled_ticket_changes_nothing(store: Any) -> None:
    p = plan()
    out = await store.reserve(p, Charge("t1", [1000.0], 0.5), T0)
    refund = Settlement("t1", out.source, [-900.0], -0.4, out.budget_periods, 0.1)
    assert await store.apply(p, refund, T0)
    assert not await store.apply(p, refund, T0)  # a replay
    stranger = Settlement("nobody", out.source, [-100.0], -0.1, out.budget_periods, 0.0)
    assert not await store.apply(p, stranger, T0)  # never reserved
    assert await used_and_active(store, p) == (pytest.approx(100.0), 0, pytest.approx(0.1))  # type: ignore[comparison-overlap]


@pytest.mark.redis
async def test_a_voided_ticket_never_charges_whichever_order_they_run(redis_url: str, redis_prefix: str) -> None:
    store = RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)
    try:
        p = plan()
        # void first (the reservation is still stuck somewhere): the reservation is refused later
        assert not await store.void(p, Charge("late", [1000.0], 0.5), T0)
        with pytest.raises(VoidedTicket):
            await store.reserve(p, Charge("late", [1000.0], 0.5), T0)
        # reservation first: the void undoes all of it, and a second void changes nothing
        assert (await store.reserve(p, Charge("ran", [2000.0], 0.7), T0)).admitted
        assert await store.void(p, Charge("ran", [2000.0], 0.7), T0)
        assert not await store.void(p, Charge("ran", [2000.0], 0.7), T0)
        with pytest.raises(VoidedTicket):
            await store.reserve(p, Charge("ran", [2000.0], 0.7), T0)
        assert await used_and_active(store, p) == (0.0, 0, 0.0)
        # a settled ticket voided afterwards (a void sent blind after a lost reply) keeps its settlement
        out = await store.reserve(p, Charge("done", [1000.0], 0.5), T0)
        assert await store.apply(p, Settlement("done", "redis", [-900.0], -0.4, out.budget_periods, 0.1), T0)
        assert not await store.void(p, Charge("done", [1000.0], 0.5), T0)
        assert await used_and_active(store, p) == (pytest.approx(100.0), 0, pytest.approx(0.1))  # type: ignore[comparison-overlap]
    finally:
        await store.close()
