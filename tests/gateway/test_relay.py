"""The relay against a scripted upstream over real sockets: usage chunk handling, model swap,
errors before and after the first byte, and the upstream connection closing on client disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.types import InFlight
from gateway.upstream.client import CallWatch, UpstreamClient
from gateway.upstream.relay import (
    _ENGINE_NAMES,
    RelayOutcome,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTarget,
    carries_engine_fields,
    drop_engine_fields,
    relay_stream,
    relay_unary,
)

Script = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chunk(content: str | None = None, *, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    choices: list[dict[str, Any]] = []
    if usage is None:
        delta = {"content": content} if content is not None else {}
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
    doc = {"id": "c1", "object": "chat.completion.chunk", "model": "engine-name", "choices": choices, "usage": usage}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def normal_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    # deliberately split one event across two writes
    first = chunk("") + chunk("a")
    await response.write(first[:17])
    await response.write(first[17:])
    await response.write(chunk("b") + chunk("c", finish="length"))
    await response.write(chunk(usage=USAGE) + b"data: [DONE]\n\n")
    return response


async def broken_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("a"))
    assert request.transport is not None
    request.transport.close()
    return response


class Upstream:
    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.script: Script = normal_stream

    async def handler(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self.script(request)
        finally:
            if request.transport is None or request.transport.is_closing():
                self.closed.set()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    state = Upstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", state.handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield state, str(server.make_url("/v1/chat/completions"))
    await server.close()


def target(url: str, public: str = "public-name") -> UpstreamTarget:
    body = b'{"stream": true}'
    return UpstreamTarget(url=url, headers={}, body=body, served_model="engine-name", public_model=public)


async def relay_through(url: str, *, wants_usage: bool) -> tuple[bytes, RelayOutcome, InFlight]:
    """A one-route app that relays to `url`; returns what its client received."""
    outcome = RelayOutcome()
    inflight = InFlight()

    async def handler(request: web.Request) -> web.StreamResponse:
        async with UpstreamClient(read_timeout_s=10) as session:
            ticket = inflight.begin(5)
            try:
                await relay_stream(
                    session,
                    request,
                    target(url),
                    ticket,
                    outcome,
                    client_wants_usage=wants_usage,
                    response_headers=[("x-extra", "1")],
                    prompt_tokens=5,
                )
            finally:
                ticket.end()
        assert outcome.response is not None
        return outcome.response

    app = web.Application()
    app.router.add_post("/relay", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client, client.post(server.make_url("/relay")) as response:
            assert response.headers["x-extra"] == "1"
            body = await response.read()
    finally:
        await server.close()
    return body, outcome, inflight


@pytest.mark.parametrize(
    "wants_usage", [pytest.param(True, id="client-asked-usage"), pytest.param(False, id="client-did-not-ask")]
)
async def test_stream_relays_events_and_learns_usage(upstream: tuple[Upstream, str], wants_usage: bool) -> None:
    _, url = upstream
    body, outcome, inflight = await relay_through(url, wants_usage=wants_usage)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert outcome.usage is not None and outcome.usage.completion_tokens == 3
    assert (b'"usage":{' in body) is wants_usage
    assert b"engine-name" not in body and b'"model":"public-name"' in body
    assert outcome.first_token_at_s is not None
    assert outcome.counted_completion_tokens == 3  # a, b, c (the role chunk carries no output)
    assert inflight.requests == 0 and inflight.prefill_tokens == 0 and inflight.decode_tokens == 0


async def test_failure_after_first_byte_becomes_one_error_event(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream
    state.script = broken_stream
    body, outcome, _ = await relay_through(url, wants_usage=False)
    events = [e for e in body.split(b"\n\n") if e]
    assert outcome.broken
    error = orjson.loads(events[-1][len(b"data: ") :])
    assert error["error"]["code"] == "upstream_error"
    assert b"[DONE]" not in body


async def test_5xx_before_first_byte_is_retryable(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream

    async def overloaded(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text="busy")

    state.script = overloaded
    async with UpstreamClient(read_timeout_s=10) as session:
        with pytest.raises(RetryableUpstream) as caught:
            await relay_unary(session, target(url), InFlight().begin(0))
    assert caught.value.status == 503


async def test_connection_refused_is_retryable() -> None:
    from tests.support.procs import free_port

    async with UpstreamClient(read_timeout_s=10) as session:
        with pytest.raises(RetryableUpstream):
            await relay_unary(session, target(f"http://127.0.0.1:{free_port()}/v1/x"), InFlight().begin(0))


async def test_4xx_is_passed_on_not_retried(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream

    async def bad(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "too long", "type": "BadRequestError"}}, status=400)

    state.script = bad
    async with UpstreamClient(read_timeout_s=10) as session:
        with pytest.raises(UpstreamRejected) as caught:
            await relay_unary(session, target(url), InFlight().begin(0))
    assert caught.value.status == 400


async def test_unary_swaps_model_and_reads_usage(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"model": "engine-name", "choices": [], "usage": USAGE})

    state.script = answer
    inflight = InFlight()
    async with UpstreamClient(read_timeout_s=10) as session:
        outcome = await relay_unary(session, target(url), inflight.begin(5))
    assert outcome.usage is not None and outcome.usage.prompt_tokens == 5
    assert outcome.response is not None
    assert isinstance(outcome.response, web.Response) and outcome.response.body is not None
    assert orjson.loads(outcome.response.body)["model"] == "public-name"  # type: ignore[arg-type]


# vLLM's own fields, as vLLM 0.32 writes them (vllm/entrypoints/openai/chat_completion/protocol.py)
VLLM_UNARY = {
    "id": "c1",
    "object": "chat.completion",
    "model": "engine-name",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "reasoning": None},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
        }
    ],
    "usage": USAGE,
    "prompt_logprobs": None,
    "prompt_token_ids": [1, 2, 3],  # the client asked for them (vLLM's `return_token_ids`)
    "kv_transfer_params": None,
    "metrics": {"ttft_s": 0.1},
}


async def test_a_unary_answer_carries_only_what_the_client_asked_for(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(VLLM_UNARY)

    state.script = answer
    inflight = InFlight()
    async with UpstreamClient(read_timeout_s=10) as session:
        outcome = await relay_unary(session, target(url, public="engine-name"), inflight.begin(5))
    assert isinstance(outcome.response, web.Response) and outcome.response.body is not None
    sent = orjson.loads(outcome.response.body)  # type: ignore[arg-type]
    assert set(sent) == {"id", "object", "model", "choices", "usage", "prompt_token_ids", "metrics"}
    assert set(sent["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert sent["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert outcome.engine_metrics == {"ttft_s": 0.1}  # read before anything was taken out


def test_an_anthropic_messages_own_stop_reason_stays() -> None:
    # vLLM's native Messages answer (vllm/entrypoints/anthropic/protocol.py): `stop_reason` is Anthropic's
    message: dict[str, Any] = {"type": "message", "content": [], "stop_reason": "end_turn", "kv_transfer_params": None}
    assert drop_engine_fields(message) and message == {"type": "message", "content": [], "stop_reason": "end_turn"}
    responses: dict[str, Any] = {"object": "response", "output": [], "input_messages": None, "ec_transfer_params": None}
    assert drop_engine_fields(responses) and responses == {"object": "response", "output": []}
    assert not drop_engine_fields({"choices": "not a list"})


def test_an_event_is_looked_at_only_when_it_names_an_engine_field_as_a_key() -> None:
    event = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"stop_reason token_ids"}}]}'
    assert not carries_engine_fields(event)  # the names as words of the text, not as keys
    for name in _ENGINE_NAMES:
        quoted = f'"{name}"'.encode()
        assert carries_engine_fields(event[:20] + quoted + b":null," + event[20:]), name
        assert not carries_engine_fields(event[:20] + quoted[:-1] + b'x":null,' + event[20:]), name


async def test_a_streams_engine_fields_are_taken_out_of_its_events(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        last: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": "engine-name"}
        last["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]
        usage: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": "engine-name", "choices": []}
        usage |= {"usage": USAGE, "kv_transfer_params": {"remote": "x"}}
        await response.write(chunk("a") + b"data: " + orjson.dumps(last) + b"\n\n")
        await response.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return response

    state.script = stream
    body, outcome, _ = await relay_through(url, wants_usage=True)
    assert b"stop_reason" not in body and b"kv_transfer_params" not in body
    assert b'"finish_reason":"stop"' in body and body.endswith(b"data: [DONE]\n\n")
    assert outcome.kv_transfer_params == {"remote": "x"}  # the gateway read it before the client's copy lost it


async def test_client_disconnect_closes_the_upstream(upstream: tuple[Upstream, str]) -> None:
    state, url = upstream
    started = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("a"))
        started.set()
        for _ in range(500):
            await asyncio.sleep(0.01)
            await response.write(chunk("x"))
        return response

    state.script = slow
    outcome = RelayOutcome()

    async def handler(request: web.Request) -> web.StreamResponse:
        async with UpstreamClient(read_timeout_s=10) as session:
            await relay_stream(
                session,
                request,
                target(url),
                InFlight().begin(1),
                outcome,
                client_wants_usage=False,
                response_headers=[],
                prompt_tokens=1,
            )
        assert outcome.response is not None
        return outcome.response

    app = web.Application()
    app.router.add_post("/relay", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            response = await client.post(server.make_url("/relay"))
            await response.content.readany()
            await started.wait()
            response.close()  # the client goes away mid-stream
        await asyncio.wait_for(state.closed.wait(), 10)
    finally:
        await server.close()
    assert outcome.aborted


async def role_then_silence(request: web.Request) -> web.StreamResponse:
    """A replica that froze after its role chunk: no token ever comes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk(""))
    await asyncio.sleep(30)
    return response


@pytest.mark.slow
async def test_with_a_first_token_deadline_nothing_reaches_the_client_before_the_first_token(
    upstream: tuple[Upstream, str],
) -> None:
    """The role chunk is held back; when the deadline cuts the call first, the request is still
    movable (`RetryableUpstream`) and its client has seen nothing, not even the headers. A stream whose
    first token comes in time goes out whole, the held role chunk first."""
    state, url = upstream
    state.script = role_then_silence
    outcome, inflight = RelayOutcome(), InFlight()
    seen: list[BaseException] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        async with UpstreamClient(read_timeout_s=10) as session:
            ticket = inflight.begin(5)
            held = target(url)
            held.watch = CallWatch("e", stream=True)
            held.watch.arm(0.2, "first-token deadline")
            try:
                await relay_stream(
                    session, request, held, ticket, outcome,
                    client_wants_usage=False, response_headers=[], prompt_tokens=5,
                )  # fmt: skip
            except RetryableUpstream as exc:
                seen.append(exc)
                assert outcome.response is not None and not outcome.response.prepared
                return web.Response(status=599, text="moved")
            finally:
                ticket.end()
        assert outcome.response is not None
        return outcome.response

    app = web.Application()
    app.router.add_post("/relay", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client, client.post(server.make_url("/relay")) as response:
            assert (response.status, await response.text()) == (599, "moved")
        await asyncio.wait_for(state.closed.wait(), 5)  # the frozen replica's request was dropped
        assert len(seen) == 1

        state.script = normal_stream  # in time: the whole stream, the role chunk included
        outcome = RelayOutcome()
        async with aiohttp.ClientSession() as client, client.post(server.make_url("/relay")) as response:
            body = await response.read()
        assert body.count(b"data: ") == 5 and body.endswith(b"data: [DONE]\n\n")
        assert outcome.first_token_at_s is not None
    finally:
        await server.close()
