"""One keep-alive HTTP/1.1 connection to an engine, as an asyncio protocol: it parses one response
at a time (status line, headers, then a Content-Length, chunked or read-until-close body) and hands
the body over as it arrives, pausing the socket while the consumer is behind. `gateway/upstream/client.py`
pools these connections, and says why the gateway speaks HTTP/1.1 itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

MAX_HEAD_BYTES = 64 * 1024
PAUSE_ABOVE_BYTES = 1 << 20  # stop reading the socket while this much body waits for the consumer


class UpstreamConnectionError(ConnectionError):
    """The engine could not be reached, went away, or answered something that is not HTTP/1.x."""


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
