"""Organisations, teams, end users, tags and agent runs: their limits and budgets reserve in the same
atomic step as the key's, over each store (memory and real Redis)."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime
from typing import Any

import pytest

from policies.limits import memory_store
from policies.limits.admission import Admitted
from policies.limits.plan import Charge
from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig
from policies.types import Rejection, RequestSubjects, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.state import budget_spent
from tests.policies.limits.support import KEY, OTHER_KEY, facts, header, principal

T0 = 1_000_000.0
THIRD_KEY = "sk-test-key-3"
FOURTH_KEY = "sk-test-key-4"


def org_policy(**sections: Any) -> Policy:
    """Org acme with teams search (tenants t1: k1, k2; t2: k3) and ads (t3: k4); model big at $10/$30."""
    doc: dict[str, Any] = {
        "orgs": {"acme": {}},
        "teams": {"search": {"org": "acme"}, "ads": {"org": "acme"}},
        "tenants": {"t1": {"team": "search"}, "t2": {"team": "search"}, "t3": {"team": "ads"}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(KEY)},
            {"id": "k2", "tenant": "t1", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "t2", "sha256": hash_key(THIRD_KEY)},
            {"id": "k4", "tenant": "t3", "sha256": hash_key(FOURTH_KEY)},
        ],
        "models": {
            "big": {
                "context_length": 8192,
                "default_max_tokens": 512,
                "price": {"input_per_mtok": 10.0, "output_per_mtok": 30.0},
            }
        },
    }
    doc.update(sections)
    return Policy(PoliciesConfig.model_validate(doc))


def admitted(result: Admitted | Rejection) -> Admitted:
    assert isinstance(result, Admitted), result
    return result


def rejected(result: Admitted | Rejection) -> Rejection:
    assert isinstance(result, Rejection), result
    return result


# one request of 100 prompt + 900 output tokens at $10/$30 per Mtok reserves $0.028
COST = 100 * 10e-6 + 900 * 30e-6


async def test_a_team_budget_is_shared_by_its_tenants_and_not_by_other_teams(make_admission: AdmissionFactory) -> None:
    p = org_policy(budgets=[{"scope": "team", "usd_per_day": COST * 2.5}])
    adm = make_admission(p)
    k1, k3, k4 = principal(p, KEY), principal(p, THIRD_KEY), principal(p, FOURTH_KEY)
    admitted(await adm.admit(facts(k1, max_tokens=900), "big", now=T0))
    admitted(await adm.admit(facts(k3, max_tokens=900), "big", now=T0))  # t2: same team
    refusal = rejected(await adm.admit(facts(k1, max_tokens=900), "big", now=T0))
    assert refusal.reason == "budget_exhausted"
    assert "team 'search'" in refusal.message
    admitted(await adm.admit(facts(k4, max_tokens=900), "big", now=T0))  # team ads counts apart


async def test_an_org_limit_stacks_over_its_teams(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "org", "rpm": 3}, {"scope": "team", "rpm": 100}])
    adm = make_admission(p)
    for key in (KEY, THIRD_KEY, FOURTH_KEY):
        admitted(await adm.admit(facts(principal(p, key), max_tokens=10), "big", now=T0))
    refusal = rejected(await adm.admit(facts(principal(p, FOURTH_KEY), max_tokens=10), "big", now=T0))
    assert "organisation 'acme'" in refusal.message


def test_a_match_on_a_team_is_more_specific_than_the_org_wide_rule() -> None:
    p = org_policy(limits=[{"scope": "key", "rpm": 10}, {"scope": "key", "match": {"team": "ads"}, "rpm": 2}])
    (ads,) = p.admission_plan(principal(p, FOURTH_KEY), "big").buckets
    (search,) = p.admission_plan(principal(p, KEY), "big").buckets
    assert (ads.capacity, search.capacity) == (2, 10)
    scopes = {
        b.scope
        for b in org_policy(budgets=[{"scope": "org", "usd_per_month": 5}])
        .limits.plan(principal(p, KEY), "big")
        .budgets
    }
    assert scopes == {"org"}


async def test_a_tag_budget_counts_only_requests_carrying_that_tag(make_admission: AdmissionFactory) -> None:
    p = org_policy(budgets=[{"scope": "tag", "match": {"tag": "feature-x"}, "usd_per_day": COST * 1.5}])
    adm = make_admission(p)
    who = principal(p)
    tagged = dataclasses.replace(facts(who, max_tokens=900), subjects=RequestSubjects(tags=("feature-x", "team:a")))
    other = dataclasses.replace(facts(who, max_tokens=900), subjects=RequestSubjects(tags=("feature-y",)))
    admitted(await adm.admit(tagged, "big", now=T0))
    assert "tag 'feature-x'" in rejected(await adm.admit(tagged, "big", now=T0)).message
    admitted(await adm.admit(other, "big", now=T0))
    admitted(await adm.admit(facts(who, max_tokens=900), "big", now=T0))


async def test_end_users_each_get_their_own_limit_per_tenant(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "user", "rpm": 1}])
    adm = make_admission(p)
    alice = RequestSubjects(user="alice")
    k1 = dataclasses.replace(facts(principal(p), max_tokens=10), subjects=alice)
    admitted(await adm.admit(k1, "big", now=T0))
    assert "end user 'alice'" in rejected(await adm.admit(k1, "big", now=T0)).message
    bob = dataclasses.replace(k1, subjects=RequestSubjects(user="bob"))
    admitted(await adm.admit(bob, "big", now=T0))
    other_tenant = dataclasses.replace(facts(principal(p, FOURTH_KEY), max_tokens=10), subjects=alice)
    admitted(await adm.admit(other_tenant, "big", now=T0))  # t3's alice is another person
    admitted(await adm.admit(facts(principal(p), max_tokens=10), "big", now=T0))  # names no user


async def test_an_agent_run_is_held_to_its_budget_and_the_refund_settles_exactly(
    make_admission: AdmissionFactory,
) -> None:
    p = org_policy(budgets=[{"scope": "program", "usd_per_run": COST * 2.5}])
    adm = make_admission(p)
    run = dataclasses.replace(facts(principal(p), max_tokens=900), subjects=RequestSubjects(program="run-1"))
    first = admitted(await adm.admit(run, "big", now=T0))
    admitted(await adm.admit(run, "big", now=T0))
    refusal = rejected(await adm.admit(run, "big", now=T0))
    assert "agent run 'run-1'" in refusal.message and "does not reset" in refusal.message
    assert header(refusal.headers, "x-should-retry") == "false"
    assert header(refusal.headers, "retry-after") is None
    await adm.settle(first, Usage(prompt_tokens=100, completion_tokens=10), model="big", now=T0)
    admitted(await adm.admit(run, "big", now=T0 + 86_400 * 40))  # the refund made room; no period ends it
    spec = next(b for b in p.admission_plan(run.principal, "big", run.subjects).budgets if b.period == "run")
    spent = await budget_spent(adm, spec)
    assert spent == pytest.approx(COST * 2 + 100 * 10e-6 + 10 * 30e-6)
    other = dataclasses.replace(run, subjects=RequestSubjects(program="run-2"))
    admitted(await adm.admit(other, "big", now=T0))


async def test_a_run_call_cap_never_refills(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "program", "calls_per_run": 2, "tokens_per_run": 1_000_000}])
    adm = make_admission(p)
    run = dataclasses.replace(facts(principal(p), max_tokens=10), subjects=RequestSubjects(program="r"))
    for _ in range(2):
        ticket = admitted(await adm.admit(run, "big", now=T0))
        assert header(ticket.headers, "x-ratelimit-limit-requests") is None  # a run's cap has no reset
    later = rejected(await adm.admit(run, "big", now=T0 + 86_400 * 10))
    assert "calls per agent run" in later.message and "does not reset" in later.message
    assert header(later.headers, "x-should-retry") == "false"


async def test_the_run_budget_header_lowers_the_policy_budget_and_never_raises_it(
    make_admission: AdmissionFactory,
) -> None:
    p = org_policy(budgets=[{"scope": "program", "usd_per_run": COST * 3.5}])
    adm = make_admission(p)
    base = facts(principal(p), max_tokens=900)
    low = dataclasses.replace(base, subjects=RequestSubjects(program="low", run_usd=COST * 1.5))
    admitted(await adm.admit(low, "big", now=T0))
    rejected(await adm.admit(low, "big", now=T0))
    high = dataclasses.replace(base, subjects=RequestSubjects(program="high", run_usd=100.0))
    for _ in range(3):
        admitted(await adm.admit(high, "big", now=T0))
    rejected(await adm.admit(high, "big", now=T0))  # the policy's ceiling holds


async def test_a_run_budget_header_alone_sets_one(make_admission: AdmissionFactory) -> None:
    p = org_policy(limits=[{"scope": "key", "rpm": 1000}])
    adm = make_admission(p)
    run = dataclasses.replace(
        facts(principal(p), max_tokens=900), subjects=RequestSubjects(program="mine", run_usd=COST * 1.5)
    )
    admitted(await adm.admit(run, "big", now=T0))
    assert "@run-header" in rejected(await adm.admit(run, "big", now=T0)).message


def test_plans_without_request_rules_ignore_the_subjects() -> None:
    p = org_policy(limits=[{"scope": "key", "rpm": 5}])
    who = principal(p)
    base = p.admission_plan(who, "big")
    assert p.admission_plan(who, "big", RequestSubjects(user="u", tags=("a",), program="r")) is base


def test_request_plans_are_cached_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.limits import plan as plan_module

    monkeypatch.setattr(plan_module, "MAX_REQUEST_PLANS", 3)
    p = org_policy(budgets=[{"scope": "program", "usd_per_run": 1.0}])
    who = principal(p)
    first = p.admission_plan(who, "big", RequestSubjects(program="r0"))
    assert p.admission_plan(who, "big", RequestSubjects(program="r0")) is first
    for i in range(1, 10):
        p.admission_plan(who, "big", RequestSubjects(program=f"r{i}"))
    assert len(p.limits._request_plans) == 3


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tenants": {"t": {"team": "ghost"}}}, "tenants.t.team: unknown team 'ghost'"),
        ({"teams": {"a": {"org": "ghost"}}}, "teams.a.org: unknown organisation 'ghost'"),
        ({"budgets": [{"scope": "tag", "usd_per_day": 1}]}, "scope 'tag' counts one named tag: set match.tag"),
        ({"budgets": [{"scope": "key", "usd_per_run": 1}]}, "usd_per_run is an agent run's budget: scope program"),
        ({"limits": [{"scope": "tenant", "calls_per_run": 1}]}, "count an agent run: scope program"),
        ({"limits": [{"scope": "key", "match": {"team": "ghost"}, "rpm": 1}]}, "unknown team 'ghost'"),
        ({"budgets": [{"scope": "key", "usd_per_day": 1, "fallback": "ghost"}]}, "budgets[0].fallback: unknown model"),
    ],
)
def test_hierarchy_problems_are_named(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        PoliciesConfig.model_validate(doc)
    assert message in str(info.value)


def test_a_run_budget_never_resets() -> None:
    assert memory_store.period_id("run", T0) == memory_store.period_id("run", T0 * 3) == 0
    assert math.isinf(memory_store.period_end_s("run", 0))
    assert math.isinf(memory_store.wait_s(5.0, 1.0, 5.0, 0.0)) and memory_store.wait_s(1.0, 1.0, 5.0, 0.0) == 0.0


async def test_a_refusing_rule_names_its_own_fallback(make_admission: AdmissionFactory) -> None:
    p = org_policy(budgets=[{"scope": "team", "usd_per_day": COST * 1.5, "fallback": "big"}])
    adm = make_admission(p)
    admitted(await adm.admit(facts(principal(p), max_tokens=900), "big", now=T0))
    assert rejected(await adm.admit(facts(principal(p), max_tokens=900), "big", now=T0)).fallback_model == "big"


BILLING_MOMENTS = [
    datetime(2026, 3, 14, 23, 59, tzinfo=UTC),
    datetime(2026, 3, 15, 0, 0, 1, tzinfo=UTC),
    datetime(2026, 1, 14, 12, tzinfo=UTC),
    datetime(2025, 12, 31, 23, 0, tzinfo=UTC),
    datetime(2024, 2, 29, 6, tzinfo=UTC),
    datetime(2026, 3, 15, 4, 59, tzinfo=UTC),  # still the 14th in New York (UTC-5)
    datetime(2026, 3, 15, 5, 0, 1, tzinfo=UTC),
]


@pytest.mark.parametrize("offset_s", [0, -18_000, 19_800])
@pytest.mark.parametrize("moment", BILLING_MOMENTS, ids=[m.isoformat() for m in BILLING_MOMENTS])
async def test_billing_periods_match_between_lua_and_python(
    make_admission: AdmissionFactory, moment: datetime, offset_s: int
) -> None:
    p = org_policy(budgets=[{"scope": "team", "usd_per_period": 10.0, "billing": {"anchor_day": 15}}])
    adm = make_admission(p)
    plan = p.admission_plan(principal(p), "big")
    period = f"billing:15:{offset_s}"
    plan = dataclasses.replace(
        plan, budgets=tuple(dataclasses.replace(b, period=period) for b in plan.budgets), encoded={}
    )
    now = moment.timestamp()
    out = await adm.store.reserve(plan, Charge(f"t-{now}-{offset_s}", [], 0.0), now_s=now)
    local = datetime.fromtimestamp(now + offset_s, UTC)
    expected = local.year * 12 + local.month - 1 - (1 if local.day < 15 else 0)
    assert out.budget_periods == [expected] == [memory_store.period_id(period, now)]
    end = memory_store.period_end_s(period, expected)
    assert datetime.fromtimestamp(end + offset_s, UTC).day == 15 and end > now
    assert memory_store.period_id(period, end) == expected + 1 and memory_store.period_id(period, end - 1) == expected


async def test_a_billing_period_budget_resets_on_its_anchor_day(make_admission: AdmissionFactory) -> None:
    p = org_policy(budgets=[{"scope": "team", "usd_per_period": COST * 1.5, "billing": {"anchor_day": 15}}])
    adm = make_admission(p)
    before = datetime(2026, 3, 14, 12, tzinfo=UTC).timestamp()
    admitted(await adm.admit(facts(principal(p), max_tokens=900), "big", now=before))
    refusal = rejected(await adm.admit(facts(principal(p), max_tokens=900), "big", now=before))
    assert "billing-period budget" in refusal.message and "2026-03-15T00:00Z" in refusal.message
    after = datetime(2026, 3, 15, 0, 0, 1, tzinfo=UTC).timestamp()
    admitted(await adm.admit(facts(principal(p), max_tokens=900), "big", now=after))


def test_a_billing_zone_must_exist() -> None:
    with pytest.raises(ValueError, match="unknown time zone"):
        org_policy(
            budgets=[{"scope": "team", "usd_per_period": 1, "billing": {"anchor_day": 1, "timezone": "Mars/Base"}}]
        )
    with pytest.raises(ValueError, match="go together"):
        org_policy(budgets=[{"scope": "team", "usd_per_period": 1}])
    p = org_policy(
        budgets=[{"scope": "team", "usd_per_period": 1, "billing": {"anchor_day": 3, "timezone": "Asia/Kolkata"}}]
    )
    (budget,) = p.admission_plan(principal(p), "big").budgets
    assert budget.period == "billing:3:19800"


async def test_a_team_limit_per_provider_counts_only_that_providers_models(make_admission: AdmissionFactory) -> None:
    doc = org_policy().config.model_dump(exclude_defaults=True)
    doc["models"]["big"]["provider"] = "anthropic"
    doc["models"]["own"] = {"default_max_tokens": 16, "provider": "self-hosted"}
    doc["limits"] = [{"scope": "team_provider", "match": {"provider": "anthropic"}, "rpm": 1}]
    p = Policy(PoliciesConfig.model_validate(doc))
    adm = make_admission(p)
    admitted(await adm.admit(facts(principal(p), max_tokens=10), "big", now=T0))
    refusal = rejected(await adm.admit(facts(principal(p, THIRD_KEY), max_tokens=10), "big", now=T0))
    assert "team 'search' on anthropic" in refusal.message  # t2 is in the same team
    admitted(await adm.admit(facts(principal(p), max_tokens=10, model="own"), "own", now=T0))
    admitted(await adm.admit(facts(principal(p, FOURTH_KEY), max_tokens=10), "big", now=T0))  # team ads


@dataclasses.dataclass
class _Override:
    rule: str
    subject: str | None
    dimension: str
    value: float
    until_unix_s: float


@dataclasses.dataclass
class _Overrides:
    overrides: dict[str, _Override]
    overrides_generation: int = 0


def test_overrides_change_the_plan_while_active_and_a_named_subject_wins() -> None:
    import time

    p = org_policy(budgets=[{"id": "teams", "scope": "team", "usd_per_day": 1.0}])
    source = _Overrides({})
    p.limits.follow_overrides(source)
    k1, k4 = principal(p, KEY), principal(p, FOURTH_KEY)
    assert p.admission_plan(k1, "big").budgets[0].limit_usd == 1.0
    source.overrides["a"] = _Override("teams", None, "usd_per_day", 5.0, time.time() + 3600)
    source.overrides["b"] = _Override("teams", "ads", "usd_per_day", 7.0, time.time() + 3600)
    source.overrides["old"] = _Override("teams", "search", "usd_per_day", 9.0, time.time() - 1)  # ended
    source.overrides_generation += 1
    assert p.admission_plan(k1, "big").budgets[0].limit_usd == 5.0
    assert p.admission_plan(k4, "big").budgets[0].limit_usd == 7.0
    source.overrides["a"] = _Override("teams", None, "usd_per_day", 5.0, time.time() - 1)  # ends, no new generation
    p.limits._overrides_end_s = time.time() - 1  # as if its end had passed since the plans were built
    assert p.admission_plan(k1, "big").budgets[0].limit_usd == 1.0
