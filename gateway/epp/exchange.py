"""One ext_proc stream: one HTTP request and its response, as Envoy shows them to the picker.

    request_headers            FULL_DUPLEX_STREAMED: kept (answered once the body is complete);
                               BUFFERED: answered at once (Envoy sends the body only then)
    request_body ... eos       -> decide: Picked (FULL_DUPLEX_STREAMED: the headers response naming
    (or request_trailers)         the endpoint, then the body to send on; BUFFERED: one body
                                  response with the pick and, if the body changed, the new body and
                                  its content-length) or Refused (an immediate response: 4xx / 503)
    response_headers           -> the response headers (with tokenway's), status noted
    response_body ... eos      -> each chunk passed on as the follower returns it; at the end the
    (or response_trailers)        follower settles (usage, first token, load) exactly once
    the stream ends early      -> `close()` settles what was generated, exactly once

The body sent on is the walk's (`Picked.body`): the engine's model name, stream usage on, and the
engine-control fields as policy allows (a client's `kv_transfer_params` or `priority` dropped, the
tier's priority set), so a client cannot steer the engine through Envoy any more than through the
HTTP gateway. A body the walk left as it was is sent on byte for byte (`Picked.body_changed`).

The decision and the following are a `Decider`'s (`gateway/epp/decide.py`): this module is the
protocol's state machine only, so it is tested with a fake decider and Envoy-shaped messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.epp import protocol
from gateway.epp.protocol import Envoy


@dataclass(slots=True)
class Refused:
    """Answer the client at once (no model server): the API's error shape, its status and headers."""

    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    details: str = ""


class Follower(Protocol):
    """Follows one picked request's response; `finish` runs exactly once (the exchange sees to it)."""

    def response_headers(self, status: int, headers: dict[str, str]) -> list[tuple[str, str]]:
        """Headers to add to the response."""
        ...

    def body_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes:
        """The bytes to pass on for this chunk of the response body."""
        ...

    def finish(self, complete: bool, served: str | None, observed: bool = True) -> None:
        """The response ended (`complete`) or the stream was cut; must not block. `observed` False:
        the data plane sends no response body here (`response_body_mode: NONE`), so its end and its
        usage are never seen."""
        ...


@dataclass(slots=True)
class Picked:
    endpoints: list[str]  # "ip:port", the primary first
    body: bytes  # the request body to send on (model name, stream usage, engine-control fields)
    follower: Follower
    headers: list[tuple[str, str]] = field(default_factory=list)  # request headers to add
    body_changed: bool = True  # False: `body` is the client's, byte for byte (no mutation needed)


class Decider(Protocol):
    async def decide(self, headers: dict[str, str], body: bytes, subset: Sequence[str] | None) -> Picked | Refused: ...


class Exchange:
    def __init__(
        self, envoy: Envoy, decider: Decider, max_body_bytes: int, request_mode: int = protocol.FULL_DUPLEX_STREAMED
    ) -> None:
        self.envoy = envoy
        self.decider = decider
        self.max_body_bytes = max_body_bytes
        self.request_mode = request_mode  # until Envoy's protocol_config says otherwise
        self.response_mode = protocol.FULL_DUPLEX_STREAMED
        self._headers: dict[str, str] = {}
        self._subset: Sequence[str] | None = None
        self._body = bytearray()
        self._follower: Follower | None = None
        self._served: str | None = None
        self._finished = False
        self.refused: Refused | None = None

    async def on(self, message: Any) -> list[Any]:
        """The responses owed for one ProcessingRequest (possibly none yet, possibly three)."""
        kind = message.WhichOneof("request")
        served = protocol.served_endpoint(message)
        if served:
            self._served = served
        if kind == "request_headers":
            if self._follower is not None or self.refused is not None:
                return []  # one request per stream: headers again after its decision change nothing
            return await self._request_headers(message)
        if kind == "request_body":
            if self._follower is not None or self.refused is not None:
                return []
            self._body += message.request_body.body
            if len(self._body) > self.max_body_bytes:
                return [self._refuse(_too_large(self.max_body_bytes))]
            if message.request_body.end_of_stream:
                return await self._decide(with_body=True)
            return []
        if kind == "request_trailers":  # FULL_DUPLEX_STREAMED: the body ended without end_of_stream
            decided = [] if self._follower is not None else await self._decide(with_body=True, end_of_stream=False)
            if self.refused is not None:
                return decided
            return [*decided, protocol.trailers(self.envoy, request=True)]
        if kind == "response_headers":
            if self._follower is None:
                return [protocol.response_headers(self.envoy)]
            headers = protocol.headers_of(message.response_headers)
            status = _status(headers.get(":status"))
            added = self._follower.response_headers(status, headers)
            responses = [protocol.response_headers(self.envoy, added)]
            if message.response_headers.end_of_stream:
                self._finish(True)
            return responses
        if kind == "response_body":
            body = message.response_body
            return [self._response_body(body.body, body.end_of_stream)]
        if kind == "response_trailers":  # the response's end: what the follower still holds goes first
            held = [self._response_body(b"", True, trailers_follow=True)] if self._follower is not None else []
            self._finish(True)
            return [*held, protocol.trailers(self.envoy, request=False)]
        return []

    async def _request_headers(self, message: Any) -> list[Any]:
        self._headers = protocol.headers_of(message.request_headers)
        self._subset = protocol.subset_hint(message)
        modes = protocol.body_modes(message)
        if modes is not None:
            self.request_mode, self.response_mode = modes
        if message.request_headers.end_of_stream:  # no body (a GET): decide on the headers alone
            return await self._decide(with_body=False)
        if self.request_mode == protocol.BUFFERED:
            return [protocol.headers_continue(self.envoy)]  # Envoy sends the body only after this
        if self.request_mode != protocol.FULL_DUPLEX_STREAMED:
            mode = protocol.MODE_NAMES.get(self.request_mode, str(self.request_mode))
            return [self._refuse(_unsupported_mode(mode))]
        return []

    def _response_body(self, chunk: bytes, end_of_stream: bool, trailers_follow: bool = False) -> Any:
        out = chunk if self._follower is None else self._follower.body_chunk(chunk, end_of_stream)
        if end_of_stream:
            self._finish(True)
        eos = end_of_stream and not trailers_follow
        return protocol.response_body(self.envoy, out, eos, mode=self.response_mode, original=chunk)

    async def _decide(self, *, with_body: bool, end_of_stream: bool = True) -> list[Any]:
        outcome = await self.decider.decide(self._headers, bytes(self._body), self._subset)
        self._body = bytearray()
        if isinstance(outcome, Refused):
            return [self._refuse(outcome)]
        self._follower = outcome.follower
        if with_body and self.request_mode == protocol.BUFFERED:
            return [
                protocol.picked_with_body(
                    self.envoy, outcome.endpoints, outcome.headers, outcome.body, body_changed=outcome.body_changed
                )
            ]
        changed = with_body and outcome.body_changed
        responses = [protocol.picked(self.envoy, outcome.endpoints, outcome.headers, body_changed=changed)]
        if with_body:
            responses.append(protocol.request_body(self.envoy, outcome.body, end_of_stream))
        return responses

    def _refuse(self, refused: Refused) -> Any:
        self.refused = refused
        return protocol.immediate(self.envoy, refused.status, refused.body, refused.headers, refused.details)

    def _finish(self, complete: bool, *, observed: bool = True) -> None:
        if self._finished or self._follower is None:
            return
        self._finished = True
        self._follower.finish(complete, self._served, observed)

    def close(self) -> None:
        """The stream is over, however it ended: settle what is still open. With no response body
        coming here (`NONE`), the stream's end is the only sign of the answer's (Envoy ends it with
        the HTTP stream at the latest): it counts as served, charged as reserved."""
        if self.response_mode == protocol.NONE:
            self._finish(True, observed=False)
        self._finish(False)


def _status(value: str | None) -> int:
    """The response's HTTP status as the follower reads it. Envoy always sends a valid `:status`;
    one that is not a status (garbage from a broken data plane) is read as a bad gateway, so the
    answer is settled as failed rather than the stream failing."""
    if not value:
        return 200
    if len(value) == 3 and value.isascii() and value.isdigit() and value[0] in "12345":
        return int(value)
    return 502


def _unsupported_mode(mode: str) -> Refused:
    message = (
        f"the endpoint picker needs request_body_mode FULL_DUPLEX_STREAMED or BUFFERED (the data plane sent {mode}): "
        "the pick is made from the body and must go back before the body is sent on"
    )
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "epp_misconfigured"}}
    return Refused(500, orjson.dumps(body), details="epp_misconfigured")


def _too_large(limit: int) -> Refused:
    message = f"request body exceeds the limit of {limit} bytes"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    return Refused(413, orjson.dumps(body), details="request_too_large")
