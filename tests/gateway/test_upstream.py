"""The upstream HTTP/1.1 client against scripted servers on real sockets: framing (Content-Length,
chunked split anywhere, read-until-close, interim 1xx), keep-alive reuse and its limits, the silent
retry on a connection the server closed while idle, timeouts, malformed answers, back-pressure.
Every test runs on asyncio's loop and on uvloop (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.upstream.client import CallWatch, UpstreamClient, UpstreamConnectionError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@dataclass
class Server:
    """A raw TCP server running `script` once per request; counts connections and keeps requests."""

    script: Script
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                self.requests.append(head + await reader.readexactly(length))
                await self.script(reader, writer, self)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> Server:
        state = Server(script)
        server = await asyncio.start_server(state.handle, "127.0.0.1", 0)
        servers.append(server)
        state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        return state

    yield start
    for server in servers:
        server.close()


def fixed(answer: bytes, *, close: bool = False) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(answer)
        await writer.drain()
        if close:
            writer.close()

    return script


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
BODY = b'{"model":"m"}'


async def post(client: UpstreamClient, url: str) -> tuple[int, bytes]:
    response = await client.post(url, {"Content-Type": "application/json", "x-request-id": "r1"}, BODY)
    async with response:
        return response.status, await response.read()


async def test_content_length_answer_and_keep_alive_reuse(serve: Callable[[Script], Awaitable[Server]]) -> None:
    server = await serve(fixed(OK))
    async with UpstreamClient() as client:
        for _ in range(3):
            assert await post(client, server.url) == (200, b'{"ok":true}')
        assert client.idle_connections() == 1
    assert server.connections == 1  # one connection carried all three
    sent = server.requests[0]
    assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 13\r\n" in sent and b"\r\nx-request-id: r1\r\n" in sent
    assert sent.endswith(b"\r\n\r\n" + BODY)


async def test_a_large_body_goes_out_whole_after_its_head(serve: Callable[[Script], Awaitable[Server]]) -> None:
    # a body above the join size is written beside its head rather than copied into one buffer
    server = await serve(fixed(OK))
    body = b'{"prompt":"' + b"x" * 300_000 + b'"}'
    async with UpstreamClient() as client:
        response = await client.post(server.url, {"Content-Type": "application/json"}, body)
        async with response:
            assert (response.status, await response.read()) == (200, b'{"ok":true}')
    sent = server.requests[0]
    assert f"\r\nContent-Length: {len(body)}\r\n".encode() in sent
    assert sent.endswith(b"\r\n\r\n" + body)


async def test_chunked_answer_split_anywhere(serve: Callable[[Script], Awaitable[Server]]) -> None:
    events = [b'data: {"a":1}\n\n', b'data: {"b":22}\n\n', b"data: [DONE]\n\n"]
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for event in events:
        wire += f"{len(event):x};ext=1\r\n".encode() + event + b"\r\n"
    wire += b"0\r\nX-Trailer: t\r\n\r\n"

    async def byte_by_byte(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        for i in range(len(wire)):
            writer.write(wire[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)

    server = await serve(byte_by_byte)
    async with UpstreamClient() as client:
        response = await client.post(server.url, {}, BODY)
        got = b""
        while piece := await response.next_chunk():
            got += piece
        response.release()
        assert got == b"".join(events)
        assert client.idle_connections() == 1  # the terminating chunk and trailers were consumed
        assert await post(client, server.url) == (200, b"".join(events))
    assert server.connections == 1


async def test_read_until_close_and_connection_close_are_not_reused(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    until_close = await serve(fixed(b"HTTP/1.1 200 OK\r\n\r\nall of it", close=True))
    told_close = await serve(fixed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"))
    async with UpstreamClient() as client:
        assert await post(client, until_close.url) == (200, b"all of it")
        assert await post(client, told_close.url) == (200, b"ok")
        assert client.idle_connections() == 0


async def test_interim_100_is_skipped(serve: Callable[[Script], Awaitable[Server]]) -> None:
    server = await serve(fixed(b"HTTP/1.1 100 Continue\r\n\r\n" + OK))
    async with UpstreamClient() as client:
        assert await post(client, server.url) == (200, b'{"ok":true}')


async def test_connection_closed_while_idle_is_retried_on_a_fresh_one(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    # keep-alive promised, then the server closes after every answer (as an engine's idle timeout does)
    server = await serve(fixed(OK, close=True))
    async with UpstreamClient() as client:
        assert await post(client, server.url) == (200, b'{"ok":true}')
        await asyncio.sleep(0.05)
        assert await post(client, server.url) == (200, b'{"ok":true}')
    assert server.connections == 2


async def test_reused_connection_that_dies_before_answering_is_retried(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    answered: set[int] = set()

    async def once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        if id(writer) in answered:
            writer.close()  # the request reached a connection that is going away: nothing ran
            return
        answered.add(id(writer))
        writer.write(OK)

    server = await serve(once_per_connection)
    async with UpstreamClient() as client:
        assert await post(client, server.url) == (200, b'{"ok":true}')
        assert await post(client, server.url) == (200, b'{"ok":true}')
    assert server.connections == 2 and len(server.requests) == 3


async def test_fresh_connection_closed_without_answer_raises(serve: Callable[[Script], Awaitable[Server]]) -> None:
    server = await serve(fixed(b"", close=True))
    async with UpstreamClient() as client:
        with pytest.raises(UpstreamConnectionError):
            await post(client, server.url)
    assert server.connections == 1  # a fresh connection is not retried (only a reused one is)


async def test_connection_refused(serve: Callable[[Script], Awaitable[Server]]) -> None:
    from tests.support.procs import free_port

    async with UpstreamClient() as client:
        with pytest.raises(UpstreamConnectionError, match="cannot connect"):
            await post(client, f"http://127.0.0.1:{free_port()}/v1/x")


@pytest.mark.slow
async def test_silence_longer_than_read_timeout(serve: Callable[[Script], Awaitable[Server]]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await reader.read()  # wait for the client to give up

    async def stalls_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await reader.read()

    no_head, no_body = await serve(silent), await serve(stalls_mid_body)
    async with UpstreamClient(read_timeout_s=0.2) as client:
        with pytest.raises(TimeoutError):
            await post(client, no_head.url)
        with pytest.raises(TimeoutError):
            await post(client, no_body.url)
        assert client.idle_connections() == 0
    await asyncio.wait_for(no_head.eof_seen.wait(), 5)  # the timed-out connection was dropped


async def test_a_watched_call_is_cut_at_once_wherever_it_waits(serve: Callable[[Script], Awaitable[Server]]) -> None:
    """A frozen engine accepts connections and answers nothing: the stall watch's cut (or a first-token
    deadline) ends the call at once, drops the connection (the engine aborts the request when it runs
    again) and is not retried on a fresh connection as an idle pooled one would be."""
    answered = 0

    async def freezes_after_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        nonlocal answered
        answered += 1
        if answered == 1:
            writer.write(OK)
            await writer.drain()
        else:
            await reader.read()  # frozen: never answers, sees the disconnect

    async def stalls_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await reader.read()

    frozen, mid_body = await serve(freezes_after_one), await serve(stalls_mid_body)
    async with UpstreamClient(read_timeout_s=60) as client:
        assert await post(client, frozen.url) == (200, b'{"ok":true}')  # its connection is pooled now
        watch = CallWatch("e", stream=True)
        asyncio.get_running_loop().call_later(0.05, watch.cut, "stalled")
        with pytest.raises(UpstreamConnectionError):
            await client.post(frozen.url, {}, BODY, watch)
        assert (watch.reason, frozen.connections) == ("stalled", 1)  # not retried on a fresh connection
        await asyncio.wait_for(frozen.eof_seen.wait(), 5)

        deadline = CallWatch("e", stream=True)
        deadline.arm(0.05, "first-token deadline")
        response = await client.post(mid_body.url, {}, BODY, deadline)
        assert deadline.last_byte_s > 0.0  # the head came: a sign of life
        with pytest.raises(UpstreamConnectionError):
            await response.read()
        assert deadline.reason == "first-token deadline"

        early = CallWatch("e", stream=False)
        early.cut("stalled")  # cut before it had a connection
        with pytest.raises(UpstreamConnectionError):
            await client.post(mid_body.url, {}, BODY, early)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"SMTP ready\r\n\r\n", id="not-http"),
        pytest.param(b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", id="bad-header"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", id="bad-length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", id="bad-chunk"),
        pytest.param(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, id="head-too-large"),
    ],
)
async def test_malformed_answers_raise(serve: Callable[[Script], Awaitable[Server]], answer: bytes) -> None:
    server = await serve(fixed(answer))
    async with UpstreamClient(read_timeout_s=5) as client:
        with pytest.raises(UpstreamConnectionError):
            await post(client, server.url)
        assert client.idle_connections() == 0


@pytest.mark.slow
async def test_large_body_with_back_pressure(serve: Callable[[Script], Awaitable[Server]]) -> None:
    body = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: reading pauses above 1 MiB buffered

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 65536):
            writer.write(body[i : i + 65536])
            await writer.drain()

    server = await serve(big)
    async with UpstreamClient() as client:
        response = await client.post(server.url, {}, BODY)
        await asyncio.sleep(0.2)  # let the server fill the buffer past the pause mark
        got = bytearray()
        while piece := await response.next_chunk():
            got += piece
        response.release()
        assert bytes(got) == body
        assert client.idle_connections() == 1
        assert await post(client, server.url) == (200, body)  # read() whole: takes as it goes


async def test_a_whole_answer_past_the_bound_is_refused_and_its_connection_dropped(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    """An engine's answer is input: `read` takes at most `max_answer_bytes`, then drops the connection
    (never back to the pool) and raises, a 502 to the client rather than memory without bound."""
    body = b"x" * 300_000

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    server = await serve(big)
    async with UpstreamClient(max_answer_bytes=100_000) as client:
        with pytest.raises(UpstreamConnectionError, match="passed 100000 bytes"):
            await post(client, server.url)
        assert client.idle_connections() == 0
    async with UpstreamClient(max_answer_bytes=len(body)) as client:
        assert await post(client, server.url) == (200, body)  # up to the bound: whole


async def test_close_mid_body_drops_the_connection(serve: Callable[[Script], Awaitable[Server]]) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    server = await serve(endless)
    async with UpstreamClient() as client:
        response = await client.post(server.url, {}, BODY)
        assert (await response.next_chunk()).startswith(b"hello")
        response.close()
        await asyncio.wait_for(server.eof_seen.wait(), 5)
        assert client.idle_connections() == 0


@pytest.mark.slow
async def test_idle_limits(serve: Callable[[Script], Awaitable[Server]]) -> None:
    async def slow_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await asyncio.sleep(0.05)
        writer.write(OK)

    server = await serve(slow_ok)
    async with UpstreamClient(max_idle_per_origin=1, idle_timeout_s=0.1) as client:
        await asyncio.gather(post(client, server.url), post(client, server.url))
        assert server.connections == 2 and client.idle_connections() == 1  # the second one was closed
        await asyncio.sleep(0.2)  # older than the idle timeout: not reused
        await post(client, server.url)
        assert server.connections == 3


async def test_header_bytes_pass_through(serve: Callable[[Script], Awaitable[Server]]) -> None:
    server = await serve(fixed(OK))
    async with UpstreamClient() as client:
        response = await client.post(server.url, {"x-request-id": "café-\udcff"}, BODY)
        response.release()
    assert b"\r\nx-request-id: caf\xc3\xa9-\xff\r\n" in server.requests[0]


async def test_bad_urls_and_headers() -> None:
    async with UpstreamClient() as client:
        with pytest.raises(ValueError, match="not an http"):
            await client.post("ftp://example.org/x", {}, b"")
        with pytest.raises(ValueError, match="line break"):
            await client.post("http://127.0.0.1:1/x", {"x-request-id": "a\r\nInjected: 1"}, b"")
        with pytest.raises(ValueError, match="line break"):
            await client.post("http://127.0.0.1:1/x", {"x-request-id": "a", "x-a\nb": "1"}, b"")
