"""Redis killed mid-run (a Redis started by the test on its own port): fail_open keeps serving within
this replica's share, fail_closed answers 503, a dead Redis is skipped by the breaker, and once Redis
is back shared limiting resumes without counting anything twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.types import Rejection, Usage
from tests.policies.limits.redis_proc import RedisProcess
from tests.policies.limits.support import facts, header, policy, principal

pytestmark = pytest.mark.redis

OPEN_S = 0.2


def admission_doc(store_failure: str, **extra: Any) -> dict[str, Any]:
    return {
        "admission": {
            "store_failure": store_failure,
            "replicas": 2,
            "local_precheck": False,
            "breaker": {"failure_threshold": 1, "open_s": OPEN_S},
        },
        **extra,
    }


@pytest.fixture
async def connect(own_redis: RedisProcess) -> AsyncIterator[Callable[..., Admission]]:
    made: list[Admission] = []

    def factory(**doc: Any) -> Admission:
        store = FailoverStore(RedisStore.from_url(own_redis.url, prefix="failover-test", timeout_s=0.1))
        admission = Admission(policy(**doc), store)
        made.append(admission)
        return admission

    yield factory
    for admission in made:
        await admission.close()


class CountingRedis:
    """Counts the reservations that actually reach Redis."""

    def __init__(self, store: FailoverStore) -> None:
        self.calls = 0
        inner = store.redis.reserve

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await inner(*args, **kwargs)

        store.redis.reserve = counted  # type: ignore[method-assign]


async def test_fail_open_serves_this_replicas_share_then_resumes_sharing(
    own_redis: RedisProcess, connect: Callable[..., Admission]
) -> None:
    adm = connect(**admission_doc("fail_open", limits=[{"scope": "key", "rpm": 8}]))
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    for _ in range(2):
        ticket = await adm.admit(facts(who), "big")
        assert isinstance(ticket, Admitted) and ticket.source == "redis"
    own_redis.kill()
    counting = CountingRedis(store)
    served: list[Admitted] = []
    for _ in range(6):
        result = await adm.admit(facts(who), "big")
        if isinstance(result, Admitted):
            assert result.source == "local"
            served.append(result)
        else:
            assert result.code == "rate_limit_exceeded"
    # share = 8 / 2 replicas = 4, of which 2 x 1/2 were already used in Redis: 3 more fit locally
    assert len(served) == 3
    assert header(served[0].headers, "x-ratelimit-limit-requests") == "4"
    assert counting.calls == 1  # the breaker opened on the first failure: later requests skip Redis
    assert store.status()["breaker"] == "open"

    own_redis.start()
    await asyncio.sleep(OPEN_S * 1.5)
    back = await adm.admit(facts(who), "big")
    assert isinstance(back, Admitted) and back.source == "redis"  # shared limiting resumes
    assert store.status()["breaker"] == "closed"
    for ticket in served:  # tickets admitted locally settle locally; what they cost is charged to Redis once
        await adm.settle(ticket, Usage(100, 10), model="big")
    await store.drain()
    used = own_redis.client().hget(store.redis.key("b", "key|rpm|k1"), "u")
    # the request admitted since recovery, and the three admitted locally (their reservation never
    # reached Redis: charged after the fact, not twice)
    assert float(used or 0) == pytest.approx(4.0, abs=0.01)


async def test_fail_closed_answers_503_until_redis_is_back(
    own_redis: RedisProcess, connect: Callable[..., Admission]
) -> None:
    adm = connect(**admission_doc("fail_closed", limits=[{"scope": "key", "rpm": 100}]))
    who = principal(adm.policy)
    assert isinstance(await adm.admit(facts(who), "big"), Admitted)
    own_redis.kill()
    for _ in range(3):
        no = await adm.admit(facts(who), "big")
        assert isinstance(no, Rejection)
        assert (no.status, no.type, no.code, no.reason) == (
            503,
            "server_error",
            "limiter_unavailable",
            "limiter_unavailable",
        )
        assert header(no.headers, "retry-after") == "1"
    own_redis.start()
    await asyncio.sleep(OPEN_S * 1.5)
    assert isinstance(await adm.admit(facts(who), "big"), Admitted)


async def test_a_settlement_lost_in_an_outage_is_replayed_exactly_once(
    own_redis: RedisProcess, connect: Callable[..., Admission]
) -> None:
    adm = connect(**admission_doc("fail_open", limits=[{"scope": "key", "tpd": 1_000_000}]))
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    ticket = await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big")
    assert isinstance(ticket, Admitted) and ticket.source == "redis"
    # Redis stalls: the settle times out on our side but Redis runs it once it resumes, so its
    # reply is lost although it was applied - the case a naive replay would count twice.
    with own_redis.stalled(0.4):
        await adm.settle(ticket, Usage(prompt_tokens=100, completion_tokens=10), model="big")
        assert store.status()["pending_settlements"] == 1
    await store.drain()  # replayed without waiting for another request
    assert store.status()["pending_settlements"] == 0 and store.stats["replayed"] == 1
    again = await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big")
    assert isinstance(again, Admitted) and again.source == "redis"
    used = float(own_redis.client().hget(store.redis.key("b", "key|tpd|k1"), "u") or 0)
    assert used == pytest.approx(110 + 1100, abs=15.0)  # refunded 990 once (twice would leave 220)


async def test_spend_during_an_outage_reaches_the_shared_budget_once(
    own_redis: RedisProcess, connect: Callable[..., Admission]
) -> None:
    adm = connect(**admission_doc("fail_open", budgets=[{"scope": "tenant", "usd_per_day": 10.0}]))
    store = adm.store
    assert isinstance(store, FailoverStore)
    who = principal(adm.policy)
    own_redis.kill()
    local = await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000), "big")
    assert isinstance(local, Admitted) and local.source == "local"
    await adm.settle(local, Usage(prompt_tokens=1000, completion_tokens=100), model="big")
    assert store.status()["pending_settlements"] == 1  # the budget charge waits for Redis
    own_redis.start()
    await asyncio.sleep(OPEN_S * 1.5)
    assert isinstance(await adm.admit(facts(who, prompt_tokens=0, max_tokens=1), "big"), Admitted)
    await store.drain()
    spent = float(own_redis.client().hget(store.redis.key("u", "tenant|usd_per_day|t1"), "s") or 0)
    assert spent == pytest.approx(1000 * 10e-6 + 100 * 30e-6 + 1 * 30e-6)
