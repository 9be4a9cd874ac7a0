"""Answering clients that half-close, without serving clients that left.

A client may send its request and shut its write side (`shutdown(SHUT_WR)`: netcat, some proxies,
HTTP/1.1 allows it) and still wait for the answer. asyncio closes a transport on end-of-file unless
the protocol keeps it open, and aiohttp does not, so such a client was cancelled like one that had
gone away. But a FIN looks the same whether the peer only stopped sending or closed its socket; only
writing tells them apart (a closed socket answers with a reset). So on end-of-file during a request
the connection stays open and the gateway probes: an interim `100 Continue` (every HTTP/1.1 client
must accept 1xx responses before the final one; Python's http.client, curl, httpx, aiohttp skip
them), written again after short pauses while no byte of the answer has gone out. A peer that is
gone answers the first with a reset and the next write fails: the connection is lost, the handler
is cancelled as before (the engine aborts the request), about `PROBE_DELAYS_S[0]` late. A peer that
half-closed gets the probes and then its answer, and the connection closes after it. Once the answer
has started, its own writes are the probes (a stream's chunks). HTTP/1.0 clients get no 1xx: their
request simply runs to its end. End-of-file on an idle connection, or in the middle of a request
body, closes the connection as before.

Hooked in by `GatewayRunner` (an `AppRunner` whose connections use `AnsweringHandler`), which also
keeps aiohttp's server log for the gateway's faults: a client's malformed request (bad header bytes,
a body that is not the encoding it claims) is answered 400 and logged at debug level, not as an error
with a traceback that any client could flood the log with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from gateway.http.bodies import RAW_BODIES

PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
PROBE_DELAYS_S = (0.05, 0.2, 1.0, 3.0, 10.0)  # then every 30 s while the answer has not started
PROBE_EVERY_S = 30.0


class AnsweringHandler(RequestHandler):
    """aiohttp's connection handler, kept open on a half-close while a complete request is served."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probes_sent = 0
        self._probe_handle: asyncio.TimerHandle | None = None
        self._peer_shut = False  # end-of-file seen (uvloop may report it again when reading resumes)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._peer_shut:
            return True
        if self._idle():
            return None  # between requests: close as before
        request = self._current_request
        if request is not None and not request.content.is_eof():
            return None  # the client hung up in the middle of its request body
        self._peer_shut = True
        self.close()  # answer what came in, then close: nothing more will arrive
        self._probe()
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._probe_handle is not None:
            self._probe_handle.cancel()
            self._probe_handle = None
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """Waiting for the next request, with none received (aiohttp's loop parks on `_waiter`)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def _probe(self) -> None:
        self._probe_handle = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._idle():
            return
        request = self._current_request
        if request is not None:  # (None: received, its handler not started yet)
            if request._payload_writer.output_size:
                return  # the answer has started: its own writes find out whether anyone listens
            if request.version < HttpVersion11:
                return  # no 1xx for HTTP/1.0
            transport.write(PROBE)
        delay_s = PROBE_DELAYS_S[self._probes_sent] if self._probes_sent < len(PROBE_DELAYS_S) else PROBE_EVERY_S
        self._probes_sent += 1
        self._probe_handle = asyncio.get_running_loop().call_later(delay_s, self._probe)


class _AnsweringServer(web.Server):
    def __call__(self) -> RequestHandler:
        return AnsweringHandler(self, loop=self._loop, **self._kwargs)


class ClientFaults(logging.Filter):
    """Demote aiohttp's log records about a client's malformed request to debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError | RequestPayloadError) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_CLIENT_FAULTS = ClientFaults()


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer half-closed clients (module docstring). It also leaves
    `Content-Encoding` to the gateway's body reader (`gateway/http/bodies.py`), which decodes strictly
    (a truncated or doubled gzip body is a 400) and within the size limit; aiohttp's decoder accepts
    a truncated gzip stream and ignores what follows its first member."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs["auto_decompress"] = False
        app[RAW_BODIES] = True
        super().__init__(app, **kwargs)
        server_log = logging.getLogger("aiohttp.server")
        if _CLIENT_FAULTS not in server_log.filters:
            server_log.addFilter(_CLIENT_FAULTS)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _AnsweringServer  # the same server, handing out AnsweringHandler
        return server
