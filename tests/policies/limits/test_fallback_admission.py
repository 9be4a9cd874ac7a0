"""The lifecycle's degrade step, library-level: a 429 or an exhausted budget on the expensive model
becomes an admission on the cheaper one, at that model's limits and price, when the policy allows."""

from __future__ import annotations

import pytest

from policies.limits.admission import Admission, Admitted
from policies.policy import Policy, choose_fallback
from policies.types import Rejection, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.support import facts, policy, principal

T0 = 1_000_000.0


async def admit_with_fallback(
    p: Policy, adm: Admission, key: str, model: str = "big"
) -> tuple[Admitted | Rejection, list[str]]:
    """What the gateway's lifecycle does: admit; on a fallback-able rejection walk the chain."""
    who = principal(p, key)
    request = facts(who, prompt_tokens=1000, max_tokens=None, model=model)
    tried = [model]
    while True:
        result = await adm.admit(request, model, now=T0)
        if isinstance(result, Admitted):
            return result, tried
        following = choose_fallback(p, model, result.reason, who, not request.allow_fallback, tried=tried)
        if following is None:
            return result, tried
        model = following
        tried.append(model)


@pytest.fixture
def rate_policy() -> Policy:
    return policy(
        limits=[
            {"scope": "key_model", "match": {"model": "big"}, "rpm": 1},
            {"scope": "key_model", "match": {"model": "small"}, "rpm": 5},
        ]
    )


async def test_over_limit_on_the_expensive_model_runs_on_the_cheaper_one(
    make_admission: AdmissionFactory, rate_policy: Policy
) -> None:
    adm = make_admission(rate_policy)
    first, _ = await admit_with_fallback(rate_policy, adm, "sk-test-key-1")
    assert isinstance(first, Admitted) and first.model == "big"
    second, tried = await admit_with_fallback(rate_policy, adm, "sk-test-key-1")
    assert isinstance(second, Admitted) and second.model == "small" and tried == ["big", "small"]
    assert second.output_tokens == 256  # small's own default reservation
    await adm.settle(second, Usage(1000, 100), model="small", now=T0)
    assert second.actual_cost_usd == pytest.approx(1000 * 1e-6 + 100 * 2e-6)  # small's price
    assert ("x-ratelimit-limit-requests", "5") in second.headers  # small's limits


async def test_a_tenant_without_fallback_gets_the_429(make_admission: AdmissionFactory, rate_policy: Policy) -> None:
    adm = make_admission(rate_policy)
    await admit_with_fallback(rate_policy, adm, "sk-test-key-3")
    result, tried = await admit_with_fallback(rate_policy, adm, "sk-test-key-3")
    assert isinstance(result, Rejection) and result.status == 429 and tried == ["big"]


async def test_an_exhausted_budget_degrades_to_the_cheaper_model(make_admission: AdmissionFactory) -> None:
    p = policy(budgets=[{"scope": "key", "usd_per_day": 0.02}])  # big costs up to $0.025 here
    adm = make_admission(p)
    result, tried = await admit_with_fallback(p, adm, "sk-test-key-1")
    assert isinstance(result, Admitted) and result.model == "small" and tried == ["big", "small"]
