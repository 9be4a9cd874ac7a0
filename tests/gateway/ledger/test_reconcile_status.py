"""The spend reconciliation's status (`/admin/status` → `spend_reconciliation`) has one shape from the
start: before the first check a reader finds `periods` and `over_tolerance` there, empty, rather
than a KeyError (an end-to-end test that polled it met one under load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.ledger.reconcile import SpendReconciler
from gateway.ledger.writer import SpendTally
from policies.limits.memory_store import period_id


def test_the_status_before_the_first_check_has_every_field_a_reader_indexes() -> None:
    unused: Any = None  # nothing is asked of the admission view, policy or principals before a check
    status = SpendReconciler(SpendTally(10), unused, lambda: unused, lambda key, policy: None).status()
    assert status["checked_at_unix_s"] is None
    assert status["periods"] == {} and status["over_tolerance"] == []
    assert [row for row in status["over_tolerance"] if row["key"] == "k1"] == []  # what a poller does


@dataclass
class _NoAdmission:
    store: Any = None
    open_usd: dict[str, float] = field(default_factory=dict)


@pytest.mark.redis
@pytest.mark.parametrize("damage", ["another type", "a field that is no number"])
async def test_a_spend_tally_redis_holds_damaged_is_repaired_and_the_sums_still_arrive(
    redis_url: str, redis_prefix: str, damage: str
) -> None:
    """The fleet's recorded sums are a hash per period in Redis: one holding what no replica writes
    there made every check fail (and re-queue every sum) until someone repaired it. Now Redis refuses
    only that sum in the MULTI, the hash is repaired, and the sum goes with the next flush."""
    client = aioredis.Redis.from_url(redis_url)
    unused: Any = None
    tally = SpendTally(10)
    reconciler = SpendReconciler(
        tally, _NoAdmission(), lambda: unused, lambda key, policy: None, redis=client, prefix=redis_prefix
    )
    now = 1_800_000_000.0
    day = f"{{{redis_prefix}}}:spend:day:{period_id('day', now)}"
    try:
        if damage == "another type":
            await client.rpush(day, "junk")
        else:
            await client.hset(day, mapping={"k": "not a number", "other": "nan"})
        tally.pending[("day", period_id("day", now), "k")] = 0.25
        tally.pending[("month", period_id("month", now), "k")] = 0.25
        await reconciler._flush()  # the month's sum applies; the day's is refused, its hash repaired
        assert tally.pending == {("day", period_id("day", now), "k"): 0.25}
        await reconciler._flush()
        assert tally.pending == {}
        recorded, _ = await reconciler._shared(now)
        assert recorded["day"] == {"k": 0.25} and recorded["month"] == {"k": 0.25}
    finally:
        await client.aclose()
