"""Admission.precheck: the refusal a caller with no room left gets before its prompt is counted, over
each store (memory, and Redis through the mirror of what this process saw), never a charge."""

from __future__ import annotations

from policies.limits.admission import Admitted
from policies.types import Rejection, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.support import facts, policy, principal

T0 = 1_000_000.0


async def test_a_spent_key_request_limit_is_refused_before_any_count(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 2}])
    adm = make_admission(p)
    who = principal(p)
    assert await adm.precheck(who, "big", now=T0) is None
    for _ in range(2):
        ticket = await adm.admit(facts(who, prompt_tokens=10, max_tokens=10), "big", now=T0)
        assert isinstance(ticket, Admitted)
        await adm.settle(ticket, Usage(10, 10), model="big", now=T0)
    refused = await adm.precheck(who, "big", now=T0)
    assert isinstance(refused, Rejection) and refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert any(name.lower() == "retry-after" for name, _ in refused.headers)


async def test_a_precheck_charges_nothing(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 1}])
    adm = make_admission(p)
    who = principal(p)
    for _ in range(5):
        assert await adm.precheck(who, "big", now=T0) is None
    assert isinstance(await adm.admit(facts(who), "big", now=T0), Admitted)


async def test_a_models_own_limit_is_left_to_admission_and_its_fallbacks(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key_model", "match": {"model": "big"}, "rpm": 1}])
    adm = make_admission(p)
    who = principal(p)
    ticket = await adm.admit(facts(who, prompt_tokens=10, max_tokens=10), "big", now=T0)
    assert isinstance(ticket, Admitted)
    await adm.settle(ticket, Usage(10, 10), model="big", now=T0)
    assert await adm.precheck(who, "big", now=T0) is None  # "big" falls back to "small"


async def test_every_concurrency_slot_taken_is_refused(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "tenant", "max_concurrent": 1}])
    adm = make_admission(p)
    who = principal(p)
    ticket = await adm.admit(facts(who), "big", now=T0)
    assert isinstance(ticket, Admitted)
    refused = await adm.precheck(who, "big", now=T0)
    if refused is not None:  # the memory store sees its leases; the Redis mirror does not hold them
        assert refused.status == 429
    await adm.release(ticket, now=T0)
    assert await adm.precheck(who, "big", now=T0) is None
