"""Which buckets apply to a (key, model): scopes stack, the most specific rule of a scope wins."""

from __future__ import annotations

from policies.limits.plan import Plan
from tests.policies.limits.support import OTHER_KEY, policy, principal


def dims(plan: Plan) -> list[tuple[str, str, str, float]]:
    return [(b.rule_id, b.dimension, b.subject, b.capacity) for b in plan.buckets]


def test_the_most_specific_rule_of_a_scope_wins_per_dimension() -> None:
    p = policy(
        limits=[
            {"scope": "key", "rpm": 10, "tpm": 1000},
            {"scope": "key", "match": {"tenant": "t1"}, "rpm": 20},
            {"scope": "key", "match": {"key": "k1"}, "rpm": 30},
        ]
    )
    k1 = p.admission_plan(principal(p, "sk-test-key-1"), "big")
    k2 = p.admission_plan(principal(p, OTHER_KEY), "big")
    k3 = p.admission_plan(principal(p, "sk-test-key-3"), "big")
    assert dims(k1) == [("key[key=k1]", "rpm", "k1", 30), ("key", "tpm", "k1", 1000)]
    assert dims(k2) == [("key[tenant=t1]", "rpm", "k2", 20), ("key", "tpm", "k2", 1000)]
    assert dims(k3) == [("key", "rpm", "k3", 10), ("key", "tpm", "k3", 1000)]


def test_scopes_stack_and_equally_specific_rules_all_apply() -> None:
    p = policy(
        limits=[
            {"scope": "global", "rpm": 1000},
            {"scope": "tenant", "rpm": 100},
            {"scope": "model", "match": {"model": "gpt-big"}, "rpm": 50},  # an alias names the model
            {"scope": "key_model", "match": {"key": "k1"}, "rpm": 5},
            {"scope": "key_model", "match": {"model": "big"}, "rpm": 6},
        ]
    )
    plan = p.admission_plan(principal(p), "big")
    assert dims(plan) == [
        ("tenant", "rpm", "t1", 100),
        ("model[model=big]", "rpm", "big", 50),
        ("key_model[key=k1]", "rpm", "k1/big", 5),
        ("key_model[model=big]", "rpm", "k1/big", 6),
        ("global", "rpm", "*", 1000),
    ]
    assert dims(p.admission_plan(principal(p), "small")) == [
        ("tenant", "rpm", "t1", 100),
        ("key_model[key=k1]", "rpm", "k1/small", 5),
        ("global", "rpm", "*", 1000),
    ]


def test_store_keys_follow_rule_identity_not_list_position() -> None:
    rules = [{"scope": "key", "tpm": 1000}, {"id": "tenant-cap", "scope": "tenant", "tpm": 5000}]
    a = policy(limits=rules)
    b = policy(limits=list(reversed(rules)))
    keys_a = sorted(s.key for s in a.admission_plan(principal(a), "big").buckets)
    keys_b = sorted(s.key for s in b.admission_plan(principal(b), "big").buckets)
    assert keys_a == keys_b == ["key|tpm|k1", "tenant-cap|tpm|t1"]


def test_leases_budgets_price_and_rates() -> None:
    p = policy(
        limits=[{"scope": "key", "max_concurrent": 4, "tpd": 86_400}],
        budgets=[{"scope": "tenant", "usd_per_day": 1, "usd_per_month": 20}],
    )
    plan = p.admission_plan(principal(p), "big")
    (bucket,) = plan.buckets
    assert bucket.rate_per_s == 1.0 and bucket.kind == "tokens"
    assert [(lease.subject, lease.capacity) for lease in plan.leases] == [("k1", 4)]
    assert [(b.period, b.limit_usd) for b in plan.budgets] == [("day", 1.0), ("month", 20.0)]
    assert plan.price.input_usd == 10e-6 and plan.price.cached_input_usd == 1e-6
    assert plan.default_max_tokens == 512


def test_plans_are_cached_for_known_models_only() -> None:
    p = policy(limits=[{"scope": "key", "rpm": 1}])
    who = principal(p)
    assert p.admission_plan(who, "big") is p.admission_plan(who, "big")
    assert p.admission_plan(who, "nope") is not p.admission_plan(who, "nope")
