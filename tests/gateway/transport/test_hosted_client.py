"""Which HTTP client carries a hosted provider's calls (transport/hosted.py): the engine client when no
proxy applies to the endpoint's host, aiohttp's through the proxy the environment names, decided once at
start; and answers a provider compressed although nothing asked for it, inflated. Real sockets: the
Anthropic stand-in process, a forward proxy on loopback, an aiohttp server that compresses."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.fleet import Fleet
from backends.types import Endpoint
from gateway.transport.hosted import HostedCalls, aiohttp_proxy, proxy_for
from gateway.upstream.client import UpstreamConnectionError
from tests.backends.builders import pool
from tests.sim.hosted.standin import StandIn, standin
from tests.support.http_proxy import forward_proxy

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
CHAT: dict[str, Any] = {"model": "claude", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment naming no proxy (either case), and the stand-in's key."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setenv("TW_TEST_ANTHROPIC_KEY", "test-key")
    return monkeypatch


@pytest.fixture
def anthropic_standin() -> Iterator[StandIn]:
    with standin("anthropic") as running:
        yield running


def calls_to(url: str) -> tuple[HostedCalls, Endpoint]:
    config = pool(
        name="claude",
        model="claude",
        engine="anthropic",
        served_model_name="claude-sonnet-4-5",
        api_key_env="TW_TEST_ANTHROPIC_KEY",
        endpoints=[{"url": url}],
    )
    fleet = Fleet.from_configs([config])
    return HostedCalls(fleet, connect_timeout_s=5.0, read_timeout_s=30.0), fleet.pools["claude"].endpoints[0]


async def ask(calls: HostedCalls, endpoint: Endpoint, **extra: Any) -> tuple[int, bytes]:
    url, headers, body, _ = calls.prepare(endpoint, {**CHAT, **extra}, "req-1", "claude")
    async with await calls.post(url, headers, body) as response:
        return response.status, await response.read()


def test_the_proxy_follows_urllib_rules_scheme_then_all_then_no_proxy(no_proxies: pytest.MonkeyPatch) -> None:
    assert proxy_for("https://api.anthropic.com") is None
    no_proxies.setenv("ALL_PROXY", "http://all.example:3128")
    assert proxy_for("https://api.anthropic.com") == "http://all.example:3128"
    no_proxies.setenv("HTTPS_PROXY", "http://tls.example:3128")
    assert proxy_for("https://api.anthropic.com") == "http://tls.example:3128"
    assert proxy_for("http://127.0.0.1:9000") == "http://all.example:3128"  # no http_proxy: all_proxy
    no_proxies.setenv("NO_PROXY", "anthropic.com,127.0.0.1")
    assert proxy_for("https://api.anthropic.com") is None  # a suffix of the host
    assert proxy_for("http://127.0.0.1:9000") is None
    assert proxy_for("https://generativelanguage.googleapis.com") == "http://tls.example:3128"


@pytest.mark.e2e  # starts a stand-in and a proxy
async def test_direct_calls_skip_the_proxy_and_proxied_ones_go_through_it(
    no_proxies: pytest.MonkeyPatch, anthropic_standin: StandIn
) -> None:
    async with forward_proxy() as proxy:
        # no proxy for the host (NO_PROXY names it): the engine client, straight to the provider
        no_proxies.setenv("HTTP_PROXY", proxy.url)
        no_proxies.setenv("NO_PROXY", "127.0.0.1")
        calls, endpoint = calls_to(anthropic_standin.url)
        await calls.start()
        try:
            assert not calls.proxied(endpoint.id)
            status, body = await ask(calls, endpoint)
            assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"]
            status, body = await ask(calls, endpoint, stream=True)  # Anthropic's SSE, chunked
            assert status == 200 and body.endswith(b"data: [DONE]\n\n") and b'"usage":{' in body
        finally:
            await calls.close()
        assert proxy.targets == []
        # the proxy applies: aiohttp's client through it, decided at start
        no_proxies.delenv("NO_PROXY")
        calls, endpoint = calls_to(anthropic_standin.url)
        await calls.start()
        try:
            assert calls.proxied(endpoint.id)
            status, body = await ask(calls, endpoint)
            answer = orjson.loads(body)
            assert status == 200 and answer["model"] == "claude" and answer["usage"]["prompt_tokens"] > 0
        finally:
            await calls.close()
        assert proxy.targets == [anthropic_standin.url + "/v1/messages"]
        # only ALL_PROXY (which aiohttp's own environment lookup ignores): still through the proxy
        no_proxies.delenv("HTTP_PROXY")
        no_proxies.setenv("ALL_PROXY", proxy.url)
        calls, endpoint = calls_to(anthropic_standin.url)
        await calls.start()
        try:
            assert calls.proxied(endpoint.id)
            status, body = await ask(calls, endpoint, stream=True)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        finally:
            await calls.close()
        assert len(proxy.targets) == 2


def test_a_proxy_aiohttp_cannot_speak_leaves_the_call_direct_and_credentials_become_a_header(
    no_proxies: pytest.MonkeyPatch,
) -> None:
    assert aiohttp_proxy("https://api.anthropic.com", "socks5://127.0.0.1:1080") == (None, None)
    no_proxies.setenv("HTTPS_PROXY", "http://user:secret@proxy.example:3128")
    url, headers = aiohttp_proxy("https://api.anthropic.com", "http://user:secret@proxy.example:3128")
    assert str(url) == "http://proxy.example:3128"
    assert headers == {"Proxy-Authorization": "Basic dXNlcjpzZWNyZXQ="}


MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "Hello"}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 3, "output_tokens": 1},
}
EVENTS = [
    {"type": "message_start", "message": {**MESSAGE, "content": [], "usage": {"input_tokens": 3, "output_tokens": 0}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
    {"type": "message_stop"},
]


ASKED: web.AppKey[list[str | None]] = web.AppKey("asked", list)


async def compressing(request: web.Request) -> web.StreamResponse:
    """Anthropic's answers gzip-compressed whatever the call's accept-encoding (a CDN's doing)."""
    request.app[ASKED].append(request.headers.get("accept-encoding"))
    chat = await request.json()
    if not chat.get("stream"):
        return web.Response(
            body=gzip.compress(orjson.dumps(MESSAGE)),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "content-encoding": "gzip"})
    await response.prepare(request)
    stream = gzip.compress(b"".join(b"event: e\ndata: " + orjson.dumps(e) + b"\n\n" for e in EVENTS))
    for i in range(0, len(stream), 7):  # chunked, split anywhere
        await response.write(stream[i : i + 7])
    await response.write_eof()
    return response


@pytest.fixture
async def compressing_server() -> AsyncIterator[tuple[str, list[str | None]]]:
    app = web.Application()
    app[ASKED] = []
    app.router.add_post("/v1/messages", compressing)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), app[ASKED]
    await server.close()


async def test_a_compressed_answer_and_stream_are_inflated_once_whichever_client(
    no_proxies: pytest.MonkeyPatch, compressing_server: tuple[str, list[str | None]]
) -> None:
    url, asked = compressing_server
    async with forward_proxy() as proxy:
        for proxied in (False, True):
            if proxied:
                no_proxies.setenv("HTTP_PROXY", proxy.url)
            calls, endpoint = calls_to(url)
            await calls.start()
            try:
                assert calls.proxied(endpoint.id) is proxied
                status, body = await ask(calls, endpoint)
                answer = orjson.loads(body)
                assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello"
                status, body = await ask(calls, endpoint, stream=True)
                chunks = [orjson.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
                assert status == 200 and body.endswith(b"data: [DONE]\n\n")
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                assert text == "Hello" and chunks[-1]["usage"]["completion_tokens"] == 1
            finally:
                await calls.close()
        assert proxy.targets  # the second round went through the proxy
    assert asked[:2] == [None, None]  # the engine client asks for no compression (aiohttp does, and inflates)


ODD_ANSWERS: list[bytes] = [  # Messages answers that are not Anthropic's documented shape
    b'{"type": "message", "usage": [1], "content": []}',
    b'{"type": "message", "usage": 7, "content": "text"}',
    b"null",
]
ODD_EVENTS: list[bytes] = [  # Messages streams that are not
    b"event: message_start\ndata: [1]\n\n",
    b"event: message_start\ndata: \n\n",
    b'event: message_start\ndata: {"type": "message_start", "message": {"usage": [1]}}\n\n',
]


@pytest.mark.parametrize("odd", range(3))
async def test_an_answer_not_in_the_providers_shape_is_a_502_and_a_cut_stream(
    no_proxies: pytest.MonkeyPatch, odd: int
) -> None:
    """A provider's answer the codec cannot read is the provider's failure: a 502 in OpenAI's shape
    (a stream: cut, which the relay reports), never an exception out of the transport."""

    async def answer(request: web.Request) -> web.Response:
        stream = (await request.json()).get("stream")
        body = ODD_EVENTS[odd] if stream else ODD_ANSWERS[odd]
        return web.Response(body=body, content_type="text/event-stream" if stream else "application/json")

    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    calls, endpoint = calls_to(str(server.make_url("")).rstrip("/"))
    await calls.start()
    try:
        status, body = await ask(calls, endpoint)
        assert status == 502 and b"unreadable provider answer" in body
        with pytest.raises(UpstreamConnectionError, match="unreadable provider stream"):
            await ask(calls, endpoint, stream=True)
    finally:
        await calls.close()
        await server.close()
