"""Admission end to end over each store (memory and real Redis): reserve, reject, reconcile."""

from __future__ import annotations

import dataclasses

import pytest

from policies.limits.admission import Admitted
from policies.types import Rejection, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.state import active_leases, bucket_used, budget_spent
from tests.policies.limits.support import OTHER_KEY, facts, header, policy, principal

T0 = 1_000_000.0  # a fixed clock: the tests pass `now` so refill is exact


def admitted(result: Admitted | Rejection) -> Admitted:
    assert isinstance(result, Admitted), result
    return result


def rejected(result: Admitted | Rejection) -> Rejection:
    assert isinstance(result, Rejection), result
    return result


async def test_headers_describe_the_tightest_bucket_after_the_charge(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 60, "tpm": 60_000}, {"scope": "tenant", "tpm": 30_000}])
    adm = make_admission(p)
    ticket = admitted(await adm.admit(facts(principal(p), prompt_tokens=100, max_tokens=900), "big", now=T0))
    assert header(ticket.headers, "x-ratelimit-limit-requests") == "60"
    assert header(ticket.headers, "x-ratelimit-remaining-requests") == "59"
    assert header(ticket.headers, "x-ratelimit-reset-requests") == "1s"
    assert header(ticket.headers, "x-ratelimit-limit-tokens") == "30000"  # the tenant's is tighter
    assert header(ticket.headers, "x-ratelimit-remaining-tokens") == "29000"
    assert header(ticket.headers, "x-ratelimit-reset-tokens") == "2s"  # 1000 tokens at 500/s


async def test_reserving_1000_output_tokens_and_using_10_refunds_990(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpd": 1_000_000}])
    adm = make_admission(p)
    who = principal(p)
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0))
    (spec,) = p.admission_plan(who, "big").buckets
    assert await bucket_used(adm, spec, T0) == pytest.approx(1100)
    await adm.settle(ticket, Usage(prompt_tokens=100, completion_tokens=10), model="big", now=T0)
    assert await bucket_used(adm, spec, T0) == pytest.approx(110)  # 990 refunded
    nxt = admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0))
    assert header(nxt.headers, "x-ratelimit-remaining-tokens") == str(1_000_000 - 110 - 1100)


async def test_usage_over_the_reservation_puts_the_bucket_in_debt(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])  # refills 100 tokens/s
    adm = make_admission(p)
    who = principal(p)
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=900), "big", now=T0))
    await adm.settle(ticket, Usage(prompt_tokens=100, completion_tokens=6900), model="big", now=T0)
    (spec,) = p.admission_plan(who, "big").buckets
    assert await bucket_used(adm, spec, T0) == pytest.approx(7000)  # 1000 over capacity
    no = rejected(await adm.admit(facts(who, prompt_tokens=100, max_tokens=900), "big", now=T0))
    assert header(no.headers, "retry-after-ms") == "20000"  # 7000 + 1000 - 6000 = 2000 tokens at 100/s


async def test_429_names_the_limit_and_the_true_refill_time(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])
    adm = make_admission(p)
    who = principal(p)
    admitted(await adm.admit(facts(who, prompt_tokens=900, max_tokens=5000), "big", now=T0))
    no = rejected(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0))
    assert (no.status, no.type, no.code, no.reason) == (429, "tokens", "rate_limit_exceeded", "rate_limited")
    assert "tokens per min (TPM): Limit 6000, Used 5900, Requested 1100" in no.message
    assert "key 'k1'" in no.message and "try again in 10s" in no.message
    assert header(no.headers, "retry-after-ms") == "10000"  # (5900 + 1100 - 6000) / 100 per s
    assert header(no.headers, "retry-after") == "10"
    assert header(no.headers, "x-ratelimit-remaining-tokens") == "100"
    assert header(no.headers, "x-should-retry") is None
    # ... and after exactly that long it fits
    assert isinstance(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0 + 9.9), Rejection)
    admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0 + 10.0))


async def test_request_limit_answers_type_requests(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 2}])
    adm = make_admission(p)
    who = principal(p)
    for _ in range(2):
        admitted(await adm.admit(facts(who), "big", now=T0))
    no = rejected(await adm.admit(facts(who), "big", now=T0))
    assert no.type == "requests" and "requests per min (RPM): Limit 2, Used 2, Requested 1" in no.message
    assert header(no.headers, "retry-after-ms") == "30000"


async def test_a_request_larger_than_the_whole_bucket_can_never_fit(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 1000}])
    adm = make_admission(p)
    no = rejected(await adm.admit(facts(principal(p), prompt_tokens=500, max_tokens=600), "big", now=T0))
    assert (no.status, no.code, no.reason) == (429, "rate_limit_exceeded", "rate_limited")
    assert "Request too large" in no.message and "Limit 1000, Requested 1100" in no.message
    assert header(no.headers, "x-should-retry") == "false"
    assert header(no.headers, "retry-after") is None


async def test_waits_over_a_minute_tell_clients_not_to_auto_retry(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpd": 10_000}])
    adm = make_admission(p)
    who = principal(p)
    admitted(await adm.admit(facts(who, prompt_tokens=0, max_tokens=9000), "big", now=T0))
    no = rejected(await adm.admit(facts(who, prompt_tokens=0, max_tokens=2000), "big", now=T0))
    assert header(no.headers, "retry-after-ms") == str(round(1000 / (10_000 / 86_400) * 1000))
    assert header(no.headers, "x-should-retry") == "false"


async def test_reservation_is_all_or_nothing_across_scopes(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 100_000}, {"scope": "tenant", "tpm": 5000}])
    adm = make_admission(p)
    who = principal(p)
    key_spec, tenant_spec = p.admission_plan(who, "big").buckets
    admitted(await adm.admit(facts(who, prompt_tokens=0, max_tokens=4000), "big", now=T0))
    rejected(await adm.admit(facts(who, prompt_tokens=0, max_tokens=2000), "big", now=T0))
    assert await bucket_used(adm, key_spec, T0) == pytest.approx(4000)  # the key bucket was not charged
    assert await bucket_used(adm, tenant_spec, T0) == pytest.approx(4000)


async def test_scopes_share_or_separate_buckets(make_admission: AdmissionFactory) -> None:
    p = policy(
        limits=[
            {"scope": "model", "match": {"model": "big"}, "rpm": 3},
            {"scope": "key_model", "rpm": 2},
        ]
    )
    adm = make_admission(p)
    k1, k2 = principal(p), principal(p, OTHER_KEY)
    admitted(await adm.admit(facts(k1), "big", now=T0))
    admitted(await adm.admit(facts(k1), "big", now=T0))
    assert rejected(await adm.admit(facts(k1), "big", now=T0)).message.count("key 'k1' on this model") == 1
    admitted(await adm.admit(facts(k1, model="small"), "small", now=T0))  # another model, another bucket
    admitted(await adm.admit(facts(k2), "big", now=T0))  # the model's third request
    no = rejected(await adm.admit(facts(k2), "big", now=T0))
    assert "all callers of the model" in no.message


async def test_budget_spends_real_usage_and_refuses_the_request_that_would_cross_it(
    make_admission: AdmissionFactory,
) -> None:
    # big: $10 / M input, $30 / M output; budget $0.05 a day
    p = policy(budgets=[{"scope": "tenant", "usd_per_day": 0.05}])
    adm = make_admission(p)
    who = principal(p)
    (spec,) = p.admission_plan(who, "big").budgets
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000), "big", now=T0))
    assert ticket.cost_usd == pytest.approx(0.04)  # reserved: 1000 x 10e-6 + 1000 x 30e-6
    await adm.settle(ticket, Usage(prompt_tokens=1000, completion_tokens=500, cached_tokens=400), model="big", now=T0)
    spent = 600 * 10e-6 + 400 * 1e-6 + 500 * 30e-6  # cached input at its own price
    assert ticket.actual_cost_usd == pytest.approx(spent)
    assert await budget_spent(adm, spec) == pytest.approx(spent)
    admitted(await adm.admit(facts(who, prompt_tokens=200, max_tokens=200), "big", now=T0))  # $0.008 fits
    no = rejected(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000), "big", now=T0))
    assert (no.status, no.type, no.code) == (429, "insufficient_quota", "insufficient_quota")
    assert no.reason == "budget_exhausted"
    assert header(no.headers, "x-should-retry") == "false"
    assert "daily budget" in no.message and "$0.05" in no.message
    # the cheaper model still fits under the same budget (what a fallback would do)
    admitted(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000, model="big"), "small", now=T0))


async def test_a_budget_under_a_cent_is_printed_exactly_and_its_429_says_when_it_resets(
    make_admission: AdmissionFactory,
) -> None:
    # big: $10 / M input, $30 / M output; half a cent a day: 100 + 100 tokens ($0.004) fit once
    p = policy(budgets=[{"scope": "key", "usd_per_day": 0.005}])
    adm = make_admission(p)
    who = principal(p)
    admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=100), "big", now=T0))
    no = rejected(await adm.admit(facts(who, prompt_tokens=100, max_tokens=100), "big", now=T0))
    assert "is $0.005," in no.message and "$0.004 is spent" in no.message and "$0.00," not in no.message
    reset_s = 86_400 - T0 % 86_400  # to the next UTC midnight
    assert header(no.headers, "x-ratelimit-reset-usd") == "10h13m20s" and reset_s == 36_800
    assert header(no.headers, "retry-after") == "36800" and header(no.headers, "retry-after-ms") == "36800000"
    assert header(no.headers, "x-should-retry") == "false"  # a wait of hours: clients must not sleep on it
    assert header(no.headers, "x-ratelimit-limit-usd") == "0.005"
    assert header(no.headers, "x-ratelimit-remaining-usd") == "0.001"
    near_midnight = T0 + reset_s - 30  # a wait of half a minute: retried after it, when the budget is new
    late = rejected(await adm.admit(facts(who, prompt_tokens=100, max_tokens=100), "big", now=near_midnight))
    assert header(late.headers, "retry-after") == "30" and header(late.headers, "x-should-retry") is None


async def test_monthly_budget_and_a_request_costlier_than_the_budget(make_admission: AdmissionFactory) -> None:
    p = policy(budgets=[{"scope": "key", "usd_per_month": 0.01}])
    adm = make_admission(p)
    no = rejected(await adm.admit(facts(principal(p), prompt_tokens=1000, max_tokens=1000), "big", now=T0))
    assert no.code == "insufficient_quota" and "monthly budget" in no.message
    # costlier than the whole budget: waiting cannot help, so no retry-after, only when it resets
    assert header(no.headers, "retry-after") is None and header(no.headers, "x-should-retry") == "false"
    assert header(no.headers, "x-ratelimit-reset-usd") is not None


async def test_shadow_limits_count_and_report_but_never_reject(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"id": "trial", "scope": "key", "rpm": 1, "shadow": True}, {"scope": "key", "rpm": 10}])
    adm = make_admission(p)
    who = principal(p)
    first = admitted(await adm.admit(facts(who), "big", now=T0))
    second = admitted(await adm.admit(facts(who), "big", now=T0))
    assert first.shadow_exceeded == () and second.shadow_exceeded == ("trial",)
    assert header(second.headers, "x-ratelimit-limit-requests") == "10"  # shadow buckets are not advertised
    assert adm.status()["shadow_exceeded"] == {"trial": 1}


async def test_concurrency_leases_release_on_settle_and_expire_alone(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "max_concurrent": 2}], admission={"lease_ttl_s": 30})
    adm = make_admission(p)
    who = principal(p)
    (lease,) = p.admission_plan(who, "big").leases
    a = admitted(await adm.admit(facts(who), "big", now=T0))
    admitted(await adm.admit(facts(who), "big", now=T0))
    no = rejected(await adm.admit(facts(who), "big", now=T0))
    assert no.type == "requests" and "concurrent requests: Limit 2, Used 2" in no.message
    assert header(no.headers, "retry-after") == "1"
    await adm.settle(a, Usage(100, 10), model="big", now=T0)
    assert await active_leases(adm, lease.key, T0) == 1
    admitted(await adm.admit(facts(who), "big", now=T0))
    # a gateway that crashed leaks nothing: after the TTL both leases are gone
    admitted(await adm.admit(facts(who), "big", now=T0 + 31))
    assert await active_leases(adm, lease.key, T0 + 31) == 1


async def test_release_undoes_everything_and_settle_is_idempotent(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 10, "tpm": 100_000}], budgets=[{"scope": "key", "usd_per_day": 5}])
    adm = make_admission(p)
    who = principal(p)
    plan = p.admission_plan(who, "big")
    ticket = admitted(await adm.admit(facts(who), "big", now=T0))
    await adm.release(ticket, now=T0)
    await adm.release(ticket, now=T0)
    await adm.settle(ticket, Usage(100, 10), model="big", now=T0)
    for spec in plan.buckets:
        assert await bucket_used(adm, spec, T0) == pytest.approx(0.0)
    assert await budget_spent(adm, plan.budgets[0]) == pytest.approx(0.0)
    other = admitted(await adm.admit(facts(who), "big", now=T0))
    await adm.settle(other, Usage(100, 10), model="big", now=T0)
    await adm.settle(other, Usage(100, 10), model="big", now=T0)
    assert await bucket_used(adm, plan.buckets[1], T0) == pytest.approx(110)


@pytest.mark.parametrize(
    ("charged_output_tokens", "expected_tokens"),
    [(37, 100 + 37), (None, 100 + 1000)],
    ids=["counted", "reservation"],
)
async def test_a_broken_stream_is_charged_what_was_counted_or_the_reservation(
    make_admission: AdmissionFactory, charged_output_tokens: int | None, expected_tokens: int
) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 100_000}])
    adm = make_admission(p)
    who = principal(p)
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0))
    await adm.settle(ticket, None, model="big", charged_output_tokens=charged_output_tokens, now=T0)
    (spec,) = p.admission_plan(who, "big").buckets
    assert await bucket_used(adm, spec, T0) == pytest.approx(expected_tokens)


async def test_weighted_count_charges_cached_input_at_a_tenth(make_admission: AdmissionFactory) -> None:
    weights = {"input": 1.0, "cached_input": 0.1, "output": 2.0}
    p = policy(limits=[{"scope": "key", "tpm": 100_000, "count": "weighted", "weights": weights}])
    adm = make_admission(p)
    who = principal(p)
    (spec,) = p.admission_plan(who, "big").buckets
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=100), "big", now=T0))
    assert await bucket_used(adm, spec, T0) == pytest.approx(1000 + 200)  # nothing assumed cached up front
    await adm.settle(ticket, Usage(prompt_tokens=1000, completion_tokens=50, cached_tokens=800), model="big", now=T0)
    assert await bucket_used(adm, spec, T0) == pytest.approx(200 + 80 + 100)


@pytest.mark.parametrize(("count", "expected"), [("input", 100), ("output", 1000), ("total", 1100)])
async def test_count_modes(make_admission: AdmissionFactory, count: str, expected: int) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 100_000, "count": count}])
    adm = make_admission(p)
    who = principal(p)
    admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=1000), "big", now=T0))
    (spec,) = p.admission_plan(who, "big").buckets
    assert await bucket_used(adm, spec, T0) == pytest.approx(expected)


async def test_a_fallback_model_reserves_its_own_default_output(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpm": 100_000}])
    adm = make_admission(p)
    who = principal(p)
    ticket = admitted(await adm.admit(facts(who, prompt_tokens=100, max_tokens=None), "small", now=T0))
    assert ticket.output_tokens == 256  # small's default_max_tokens, not big's 512
    embedding = admitted(await adm.admit(facts(who, prompt_tokens=100, api="embeddings"), "big", now=T0))
    assert embedding.output_tokens == 0


async def test_no_limits_means_admitted_without_a_store_call(make_admission: AdmissionFactory) -> None:
    p = policy()
    adm = make_admission(p)
    ticket = admitted(await adm.admit(facts(principal(p)), "big", now=T0))
    assert ticket.headers == () and ticket.source == "none"
    await adm.settle(ticket, Usage(100, 10), model="big")
    assert ticket.actual_cost_usd == pytest.approx(100 * 10e-6 + 10 * 30e-6)


async def test_snapshot_reports_buckets_and_budgets(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "tpd": 1_000_000}], budgets=[{"scope": "tenant", "usd_per_day": 5.0}])
    adm = make_admission(p)
    admitted(await adm.admit(facts(principal(p), prompt_tokens=100, max_tokens=1000), "big"))  # real clock
    rows = {row["kind"]: row for row in adm.snapshot()}
    bucket, budget = rows["bucket"], rows["budget"]
    assert (bucket["rule"], bucket["subject"], bucket["dimension"]) == ("key", "k1", "tpd")
    assert bucket["remaining"] == pytest.approx(1_000_000 - 1100, abs=2)
    assert budget["spent_usd"] == pytest.approx(100 * 10e-6 + 1000 * 30e-6)
    assert adm.status()["decisions"] == {"admitted": 1}


async def test_a_batch_line_reserves_and_spends_its_batch_price(make_admission: AdmissionFactory) -> None:
    # big: $10 / M input, $30 / M output; batch lines pay half by default, big's own factor overrides
    p = policy(budgets=[{"scope": "tenant", "usd_per_day": 0.05}])
    adm = make_admission(p)
    who = principal(p)
    (spec,) = p.admission_plan(who, "big").budgets
    line = dataclasses.replace(facts(who, prompt_tokens=1000, max_tokens=1000), batch_id="batch_1")
    ticket = admitted(await adm.admit(line, "big", now=T0))
    assert ticket.cost_usd == pytest.approx(0.02)  # half of 1000 x 10e-6 + 1000 x 30e-6
    await adm.settle(ticket, Usage(prompt_tokens=1000, completion_tokens=500), model="big", now=T0)
    assert ticket.actual_cost_usd == pytest.approx(0.5 * (1000 * 10e-6 + 500 * 30e-6))
    assert await budget_spent(adm, spec) == pytest.approx(ticket.actual_cost_usd)
    cheaper = policy(
        batch={"price_factor": 0.5}, models={"big": {"price": {"input_per_mtok": 10.0, "batch_factor": 0.2}}}
    )
    assert cheaper.batch_price_factor("big") == 0.2
    assert p.batch_price_factor("small") == 0.5


async def test_pool_prices_reserve_the_dearest_and_settle_at_the_serving_pool(
    make_admission: AdmissionFactory,
) -> None:
    # big: $10 / M input, $30 / M output on its own pools; pool "hosted" bills $20 / $60
    models = policy().config.model_dump()["models"]
    models["big"]["pool_prices"] = {"hosted": {"input_per_mtok": 20.0, "output_per_mtok": 60.0}}
    p = policy(models=models, budgets=[{"scope": "tenant", "usd_per_day": 1.0}])
    adm = make_admission(p)
    who = principal(p)
    (spec,) = p.admission_plan(who, "big").budgets
    owned = admitted(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000), "big", now=T0))
    assert owned.cost_usd == pytest.approx(1000 * 20e-6 + 1000 * 60e-6)  # before routing: the dearest pool
    await adm.settle(owned, Usage(prompt_tokens=1000, completion_tokens=500), model="big", now=T0, pool="owned")
    assert owned.actual_cost_usd == pytest.approx(1000 * 10e-6 + 500 * 30e-6)  # the model's price
    hosted = admitted(await adm.admit(facts(who, prompt_tokens=1000, max_tokens=1000), "big", now=T0))
    await adm.settle(hosted, Usage(prompt_tokens=1000, completion_tokens=1000), model="big", now=T0, pool="hosted")
    assert hosted.actual_cost_usd == pytest.approx(hosted.cost_usd)  # the whole reservation, not over it
    assert owned.actual_cost_usd is not None and hosted.actual_cost_usd is not None
    assert await budget_spent(adm, spec) == pytest.approx(owned.actual_cost_usd + hosted.actual_cost_usd)
