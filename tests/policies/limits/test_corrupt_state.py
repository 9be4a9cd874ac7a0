"""The limiter's scripts over state they did not write: a key of another type, numbers that are not.

Redis is the limiter's own store, but another replica's version, a hand edit or a restore can leave
anything under the prefix. One such key must cost that key its state, never a script error: a failed
script trips the limiter's breaker, which moves every tenant's limits to local ones (or refuses
everyone, under `fail_closed`). And a value no script writes (text, NaN, an infinity) must neither
hold a limit open nor shut it for good.
"""

from __future__ import annotations

import pytest

from policies.limits.plan import Charge, Plan, Settlement
from policies.limits.redis_store import RedisStore
from tests.policies.limits.support import policy, principal

pytestmark = pytest.mark.redis

NOW = 1_800_000_000.0


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


def plan() -> Plan:
    p = policy(
        limits=[{"scope": "key", "tpm": 6000, "max_concurrent": 2}],
        budgets=[{"scope": "tenant", "usd_per_day": 1.0}],
    )
    return p.admission_plan(principal(p), "big")


def keys(store: RedisStore, p: Plan) -> dict[str, str]:
    return {
        "bucket": store.key("b", p.buckets[0].key),
        "lease": store.key("c", p.leases[0].key),
        "budget": store.key("u", p.budgets[0].key),
        "tickets": store._tag + "tickets",
        "voided": store._tag + "voided",
    }


@pytest.mark.parametrize("which", ["bucket", "lease", "budget", "tickets", "voided"])
async def test_a_key_of_another_type_is_replaced_and_every_script_still_answers(store: RedisStore, which: str) -> None:
    p = plan()
    key = keys(store, p)[which]
    await store.client.set(key, "written by something else")
    out = await store.reserve(p, Charge("t1", [100.0], 0.01), now_s=NOW)
    assert out.admitted
    settled = Settlement("t1", "redis", [-50.0], -0.005, out.budget_periods, 0.005)
    assert await store.apply(p, settled, now_s=NOW + 1)
    await store.client.set(key, "and again")
    assert (await store.reserve(p, Charge("t2", [100.0], 0.01), now_s=NOW + 2)).admitted
    await store.client.set(key, "and once more")
    await store.void(p, Charge("t2", [100.0], 0.01), now_s=NOW + 3)
    await store.client.set(key, "read only")
    await store.peek(p, now_s=NOW + 4)  # a read: the key reads as empty, left for the next write


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "not a number", ""])
async def test_a_stored_number_that_is_not_one_reads_as_absent_and_is_replaced(store: RedisStore, value: str) -> None:
    p = plan()
    k = keys(store, p)
    first = await store.reserve(p, Charge("t1", [5000.0], 0.5), now_s=NOW)
    assert first.admitted
    await store.client.hset(k["bucket"], mapping={"u": value, "t": value})
    await store.client.hset(k["budget"], mapping={"s": value})
    # read as absent: the bucket and the budget as empty, so the next request is admitted...
    out = await store.reserve(p, Charge("t2", [5000.0], 0.5), now_s=NOW + 1)
    assert out.admitted and out.bucket_used == [0.0] and out.budget_spent == [0.0]
    # ...and what the script wrote back is a number again: the limit holds from here on
    assert float(await store.client.hget(k["bucket"], "u") or "x") == 5000.0
    assert not (await store.reserve(p, Charge("t3", [5000.0], 0.5), now_s=NOW + 2)).admitted


async def test_a_lease_that_never_expires_holds_no_slot(store: RedisStore) -> None:
    p = plan()
    await store.client.zadd(keys(store, p)["lease"], {"forever": float("inf"), "far": 1e300})
    first = await store.reserve(p, Charge("t1", [1.0], 0.0), now_s=NOW)
    second = await store.reserve(p, Charge("t2", [1.0], 0.0), now_s=NOW)
    assert first.admitted and second.admitted  # max_concurrent 2: the two corrupt members take neither
    assert not (await store.reserve(p, Charge("t3", [1.0], 0.0), now_s=NOW)).admitted


async def test_a_spend_written_in_hex_is_reported_as_a_number_the_caller_reads(store: RedisStore) -> None:
    p = plan()
    first = await store.reserve(p, Charge("t1", [1.0], 0.0), now_s=NOW)
    await store.client.hset(keys(store, p)["budget"], mapping={"s": "0x0.8p0", "p": str(first.budget_periods[0])})
    out = await store.reserve(p, Charge("t2", [1.0], 0.0), now_s=NOW + 1)
    assert out.budget_spent == [0.5]
