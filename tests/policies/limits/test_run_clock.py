"""An agent run's wall-clock cap (`seconds_per_run`, `x-tokenway-run-seconds`): the first admitted call
starts the run's clock in the same atomic step as its other counters, and a call after start + cap is
refused for good. Each test runs over the memory store and a real Redis; time is the callers' `now`
(the scripts take it as they take Redis TIME), never a sleep."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policies.limits.admission import Admission
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.limits.standing import standing
from policies.policy import Policy
from policies.types import RequestFacts, RequestSubjects
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.support import KEY, OTHER_KEY, header, principal
from tests.policies.limits.support import facts as base_facts
from tests.policies.limits.test_hierarchy import T0, admitted, org_policy, rejected
from tests.support.procs import free_port


def run_facts(p: Policy, program: str, *, key: str = KEY, **subjects: Any) -> RequestFacts:
    return dataclasses.replace(
        base_facts(principal(p, key), max_tokens=10), subjects=RequestSubjects(program=program, **subjects)
    )


async def test_the_first_call_starts_the_clock_and_a_call_past_the_cap_is_refused_for_good(
    make_admission: AdmissionFactory,
) -> None:
    p = org_policy(limits=[{"scope": "program", "seconds_per_run": 600}])
    adm = make_admission(p)
    run = run_facts(p, "run-1")
    first = admitted(await adm.admit(run, "big", now=T0 + 1000))  # the run starts here, not at T0
    assert header(first.headers, "x-ratelimit-limit-seconds") is None
    admitted(await adm.admit(run, "big", now=T0 + 1000 + 599.5))
    refusal = rejected(await adm.admit(run, "big", now=T0 + 1000 + 600.5))
    assert refusal.status == 429 and refusal.reason == "rate_limited"
    assert "agent run 'run-1'" in refusal.message and "wall-clock seconds per agent run" in refusal.message
    assert "program" in refusal.message  # the rule's identity
    assert "does not reset" in refusal.message and "started at" in refusal.message
    assert header(refusal.headers, "x-should-retry") == "false"
    assert header(refusal.headers, "retry-after") is None
    rejected(await adm.admit(run, "big", now=T0 + 86_400 * 20))  # nothing turns the clock back
    admitted(await adm.admit(run_facts(p, "run-2"), "big", now=T0 + 86_400 * 20))  # another run: its own clock


async def test_a_call_refused_by_another_cap_does_not_start_the_clock(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "program", "seconds_per_run": 60, "calls_per_run": 1}])
    adm = make_admission(p)
    late = run_facts(p, "late", run_usd=1e-9)  # its header budget refuses every call
    rejected(await adm.admit(late, "big", now=T0))
    admitted(await adm.admit(run_facts(p, "late"), "big", now=T0 + 3600))  # starts now, an hour later


async def test_the_seconds_header_lowers_the_cap_and_never_raises_it(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "program", "seconds_per_run": 600}])
    adm = make_admission(p)
    short = run_facts(p, "short", run_s=30.0)
    admitted(await adm.admit(short, "big", now=T0))
    admitted(await adm.admit(short, "big", now=T0 + 29))
    rejected(await adm.admit(short, "big", now=T0 + 31))
    long = run_facts(p, "long", run_s=10_000.0)
    admitted(await adm.admit(long, "big", now=T0))
    admitted(await adm.admit(long, "big", now=T0 + 599))
    assert "program" in rejected(await adm.admit(long, "big", now=T0 + 601)).message  # the policy's ceiling


async def test_a_seconds_header_alone_sets_a_cap(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "key", "rpm": 1000}])
    adm = make_admission(p)
    run = run_facts(p, "mine", run_s=5.0)
    admitted(await adm.admit(run, "big", now=T0))
    assert "@run-header" in rejected(await adm.admit(run, "big", now=T0 + 6)).message


async def test_the_tightest_rule_applies_and_the_run_has_one_clock(make_admission: AdmissionFactory) -> None:
    p = org_policy(
        limits=[
            {"scope": "program", "match": {"tenant": "t1"}, "seconds_per_run": 100},
            {"scope": "program", "match": {"model": "big"}, "seconds_per_run": 50},
        ]
    )
    plan = p.admission_plan(principal(p), "big", RequestSubjects(program="r"))
    clocks = [b for b in plan.buckets if b.kind == "seconds"]
    assert [(c.capacity, c.rule_id) for c in clocks] == [(50.0, "program[model=big]")]
    adm = make_admission(p)
    admitted(await adm.admit(run_facts(p, "r"), "big", now=T0))
    # another key of the tenant calling the same run reads the same clock
    rejected(await adm.admit(run_facts(p, "r", key=OTHER_KEY), "big", now=T0 + 51))


def test_an_enforced_cap_holds_beside_a_tighter_shadow_one() -> None:
    p = org_policy(
        limits=[
            {"scope": "program", "match": {"tenant": "t1"}, "seconds_per_run": 100},
            {"scope": "program", "match": {"model": "big"}, "seconds_per_run": 10, "shadow": True},
        ]
    )
    plan = p.admission_plan(principal(p), "big", RequestSubjects(program="r"))
    assert [(c.capacity, c.shadow) for c in plan.buckets if c.kind == "seconds"] == [(100.0, False)]


async def test_a_reload_that_changes_the_rule_keeps_the_start(make_admission: AdmissionFactory) -> None:
    before = org_policy(limits=[{"scope": "program", "seconds_per_run": 100}])
    after = org_policy(limits=[{"scope": "program", "id": "agents", "seconds_per_run": 200}])
    adm = make_admission(before)
    admitted(await adm.admit(run_facts(before, "r"), "big", now=T0))
    adm._policies.current = after  # type: ignore[misc]  # a reload: the same counters, the new rules
    admitted(await adm.admit(run_facts(after, "r"), "big", now=T0 + 150))
    rejected(await adm.admit(run_facts(after, "r"), "big", now=T0 + 201))


async def test_the_standing_shows_when_the_run_started_and_the_seconds_left(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "program", "seconds_per_run": 600, "calls_per_run": 10}])
    adm = make_admission(p)
    who = principal(p)
    subjects = RequestSubjects(program="run-7")
    fresh = await standing(adm.store, p, who, ["big"], subjects, now_s=T0)  # type: ignore[arg-type]
    clock = next(r for r in fresh["limits"] if r["dimension"] == "seconds_per_run")
    assert clock["started_at"] is None and clock["seconds_left"] == 600 and clock["reset_s"] is None
    admitted(await adm.admit(run_facts(p, "run-7"), "big", now=T0))
    later = await standing(adm.store, p, who, ["big"], subjects, now_s=T0 + 250)  # type: ignore[arg-type]
    clock = next(r for r in later["limits"] if r["dimension"] == "seconds_per_run")
    assert clock["started_at"] == pytest.approx(T0)
    assert clock["seconds_left"] == pytest.approx(350) and clock["used"] == pytest.approx(250)
    assert clock["limit"] == 600 and clock["rule"] == "program" and clock["scope"] == "program"
    calls = next(r for r in later["limits"] if r["dimension"] == "calls_per_run")
    assert calls["used"] == 1 and calls["remaining"] == 9


def test_seconds_per_run_is_a_run_cap() -> None:
    with pytest.raises(ValueError, match="count an agent run: scope program"):
        org_policy(limits=[{"scope": "tenant", "seconds_per_run": 10}])


async def test_a_fail_open_replica_holds_the_whole_cap_not_a_share() -> None:
    """While Redis is unreachable a replica holds 1/replicas of every limit; the clock's use and cap
    scale alike, so the run still gets its whole wall-clock cap there."""
    p = org_policy(limits=[{"scope": "program", "seconds_per_run": 100}], admission={"replicas": 4})
    store = FailoverStore(RedisStore.from_url(f"redis://127.0.0.1:{free_port()}", timeout_s=0.05))
    adm = Admission(p, store)
    try:
        admitted(await adm.admit(run_facts(p, "r"), "big", now=T0))
        admitted(await adm.admit(run_facts(p, "r"), "big", now=T0 + 99))
        refusal = rejected(await adm.admit(run_facts(p, "r"), "big", now=T0 + 101))
        assert "Limit 100s" in refusal.message and "101s ago" in refusal.message
    finally:
        await adm.close()
