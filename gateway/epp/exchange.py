"""One ext_proc stream: one HTTP request and its response, as Envoy shows them to the picker.

    request_headers            kept (answered once the body is complete, FULL_DUPLEX_STREAMED)
    request_body ... eos       -> decide: Picked (headers response naming the endpoint, then the
                                  rewritten body) or Refused (an immediate response: 4xx / 503)
    response_headers           -> the response headers (with tokenway's), status noted
    response_body ... eos      -> each chunk passed on as the follower returns it; at the end the
                                  follower settles (usage, first token, load) exactly once
    the stream ends early      -> `close()` settles what was generated, exactly once

The decision and the following are a `Decider`'s (`gateway/epp/decide.py`): this module is the
protocol's state machine only, so it is tested with a fake decider and Envoy-shaped messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.epp import protocol
from gateway.epp.protos import Envoy


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

    def finish(self, complete: bool, served: str | None) -> None:
        """The response ended (`complete`) or the stream was cut; must not block."""
        ...


@dataclass(slots=True)
class Picked:
    endpoints: list[str]  # "ip:port", the primary first
    body: bytes  # the request body to send on (model name, stream usage)
    follower: Follower
    headers: list[tuple[str, str]] = field(default_factory=list)  # request headers to add


class Decider(Protocol):
    async def decide(self, headers: dict[str, str], body: bytes, subset: Sequence[str] | None) -> Picked | Refused: ...


class Exchange:
    def __init__(self, envoy: Envoy, decider: Decider, max_body_bytes: int) -> None:
        self.envoy = envoy
        self.decider = decider
        self.max_body_bytes = max_body_bytes
        self._headers: dict[str, str] = {}
        self._subset: Sequence[str] | None = None
        self._body = bytearray()
        self._follower: Follower | None = None
        self._served: str | None = None
        self._finished = False
        self.refused: Refused | None = None

    async def on(self, message: Any) -> list[Any]:
        """The responses owed for one ProcessingRequest (possibly none yet, possibly two)."""
        kind = message.WhichOneof("request")
        served = protocol.served_endpoint(message)
        if served:
            self._served = served
        if kind == "request_headers":
            self._headers = protocol.headers_of(message.request_headers)
            self._subset = protocol.subset_hint(message)
            if message.request_headers.end_of_stream:  # no body (a GET): decide on the headers alone
                return await self._decide(with_body=False)
            return []
        if kind == "request_body":
            if self._follower is not None or self.refused is not None:
                return []
            self._body += message.request_body.body
            if len(self._body) > self.max_body_bytes:
                return [self._refuse(_too_large(self.max_body_bytes))]
            if message.request_body.end_of_stream:
                return await self._decide(with_body=True)
            return []
        if kind == "response_headers":
            if self._follower is None:
                return [protocol.response_headers(self.envoy)]
            headers = protocol.headers_of(message.response_headers)
            status = int(headers.get(":status", "200") or 200)
            added = self._follower.response_headers(status, headers)
            responses = [protocol.response_headers(self.envoy, added)]
            if message.response_headers.end_of_stream:
                self._finish(True)
            return responses
        if kind == "response_body":
            body = message.response_body
            out = body.body if self._follower is None else self._follower.body_chunk(body.body, body.end_of_stream)
            if body.end_of_stream:
                self._finish(True)
            return [protocol.response_body(self.envoy, out, body.end_of_stream)]
        if kind in ("request_trailers", "response_trailers"):
            return []  # not asked for (the processing mode skips trailers)
        return []

    async def _decide(self, *, with_body: bool) -> list[Any]:
        outcome = await self.decider.decide(self._headers, bytes(self._body), self._subset)
        self._body = bytearray()
        if isinstance(outcome, Refused):
            return [self._refuse(outcome)]
        self._follower = outcome.follower
        responses = [protocol.picked(self.envoy, outcome.endpoints, outcome.headers)]
        if with_body:
            responses.append(protocol.request_body(self.envoy, outcome.body))
        return responses

    def _refuse(self, refused: Refused) -> Any:
        self.refused = refused
        return protocol.immediate(self.envoy, refused.status, refused.body, refused.headers, refused.details)

    def _finish(self, complete: bool) -> None:
        if self._finished or self._follower is None:
            return
        self._finished = True
        self._follower.finish(complete, self._served)

    def close(self) -> None:
        """The stream is over, however it ended: settle what is still open."""
        self._finish(False)


def _too_large(limit: int) -> Refused:
    import orjson

    message = f"request body exceeds the limit of {limit} bytes"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    return Refused(413, orjson.dumps(body), details="request_too_large")
