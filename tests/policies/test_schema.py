"""Schema validation: every cross-reference problem reported with its key path."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from policies.policy import hash_key
from policies.schema import TRIGGERS, LimitConfig, PoliciesConfig, ReferenceErrors


def doc(**extra: Any) -> dict[str, Any]:
    return {
        "tenants": {"t": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("x")}],
        "models": {"a": {"aliases": ["a-alias"]}, "b": {}},
        **extra,
    }


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as info:
        PoliciesConfig.model_validate(data)
    found: list[str] = []
    for error in info.value.errors():
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, ReferenceErrors):
            found += [f"{'.'.join(map(str, path))}: {message}" for path, message in cause.problems]
        else:
            found.append(f"{'.'.join(map(str, error['loc']))}: {error['msg']}")
    return found


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"keys": [{"id": "k", "tenant": "nope", "sha256": hash_key("x")}]}, "keys.0.tenant: unknown tenant 'nope'"),
        ({"limits": [{"scope": "key", "match": {"key": "zz"}, "rpm": 1}]}, "limits.0.match.key: unknown key id 'zz'"),
        (
            {"budgets": [{"scope": "model", "match": {"model": "zz"}, "usd_per_day": 1}]},
            "budgets.0.match.model: unknown model 'zz'",
        ),
        (
            {"limits": [{"scope": "key", "rpm": 1}, {"scope": "key", "tpm": 5}]},
            "limits.1: same identity 'key' as limits[0]",
        ),
        ({"models": {"a": {"fallbacks": ["a"]}}}, "models.a.fallbacks.0.model: a model cannot fall back to itself"),
        ({"models": {"a": {"fallbacks": ["zz"]}}}, "models.a.fallbacks.0.model: unknown model 'zz'"),
        (
            {"limits": [{"scope": "tenant", "match": {"model": "a"}, "rpm": 1}]},
            "limits.0: Value error, scope 'tenant' cannot match on model (expected org, team, tenant)",
        ),
        ({"limits": [{"scope": "key"}]}, "limits.0: Value error, expected at least one of rpm"),
        (
            {"limits": [{"scope": "key", "tpm": 1, "weights": {"input": 1}}]},
            "weights are only read with count: weighted",
        ),
        (
            {"budgets": [{"scope": "global"}]},
            "budgets.0: Value error, expected usd_per_day, usd_per_month, usd_per_period and/or usd_per_run",
        ),
    ],
    ids=[
        "key-tenant",
        "match-key",
        "match-model",
        "duplicate-identity",
        "self-fallback",
        "unknown-fallback",
        "scope-match",
        "no-dimension",
        "stray-weights",
        "no-amount",
    ],
)
def test_problems_name_their_key_path(extra: dict[str, Any], expected: str) -> None:
    assert any(expected in p for p in problems(doc(**extra))), problems(doc(**extra))


def test_all_reference_problems_are_reported_together() -> None:
    found = problems(
        doc(
            keys=[{"id": "k", "tenant": "nope", "sha256": hash_key("x")}],
            limits=[{"scope": "tenant", "match": {"tenant": "ghost"}, "rpm": 1}],
        )
    )
    assert len(found) == 2


def test_fallback_shorthand_means_every_trigger() -> None:
    config = PoliciesConfig.model_validate(doc(models={"a": {"fallbacks": ["b"]}, "b": {}}))
    (step,) = config.models["a"].fallbacks
    assert step.model == "b" and "context_too_long" in step.triggers and len(step.triggers) == len(TRIGGERS)


def test_rule_identity_defaults_to_scope_and_match_with_aliases_resolved() -> None:
    config = PoliciesConfig.model_validate(doc())
    rule = LimitConfig.model_validate({"scope": "key_model", "match": {"model": "a-alias", "key": "k"}, "rpm": 1})
    assert rule.identity() == "key_model[key=k,model=a-alias]"
    assert rule.identity(config.resolve_model) == "key_model[key=k,model=a]"
    assert LimitConfig.model_validate({"id": "mine", "scope": "global", "rpm": 1}).identity() == "mine"
