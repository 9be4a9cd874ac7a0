"""The upstream HTTP/1.1 client: pooled keep-alive connections to the engines, one POST at a time each.

Why not aiohttp's client: it spent ~115 µs of CPU per call in the overhead benchmark (a third of
tokenway's whole per-request cost), most of it in machinery the relay never uses (cookie jars,
redirects, tracing hooks, multidict headers, stream readers). Every upstream call here is the same
shape, a POST with a JSON body to a known engine, answered with a JSON body (Content-Length) or an
SSE stream (chunked), so a protocol that parses exactly that costs ~12 µs and removes a loop
hand-off or two from every request's latency.

What it does: keep-alive pools per host (LIFO, bounded, idle connections dropped before the engine's
own keep-alive timeout would close them), connect and read (max silence) timeouts, Content-Length,
chunked and read-until-close bodies, back-pressure (reading pauses while the consumer is behind), TLS
for https endpoints, and one transparent retry on a fresh connection when a reused one turns out to be
closed before any byte of the answer arrived (the engine closed it while it sat idle; nothing ran).
`close()` on a response drops its connection, which is how the engine learns the client went away.

A call may carry a `CallWatch`: the walk's handle on it while it runs, so that an engine that stops
answering (`gateway/upstream/replica_loss.py`) can be cut at once, whether the call waits for the answer's head or
reads its body, and so that the bytes the engine last sent show it alive.

Connections
-----------

One keep-alive HTTP/1.1 connection to an engine, as an asyncio protocol: it parses one response
at a time (status line, headers, then a Content-Length, chunked or read-until-close body) and hands
the body over as it arrives, pausing the socket while the consumer is behind. The client
above pools these connections (why the gateway speaks HTTP/1.1 itself: above).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from typing import NamedTuple, Protocol, cast
from urllib.parse import urlsplit

from backends.types import GATEWAY_EXHAUSTED

# ---- One connection

MAX_HEAD_BYTES = 64 * 1024
PAUSE_ABOVE_BYTES = 1 << 20  # stop reading the socket while this much body waits for the consumer


# The most a whole (not streamed) answer may hold: far past any chat or completions answer, and room for
# an embeddings answer of thousands of long vectors; an engine's answer is input, so it is bounded.
MAX_ANSWER_BYTES = 256 << 20


class UpstreamConnectionError(ConnectionError):
    """The engine could not be reached, went away, or answered something that is not HTTP/1.x."""


class GatewayExhausted(UpstreamConnectionError):
    """The gateway itself lacks what a connection needs (file descriptors, socket buffers, memory):
    no engine failed, and every other endpoint would fail the same way."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time and hands its body to `Response`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.used = False  # has carried a response before (a reused connection)
        self.last_data_s = 0.0  # monotonic time bytes last arrived (the stall watch's sign of life)
        self.reset()

    def reset(self) -> None:
        self._head = bytearray()
        self._in_head = True
        self._body_left = 0  # Content-Length bytes, or the current chunk's bytes still to read
        self._chunked = False
        self._chunk_state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self._line = bytearray()
        self._until_close = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.got_bytes = False
        self.head_done: asyncio.Future[None] | None = None
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.done = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._in_head or not self.done:
            if self._until_close and not self._in_head and exc is None:
                self._finish()  # a body without length ends with the connection (a reset truncates it)
            else:
                self._fail(UpstreamConnectionError(f"the upstream closed the connection ({exc or 'EOF'})"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data_s = time.monotonic()
        try:
            self._feed(data)
        except UpstreamConnectionError as exc:
            self._fail(exc)
            self.abort()

    def _feed(self, data: bytes) -> None:
        while self._in_head:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD_BYTES:
                    raise UpstreamConnectionError("the upstream's response head is too large")
                return
            head, data = bytes(self._head[:end]), bytes(self._head[end + 4 :])
            self._head = bytearray()
            self._parse_head(head)  # a 1xx interim head leaves us in the head state
            if self.done or not data:
                return
        self._body(data)

    # -- parsing
    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
            raise UpstreamConnectionError(f"the upstream answered a malformed status line {lines[0][:80]!r}")
        self.status = int(status_line[1])
        if status_line[0] == b"HTTP/1.0":
            self.keep_alive = False
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise UpstreamConnectionError("the upstream answered a malformed header line")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if headers.get("connection", "").lower() == "close":
            self.keep_alive = False
        if 100 <= self.status < 200 and self.status != 101:  # interim answer: the real head follows
            waiter = self.head_done
            self.reset()
            self.head_done, self.got_bytes = waiter, True
            return
        self._in_head = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._body_left = int(headers["content-length"])
            except ValueError:
                raise UpstreamConnectionError("the upstream answered a malformed Content-Length") from None
            if self._body_left == 0 or self.status in (204, 304):
                self._finish()
        elif self.status in (204, 304):
            self._finish()
        else:
            self._until_close = True
            self.keep_alive = False
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_result(None)

    def _body(self, data: bytes) -> None:
        if self.done:
            return  # bytes after a complete response: not ours to read (the connection is dropped)
        if self._chunked:
            self._dechunk(data)
        elif self._until_close:
            self._deliver(data)
        else:
            take = data[: self._body_left]
            self._body_left -= len(take)
            self._deliver(take)
            if self._body_left <= 0:
                if len(data) > len(take):
                    self.keep_alive = False  # more bytes than promised: the stream is out of step
                self._finish()

    def _dechunk(self, data: bytes) -> None:
        view = memoryview(data)
        i, n = 0, len(data)
        out: list[bytes] = []
        while i < n and not self.done:
            state = self._chunk_state
            if state == 1:
                take = min(self._body_left, n - i)
                out.append(bytes(view[i : i + take]))
                i += take
                self._body_left -= take
                if self._body_left == 0:
                    self._chunk_state = 2
                continue
            end = data.find(b"\n", i)
            if end < 0:
                self._line += view[i:]
                if len(self._line) > 4096:
                    raise UpstreamConnectionError("the upstream's chunk framing is malformed")
                break
            line = bytes(self._line) + data[i:end] if self._line else data[i:end]
            self._line = bytearray()
            i = end + 1
            line = line.rstrip(b"\r")
            if state == 0:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamConnectionError("the upstream's chunk framing is malformed") from None
                if size == 0:
                    self._chunk_state = 3
                else:
                    self._body_left, self._chunk_state = size, 1
            elif state == 2:
                if line:
                    raise UpstreamConnectionError("the upstream's chunk framing is malformed")
                self._chunk_state = 0
            elif not line:  # state 3: the blank line that ends the trailers
                if out:
                    self._deliver(b"".join(out))
                    out = []
                self._finish()
        if out:
            self._deliver(b"".join(out))

    def _deliver(self, piece: bytes) -> None:
        if not piece:
            return
        self.pieces.append(piece)
        self.buffered += len(piece)
        if self.buffered > PAUSE_ABOVE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self.done:
            self.error = exc
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(None)

    # -- used by Response
    def take(self) -> bytes:
        pieces = self.pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self.pieces = []
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout_s: float | None) -> None:
        """Until more body, the end of it, or an error; TimeoutError after `timeout_s` of silence."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout_s, expire, waiter) if timeout_s else None
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None

    def send(self, request: bytes | tuple[bytes, bytes]) -> None:
        assert self.transport is not None
        self.used = True
        self.head_done = self._loop.create_future()
        if isinstance(request, tuple):
            self.transport.writelines(request)
        else:
            self.transport.write(request)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        return self.done and self.error is None and self.keep_alive and not self.closed and not self.pieces


def expire(waiter: asyncio.Future[None]) -> None:
    """Fails a wait on the upstream with the read timeout's TimeoutError."""
    if not waiter.done():
        waiter.set_exception(TimeoutError("the upstream was silent for longer than the read timeout"))


# ---- The pooled client


class _Origin(NamedTuple):  # the idle pool's key on every request: a tuple's hash and equality are C's
    scheme: str
    host: str
    port: int


def _parse_url(url: str) -> tuple[_Origin, bytes]:
    """The URL's origin, and the request's first bytes up to the Content-Length value (computed once
    per URL: the endpoints are few and fixed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    origin = _Origin(parts.scheme, parts.hostname, parts.port or default)
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    host_header = host if origin.port == default else f"{host}:{origin.port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return origin, f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\nContent-Length: ".encode()


class Abortable(Protocol):
    """What a watch cuts: the engine client's `Connection`, or a hosted call over another client
    (gateway/transport/hosted.py) that keeps the same two promises."""

    @property
    def last_data_s(self) -> float: ...

    def abort(self) -> None: ...


class CallWatch:
    """One upstream call as the stall watch sees it: when it began, when its connection last received
    bytes, and `cut` to drop it now (the engine sees the disconnect and aborts the request; the caller
    sees `UpstreamConnectionError`). `reason` says why it was cut ("" while it was not)."""

    __slots__ = ("_conn", "_timer", "endpoint_id", "reason", "started_s", "stream")

    def __init__(self, endpoint_id: str, *, stream: bool, now_s: float | None = None) -> None:
        self.endpoint_id = endpoint_id
        self.stream = stream  # a stream shows tokens as they come; a non-streamed call only its end
        self.started_s = time.monotonic() if now_s is None else now_s
        self.reason = ""
        self._conn: Abortable | None = None
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, seconds: float, reason: str) -> None:
        """Cut the call after `seconds` unless `disarm` comes first (a first-token deadline)."""
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self.cut, reason)

    @property
    def armed(self) -> bool:
        """Whether a deadline was set (the relay then shows the client nothing before the first token)."""
        return self._timer is not None

    def disarm(self) -> None:
        """The deadline no longer applies (the first token came, or the call ended)."""
        if self._timer is not None:
            self._timer.cancel()

    @property
    def last_byte_s(self) -> float:
        """Monotonic time its connection last received bytes (0.0: none yet)."""
        return self._conn.last_data_s if self._conn is not None else 0.0

    def attach(self, conn: Abortable) -> None:
        self._conn = conn
        if self.reason:
            conn.abort()  # cut before it had a connection

    def cut(self, reason: str) -> None:
        """Drop the call now (idempotent: the first reason stays)."""
        if self.reason:
            return
        self.reason = reason
        if self._conn is not None:
            self._conn.abort()


class Response:
    """One upstream answer. Read it whole (`read`) or piece by piece (`next_chunk`), then `release`
    it (the connection goes back to the pool if the body was read to the end) or `close` it."""

    __slots__ = ("_client", "_conn", "_ended", "_origin", "_read_timeout_s", "headers", "status")

    def __init__(self, conn: Connection, client: UpstreamClient, origin: _Origin, read_timeout_s: float | None):
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers
        self._conn = conn
        self._client = client
        self._origin = origin
        self._read_timeout_s = read_timeout_s
        self._ended = False

    async def read(self) -> bytes:
        """The whole body (taken as it arrives, so that reading never stays paused), at most the client's
        `max_answer_bytes`: an engine's answer is input, and one past it drops the connection and raises
        UpstreamConnectionError (a 502), rather than holding memory without bound."""
        conn = self._conn
        parts: list[bytes] = []
        size, limit = 0, self._client.max_answer_bytes
        while True:
            if conn.pieces:
                parts.append(conn.take())
                size += len(parts[-1])
                if size > limit:
                    self.close()
                    raise UpstreamConnectionError(f"the upstream's answer passed {limit} bytes")
            if conn.error is not None:
                raise conn.error
            if conn.done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await conn.wait(self._read_timeout_s)

    async def next_chunk(self) -> bytes:
        """The body as it arrives (already de-chunked): everything received since the last call, or
        b"" at its end."""
        conn = self._conn
        while True:
            if conn.pieces:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.done:
                return b""
            await conn.wait(self._read_timeout_s)

    def release(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._conn.reusable():
            self._client._put(self._origin, self._conn)
        else:
            self._conn.abort()

    def close(self) -> None:
        """Drop the connection now (the engine sees the disconnect and aborts the request)."""
        if not self._ended:
            self._ended = True
            self._conn.abort()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class UpstreamClient:
    """Keep-alive pools of `Connection` per origin; `post` sends one request and returns its head."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 256,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.read_timeout_s = read_timeout_s
        # below uvicorn's default keep-alive (5 s, what vLLM runs on): we drop it before the engine does
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[_Origin, list[Connection]] = {}
        self._urls: dict[str, tuple[_Origin, bytes]] = {}  # url -> _parse_url(url); bounded below
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def post(self, url: str, headers: Mapping[str, str], body: bytes, watch: CallWatch | None = None) -> Response:
        """Send a POST and wait for the answer's head. Raises UpstreamConnectionError or TimeoutError
        (or UpstreamConnectionError at once when `watch` was cut)."""
        if self._closed:
            raise UpstreamConnectionError("the upstream client is closed")
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            parsed = self._urls[url] = _parse_url(url)
        origin, start = parsed
        request = _request_bytes(start, headers, body)
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, origin, request, watch)
            except UpstreamConnectionError:
                if conn.got_bytes or (watch is not None and watch.reason):
                    raise
                # a pooled connection closed by the engine while idle: nothing ran, try a fresh one
        conn = await self._connect(origin)
        return await self._exchange(conn, origin, request, watch)

    async def _exchange(
        self, conn: Connection, origin: _Origin, request: bytes | tuple[bytes, bytes], watch: CallWatch | None = None
    ) -> Response:
        if watch is not None:
            watch.attach(conn)
            if watch.reason:
                raise UpstreamConnectionError(f"the call was cut: {watch.reason}")
        conn.send(request)
        assert conn.head_done is not None
        timer = self._loop_timer(conn.head_done)
        try:
            await conn.head_done
        except BaseException:
            conn.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Response(conn, self, origin, self.read_timeout_s)

    def _loop_timer(self, future: asyncio.Future[None]) -> asyncio.TimerHandle | None:
        if not self.read_timeout_s:
            return None
        return asyncio.get_running_loop().call_later(self.read_timeout_s, expire, future)

    async def _connect(self, origin: _Origin) -> Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if context else None,
                )
        except TimeoutError:
            raise UpstreamConnectionError(
                f"connecting to {origin.host}:{origin.port} took longer than {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            if exc.errno in GATEWAY_EXHAUSTED:
                raise GatewayExhausted(f"cannot open a connection to {origin.host}:{origin.port}: {exc}") from exc
            raise UpstreamConnectionError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return conn

    def _take(self, origin: _Origin) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        stale_before = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if conn.closed or conn.idle_since < stale_before or conn.transport is None or conn.transport.is_closing():
                conn.abort()
                continue
            conn.reset()
            return conn
        return None

    def _put(self, origin: _Origin, conn: Connection) -> None:
        if self._closed:
            conn.abort()
            return
        idle = self._idle.setdefault(origin, [])
        now = time.monotonic()
        stale_before = now - self.idle_timeout_s
        while idle and (idle[0].closed or idle[0].idle_since < stale_before):  # oldest first
            idle.pop(0).abort()
        if len(idle) >= self.max_idle_per_origin:
            conn.abort()
            return
        conn.idle_since = now
        idle.append(conn)

    def idle_connections(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()


# A body larger than this goes to the socket beside its head, not copied into one buffer with it.
_JOIN_UP_TO = 64 * 1024


def _request_bytes(start: bytes, headers: Mapping[str, str], body: bytes) -> bytes | tuple[bytes, bytes]:
    """The request's bytes: one buffer, or (head, body) for a large body (a long prompt is not
    copied again only to sit after its headers)."""
    lines = [f"{name}: {value}\r\n" for name, value in headers.items()]
    head = "".join(lines)
    # each line ends in the one CR LF written above: any other is a name's or a value's (two counts
    # in C instead of four `in` tests per header)
    if head.count("\r") != len(lines) or head.count("\n") != len(lines):
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} contains a line break")
    # the client's bytes as they came (aiohttp decodes header values as UTF-8, surrogate-escaped)
    parts = [start, str(len(body)).encode(), b"\r\n", head.encode("utf-8", "surrogateescape"), b"\r\n"]
    if len(body) > _JOIN_UP_TO:
        return b"".join(parts), body
    parts.append(body)
    return b"".join(parts)
