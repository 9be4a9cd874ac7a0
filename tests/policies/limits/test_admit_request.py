"""Admission.admit_request: one request against the request limits of the caller's key and tenant,
for the calls that run no model (the Files and Batch APIs), over each store: exactly one unit of
each request bucket, nothing of token buckets, concurrency, dollars or a model's own limits."""

from __future__ import annotations

from policies.limits.admission import Admitted
from policies.types import Rejection, Usage
from tests.policies.limits.conftest import AdmissionFactory
from tests.policies.limits.support import OTHER_KEY, facts, policy, principal

T0 = 1_000_000.0


async def test_each_call_is_one_request_of_the_key(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "key", "rpm": 2}])
    adm = make_admission(p)
    who = principal(p)
    for _ in range(2):
        ticket = await adm.admit_request(who, "POST /v1/files", now=T0)
        assert isinstance(ticket, Admitted)
        assert dict(ticket.headers)["x-ratelimit-limit-requests"] == "2"
        await adm.settle(ticket, Usage(), model="", now=T0)  # settling corrects nothing
    refused = await adm.admit_request(who, "POST /v1/files", now=T0)
    assert isinstance(refused, Rejection) and refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert refused.type == "requests" and "POST /v1/files" in refused.message
    assert any(name.lower() == "retry-after" for name, _ in refused.headers)
    assert isinstance(await adm.admit(facts(who), "big", now=T0), Rejection)  # the same requests bucket


async def test_the_tenants_request_limit_holds_across_its_keys(make_admission: AdmissionFactory) -> None:
    p = policy(limits=[{"scope": "tenant", "rpm": 1}])
    adm = make_admission(p)
    assert isinstance(await adm.admit_request(principal(p), "GET /v1/files", now=T0), Admitted)
    refused = await adm.admit_request(principal(p, OTHER_KEY), "GET /v1/files", now=T0)  # the same tenant t1
    assert isinstance(refused, Rejection) and refused.status == 429


async def test_tokens_concurrency_and_model_limits_are_not_charged(make_admission: AdmissionFactory) -> None:
    p = policy(
        limits=[
            {"scope": "key", "tpm": 10, "max_concurrent": 1},
            {"scope": "model", "match": {"model": "big"}, "rpm": 1},
            {"scope": "global", "rpm": 1},
        ]
    )
    adm = make_admission(p)
    who = principal(p)
    for _ in range(3):
        ticket = await adm.admit_request(who, "GET /v1/batches", now=T0)
        assert isinstance(ticket, Admitted) and ticket.headers == ()
    held = await adm.admit(facts(who, prompt_tokens=5, max_tokens=5), "big", now=T0)
    assert isinstance(held, Admitted)  # every limit of the model call still whole
    assert isinstance(await adm.admit_request(who, "GET /v1/batches", now=T0), Admitted)  # its slot is not needed
    await adm.release(held, now=T0)
