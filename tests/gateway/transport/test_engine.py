"""The engine transport under the walk: an engine's answer (a small aiohttp app on a real socket, in
this event loop) relayed to the client, and the failures before the first byte it classifies for
the walk's retry (`NotSent`): the endpoint's, the request's, a crash."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.request import Hook, RequestContext
from gateway.telemetry.metrics import GatewayMetrics
from gateway.transport.engine import EngineTransport
from gateway.transport.observers import RouteMetrics
from tests.gateway.request.walk import body_json, build, chat_request, fleet


@dataclass
class FakeEngine:
    """An OpenAI-compatible engine that answers from a script: (status, JSON body) per call, the
    last one repeating; it records the bodies it was sent."""

    script: list[tuple[int, dict[str, Any]]]
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def chat(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        status, body = self.script[min(len(self.seen) - 1, len(self.script) - 1)]
        return web.json_response(body, status=status)


ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "llama-3.1-8b",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
}


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(engine: FakeEngine) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", engine.chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


class Ends(Hook):
    def __init__(self) -> None:
        self.dispatched_n = 0
        self.ended_n = 0

    def dispatched(self, ctx: RequestContext) -> None:
        self.dispatched_n += 1

    def ended(self, ctx: RequestContext) -> None:
        self.ended_n += 1


async def test_the_engines_answer_reaches_the_client_under_its_public_name(serve: Any) -> None:
    engine = FakeEngine([(200, ANSWER)])
    ends = Ends()
    walk = build(fleet({"big": [await serve(engine)]}), hooks=[ends])
    assert isinstance(walk.director.transport, EngineTransport)
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 200
    answer = body_json(response)
    assert answer["model"] == "big" and answer["choices"][0]["message"]["content"] == "hi"
    assert response.headers["x-tokenway-model"] == "big"
    (sent,) = engine.seen
    assert sent["model"] == "llama-3.1-8b"  # the engine's own name for the model
    (record,) = walk.records.records
    assert (record.status, record.completion_tokens, record.usage_source) == ("ok", 3, "engine")
    assert (ends.dispatched_n, ends.ended_n) == (1, 1)
    assert walk.admission.ends() == {"big-1": ["settle"]}
    assert walk.endpoints_idle()
    await walk.upstream.close()


async def test_an_overloaded_endpoint_is_not_sent_and_the_walk_tries_another(serve: Any) -> None:
    busy = FakeEngine([(503, {"error": {"message": "overloaded"}})])
    ready = FakeEngine([(200, ANSWER)])
    ends = Ends()
    walk = build(fleet({"big": [await serve(busy), await serve(ready)]}), hooks=[ends])
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 200 and len(busy.seen) == len(ready.seen) == 1
    (record,) = walk.records.records
    assert record.upstream_attempts == 2 and record.endpoint == walk.router.dispatched[-1]
    assert (ends.dispatched_n, ends.ended_n) == (2, 2)  # each attempt ended once
    assert walk.admission.ends() == {"big-1": ["settle"]}
    await walk.upstream.close()


async def test_an_engine_that_says_the_request_is_wrong_answers_its_4xx_without_a_retry(serve: Any) -> None:
    wrong = {"error": {"message": "bad logprobs", "type": "BadRequestError", "code": 400}}
    first, second = FakeEngine([(500, wrong)]), FakeEngine([(200, ANSWER)])
    walk = build(fleet({"big": [await serve(first), await serve(second)]}))
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 400 and not second.seen  # wrong everywhere: no other endpoint, no fallback
    assert walk.admission.ends() == {"big-1": ["release"]}
    await walk.upstream.close()


async def test_two_crashes_end_the_walk_and_tell_the_client_not_to_retry(serve: Any) -> None:
    crash = {"error": {"message": "CUDA error", "type": "InternalServerError"}}
    first, second = FakeEngine([(500, crash)]), FakeEngine([(500, crash)])
    walk = build(fleet({"big": [await serve(first), await serve(second)]}))
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 502 and response.headers.get("x-should-retry") == "false"
    assert len(first.seen) == len(second.seen) == 1  # once more on another replica, then no further
    assert body_json(response)["error"]["message"].startswith("The engine serving 'big' failed on this request")
    await walk.upstream.close()


async def test_route_metrics_observe_each_attempt_and_the_retry(serve: Any) -> None:
    metrics = GatewayMetrics()
    busy = FakeEngine([(503, {"error": {"message": "overloaded"}})])
    ready = FakeEngine([(200, ANSWER)])
    walk = build(fleet({"big": [await serve(busy), await serve(ready)]}), hooks=[RouteMetrics(metrics)])
    engine = walk.director.transport
    assert isinstance(engine, EngineTransport)
    engine.metrics = metrics  # the engine transport counts its failures before the first byte
    assert (await walk.director.handle(chat_request(), "chat")).status == 200
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }

    def total(name: str) -> float:
        return sum(v for (n, _labels), v in samples.items() if n == name)

    assert total("tokenway_routing_decisions_total") == 2  # one per committed attempt
    assert total("tokenway_upstream_retries_total") == 1
    assert total("tokenway_upstream_errors_total") == 1
    await walk.upstream.close()
