"""The index of live agent runs and what each run used (policies/limits/standing.py), over the memory
store and a real Redis: admitted calls of runs with a run rule are listed newest first with the key
and model that made them, the index is bounded, and two replicas on one Redis see the same runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policies.limits import redis_store
from policies.limits.admission import Admission
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.redis_store import RedisStore
from policies.limits.standing import order, run_standing
from policies.policy import Policy
from policies.types import RequestFacts, RequestSubjects, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.support import KEY, OTHER_KEY, principal
from tests.policies.limits.support import facts as base_facts
from tests.policies.limits.test_hierarchy import COST, T0, admitted, org_policy, rejected

RULES: dict[str, Any] = {
    "limits": [{"scope": "program", "match": {"tenant": "t1"}, "calls_per_run": 3, "tokens_per_run": 100_000,
                "seconds_per_run": 600}],
    "budgets": [{"scope": "program", "match": {"tenant": "t1"}, "usd_per_run": 1.0}],
}  # fmt: skip


def run_facts(p: Policy, program: str, *, key: str = KEY, model: str = "big") -> RequestFacts:
    return dataclasses.replace(
        base_facts(principal(p, key), max_tokens=900, model=model), subjects=RequestSubjects(program=program)
    )


async def test_admitted_runs_are_listed_newest_first_with_their_caller(make_admission: AdmissionFactory) -> None:
    p = org_policy(**RULES)
    adm = make_admission(p)
    admitted(await adm.admit(run_facts(p, "a"), "big", now=T0))
    admitted(await adm.admit(run_facts(p, "b", key=OTHER_KEY), "big", now=T0 + 1))
    admitted(await adm.admit(run_facts(p, "a"), "big", now=T0 + 2))
    # tenant t2 has no run rule: its runs have no counters and are never listed
    admitted(await adm.admit(run_facts(p, "c", key="sk-test-key-3"), "big", now=T0 + 3))
    seen = await adm.store.recent_runs(10, T0 + 4)  # type: ignore[attr-defined]
    assert [(s.tenant, s.program, s.key_id, s.model, s.last_seen_s) for s in seen] == [
        ("t1", "a", "k1", "big", pytest.approx(T0 + 2)),
        ("t1", "b", "k2", "big", pytest.approx(T0 + 1)),
    ]
    admitted(await adm.admit(run_facts(p, "a"), "big", now=T0 + 5))
    rejected(await adm.admit(run_facts(p, "a"), "big", now=T0 + 6))  # a refusal is no call of the run
    latest = await adm.store.recent_runs(1, T0 + 7)  # type: ignore[attr-defined]
    assert [(s.program, s.last_seen_s) for s in latest] == [("a", pytest.approx(T0 + 5))]


async def test_a_runs_standing_reads_its_own_counters(make_admission: AdmissionFactory) -> None:
    p = org_policy(**RULES)
    adm = make_admission(p)
    run = run_facts(p, "r")
    first = admitted(await adm.admit(run, "big", now=T0))
    await adm.settle(first, Usage(prompt_tokens=100, completion_tokens=50), model="big", now=T0 + 1)
    admitted(await adm.admit(run, "big", now=T0 + 10))  # still open: its reservation counts
    plan = p.admission_plan(run.principal, "big", run.subjects)
    row = await run_standing(adm.store, plan, T0 + 100)  # type: ignore[arg-type]
    assert row["calls"] == 2 and row["tokens"] == 150 + 1000
    assert row["spent_usd"] == pytest.approx(100 * 10e-6 + 50 * 30e-6 + COST)
    assert row["started_at"] == pytest.approx(T0) and row["seconds_left"] == pytest.approx(500)
    caps = {c["dimension"]: c for c in row["caps"]}
    assert set(caps) == {"calls_per_run", "tokens_per_run", "seconds_per_run", "usd_per_run"}
    assert caps["calls_per_run"]["remaining"] == 1 and caps["usd_per_run"]["limit"] == 1.0


def test_rows_order_by_spend_or_by_last_call() -> None:
    rows: list[dict[str, Any]] = [
        {"program": "cheap", "spent_usd": 0.1, "calls": 9, "tokens": 1, "last_seen": 3.0},
        {"program": "dear", "spent_usd": 2.0, "calls": 1, "tokens": 1, "last_seen": 1.0},
        {"program": "uncounted", "spent_usd": None, "calls": None, "tokens": None, "last_seen": 2.0},
    ]
    assert [r["program"] for r in order(rows, "spend")] == ["dear", "cheap", "uncounted"]
    assert [r["program"] for r in order(rows, "recent")] == ["cheap", "uncounted", "dear"]


async def test_the_memory_index_is_bounded() -> None:
    p = org_policy(**RULES)
    store = MemoryStore()
    store.runs.max_runs = 3
    adm = Admission(p, store)
    for i in range(5):
        admitted(await adm.admit(run_facts(p, f"r{i}"), "big", now=T0 + i))
    assert [s.program for s in await store.recent_runs(10, T0 + 10)] == ["r4", "r3", "r2"]
    assert await store.recent_runs(10, T0 + 4 + 33 * 86_400) == []  # idle past the counters' expiry


@pytest.mark.redis
async def test_the_redis_index_is_shared_by_replicas_and_bounded(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "INDEX_MAX", 5)
    p = org_policy(**RULES)
    one = Admission(p, FailoverStore(RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)))
    two = Admission(p, FailoverStore(RedisStore.from_url(redis_url, prefix=redis_prefix, timeout_s=2.0)))
    try:
        admitted(await one.admit(run_facts(p, "from-one"), "big", now=T0))
        seen = await two.store.recent_runs(10, T0 + 1)  # type: ignore[attr-defined]
        assert [(s.program, s.key_id) for s in seen] == [("from-one", "k1")]
        for i in range(5 + 64):  # with from-one, past the bound and its slack: the oldest leave at once
            admitted(await two.admit(run_facts(p, f"r{i}"), "big", now=T0 + 10 + i))
        store = two.store
        assert isinstance(store, FailoverStore)
        assert await store.redis.client.zcard(store.redis._runs) == 5
        assert await store.redis.client.hlen(store.redis._runs_meta) == 5
        latest = await one.store.recent_runs(100, T0 + 100)  # type: ignore[attr-defined]
        assert [s.program for s in latest] == [f"r{i}" for i in range(68, 63, -1)]
    finally:
        await one.close()
        await two.close()
