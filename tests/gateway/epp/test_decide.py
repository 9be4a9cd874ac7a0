"""The endpoint picker's transport on the director's walk, in process (Envoy's side is the test):
the pick among the endpoints Envoy allows, the body Envoy sends on, the response followed and the
request settled and recorded once; every "no" an immediate answer in the API's shape."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.epp.decide import EppDecider
from gateway.epp.exchange import Picked, Refused
from gateway.transport.engine import EngineTransport
from policies.types import Rejection
from tests.gateway.request.walk import KEY, RecordingAdmission, Walk, build, fleet

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def decider(walk: Walk) -> EppDecider:
    engine = walk.director.transport
    assert isinstance(engine, EngineTransport)
    return EppDecider(director=walk.director, engine=engine)


def envoy_headers(**extra: str) -> dict[str, str]:
    return {":path": "/v1/chat/completions", "authorization": f"Bearer {KEY}", "x-request-id": "req-1", **extra}


def chat_body(model: str = "big") -> bytes:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return orjson.dumps(body)


ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "llama-3.1-8b",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }
)


async def test_the_pick_is_an_allowed_endpoint_and_the_followed_answer_is_settled_once() -> None:
    walk = build(fleet({"big": URLS}))
    picker = decider(walk)
    picked = await picker.decide(envoy_headers(), chat_body(), ["10.0.0.2:8000"])
    assert isinstance(picked, Picked)
    assert picked.endpoints == ["10.0.0.2:8000"]  # the first endpoint is outside the subset
    assert orjson.loads(picked.body)["model"] == "llama-3.1-8b" and picked.body_changed
    assert picker.open == 1 and walk.records.records == []  # the request is open until its answer ends
    headers = dict(picked.follower.response_headers(200, {}))
    assert headers["x-tokenway-endpoint"] == "big/both-s1" and headers["x-tokenway-model"] == "big"
    relayed = picked.follower.body_chunk(ANSWER, True)
    assert orjson.loads(relayed)["model"] == "big"  # the public name back
    picked.follower.finish(True, "10.0.0.2:8000")
    await walk.settled()
    assert picker.open == 0
    (record,) = walk.records.records
    assert (record.status, record.endpoint, record.completion_tokens) == ("ok", "big/both-s1", 3)
    assert walk.admission.ends() == {"big-1": ["settle"]}
    assert walk.endpoints_idle()


async def test_no_allowed_endpoint_is_a_503_refusal_and_nothing_is_charged() -> None:
    walk = build(fleet({"big": URLS}))
    refused = await decider(walk).decide(envoy_headers(), chat_body(), ["10.9.9.9:8000"])
    assert isinstance(refused, Refused) and refused.status == 503
    assert orjson.loads(refused.body)["error"]["code"] == refused.details
    (record,) = walk.records.records
    assert record.status == "error" and walk.admission.ends() == {"big-1": ["release"]}


async def test_a_limit_refuses_without_walking_the_fallback_chain() -> None:
    rejection = Rejection(429, "Too many requests.", "requests", "rate_limit_exceeded", reason="rate_limited")
    walk = build(fleet({"big": URLS, "small": URLS}), admission=RecordingAdmission(reject={"big": rejection}))
    refused = await decider(walk).decide(envoy_headers(), chat_body(), None)
    assert isinstance(refused, Refused) and refused.status == 429
    assert walk.admission.events == [("reject", "big")]  # big falls back to small over HTTP, not here
    (record,) = walk.records.records
    assert record.status == "rejected" and record.fallback_from is None


async def test_an_unknown_path_is_a_404_refusal() -> None:
    walk = build(fleet({"big": URLS}))
    refused = await decider(walk).decide(envoy_headers(**{":path": "/v1/images"}), chat_body(), None)
    assert isinstance(refused, Refused) and refused.status == 404


async def test_a_request_id_that_is_not_short_visible_ascii_is_replaced_as_on_the_gateways_routes() -> None:
    walk = build(fleet({"big": URLS}))
    refused = await decider(walk).decide(envoy_headers(**{"x-request-id": "x" * 5000}), chat_body(), ["10.9.9.9:8000"])
    assert isinstance(refused, Refused)
    (record,) = walk.records.records
    assert len(record.request_id) == 32 and record.request_id != "x" * 5000  # a generated one


async def test_a_unary_answer_without_readable_usage_is_charged_its_reservation_as_on_the_http_walk() -> None:
    """The picker settles through the walk's own rule (`Accounting.settle_soon`): an answer whose usage
    cannot be read is billed the whole reservation, the most the engine may have produced."""
    walk = build(fleet({"big": URLS}))
    picker = decider(walk)
    picked = await picker.decide(envoy_headers(), chat_body(), None)
    assert isinstance(picked, Picked)
    picked.follower.response_headers(200, {})
    answer = orjson.loads(ANSWER)
    answer["usage"] = "many"
    picked.follower.body_chunk(orjson.dumps(answer), True)
    picked.follower.finish(True, None)
    await walk.settled()
    (record,) = walk.records.records
    assert record.usage_source == "reserved"  # not "none": an answer billed nothing
    assert walk.admission.ends() == {"big-1": ["settle"]}
