"""Request bodies, bounded the same way on every route: one reader, one JSON parser, one middleware;
the request shapes the gateway reads are checked in `shapes.py`, and the connections they arrive on
are served in `connections.py`.

Everything a client controls about what it sends is decided in these three modules: the bytes
(bounded, decoded, parsed once: here), the shape the gateway must read (validated: `shapes.py`), and
the connection itself (a client that half-closed after sending is still answered: `connections.py`).

A body is the one thing a client controls in size, pace, encoding and shape, so every route that
reads one gets the same four bounds, wherever its handler lives (inference, Files and Batch, the
admin API, the console):

- **a read deadline**: the whole body must arrive within `server.request_read_timeout_s` of the
  request's headers. The deadline is armed on the request's payload stream by `bounded_bodies`
  (the middleware), so it holds for `request.read()`, `request.json()`, `request.post()` and
  `request.multipart()` alike; a body that misses it is a 408 in the route's error shape and the
  connection is closed.
- **a size**: `server.max_body_bytes`, checked against `Content-Length` before anything is read and
  against the bytes as they arrive (and again after decoding, so a small gzip cannot inflate past
  it); a 413 in the route's error shape, never aiohttp's plain text. Multipart uploads stream their
  parts (the Files route bounds the file part itself) and may have at most `MAX_FORM_PARTS` parts.
- **a memory budget**: every body being read, parsed and counted holds its size against one
  process-wide budget (`server.max_inflight_body_bytes`). A body that would go over it is refused at
  once with a 503 and `Retry-After` instead of the process growing without bound. The budget is held
  until the handler ends or, on the inference walk, until intake has parsed and counted the body
  (`release_body`): a long stream does not hold it.
- **an encoding**: `Content-Encoding` is decoded here, not by aiohttp (`GatewayRunner`, below, turns its
  decoding off), strictly: one coding of `gzip` / `x-gzip` / `deflate` (or `identity`), the
  compressed stream complete (a truncated body is a 400) with nothing after it (a second gzip member
  or trailing bytes is a 400), the decoded size within `max_body_bytes` (a zip bomb is a 413).

JSON nesting is bounded (`MAX_JSON_DEPTH`) for every body: orjson's encoder stops at 254 levels and
bodies are encoded again (upstream, into stores and records), so a deeper one was a 500. The reader
parses a body that is JSON once, as it is read, and checks its depth by an iterative walk: too deep
is a 400 naming the field (`param`: its path) on any route, whatever its handler does next. The
walk (`json_body`, `cached_json`) hands that one parse to the handler; `parse_json_body` is the
same parse for bytes that did not come through a request (batch lines, the endpoint picker's).

A malformed multipart form (a part header with CR, LF or NUL, a wrong boundary, a nested form) is a
400 naming the fault (`BoundedMultipart`). Whatever else a handler lets escape, on any route, is a
500 `server_error` in the route's shape, logged once (`bounded_bodies`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError, InvalidHeader
from aiohttp.web_protocol import RequestPayloadError

from gateway.app.settings import ServerSettings
from gateway.errors import (
    GatewayError,
    InternalError,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    RequestTooLarge,
    error_response,
)

# ---- Bounded bodies

MAX_JSON_DEPTH: Final = 64  # objects and arrays inside one another; no real request comes close
MAX_FORM_PARTS: Final = 32  # parts of one multipart form (the Files route needs 2 to 4)
BUDGET_RETRY_AFTER_S: Final = 1
_MAX_PATH_CHARS: Final = 160
_JSON_START: Final = re.compile(rb"[ \t\r\n]*[{\[]")  # an object or array (what a JSON API is sent)
_JSON_OPENERS: Final = (b"{", b"[")
_CODINGS: Final = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
RAW_BODIES: web.AppKey[bool] = web.AppKey("tokenway_raw_bodies", bool)  # set by GatewayRunner
log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorRenderer = Callable[[web.Request, GatewayError], web.StreamResponse]


# --- JSON ------------------------------------------------------------------------------------------
def parse_json_body(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed body, or InvalidRequest: not JSON, or nested deeper than `max_depth` (the error's
    `param` is the path of the first field found too deep, e.g. `messages[0].content[0].x`)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    bound_depth(raw, value, max_depth)
    return value


# Above this many bytes a body is mostly text (a long prompt), and walking its containers costs far
# less than counting brackets byte by byte: bench/results/overhead-long-prompt.md.
_COUNT_BRACKETS_UP_TO: Final = 16 * 1024


def bound_depth(raw: bytes | str, value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequest when `value` (parsed from `raw`) nests deeper than `max_depth`.

    Each level of nesting needs its own bracket, so a small body with few brackets cannot be deep and
    skips the walk (counting is done in C). A large body is walked instead: the walk's cost follows
    its containers, the count's its bytes, and a long prompt is bytes in a handful of containers."""
    if len(raw) > _COUNT_BRACKETS_UP_TO:
        check_depth(value, max_depth)
        return
    opened = raw.count(b"{") + raw.count(b"[") if isinstance(raw, bytes) else raw.count("{") + raw.count("[")
    if opened > max_depth:
        check_depth(value, max_depth)


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequest when containers nest deeper than `max_depth` (the top-level value is level 1).
    Iterative (a deep value must not exhaust the interpreter's stack while being judged)."""
    if not isinstance(value, dict | list):
        return
    stack: list[tuple[dict[str, Any] | list[Any], int, tuple[Any, ...] | None]] = [(value, 1, None)]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            where = json_path(path)
            raise InvalidRequest(
                f"'{where}' is nested more than {max_depth} levels deep (objects and arrays inside one another)",
                param=where,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (path, key)))


def json_path(path: tuple[Any, ...] | None) -> str:
    """`a.b[3].c` from the walk's linked (parent, key) pairs, shortened to its start when long."""
    keys: list[Any] = []
    while path is not None:
        path, key = path
        keys.append(key)
    text = ""
    for key in reversed(keys):
        part = f"[{key}]" if isinstance(key, int) else ("." if text else "") + str(key)[:40]
        if len(text) + len(part) > _MAX_PATH_CHARS:
            return text + "..."
        text += part
    return text or "(body)"


# --- the memory budget -----------------------------------------------------------------------------
class BodyBudget:
    """Bytes of request bodies being read, parsed and counted in this process, against one limit."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.refused = 0

    def take(self, size: int) -> bool:
        if self.used_bytes + size > self.limit_bytes:
            self.refused += 1
            return False
        self.used_bytes += size
        return True

    def give(self, size: int) -> None:
        self.used_bytes = max(0, self.used_bytes - size)


@dataclass(slots=True)
class BodyBounds:
    """What `bounded_bodies` enforces (from `server:`), shared by every request of one app."""

    max_body_bytes: int
    read_timeout_s: float
    budget: BodyBudget
    max_form_parts: int = MAX_FORM_PARTS


@dataclass(slots=True)
class BodyState:
    """One request's body: its bounds, what it holds of the budget, and the body once read."""

    bounds: BodyBounds
    decode: bool  # aiohttp left Content-Encoding to us (GatewayRunner)
    charged: int = 0
    body: bytes | None = None
    parsed: Any = None  # the body's JSON value, when it was JSON (NOT_PARSED otherwise)
    expired: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def charge(self, total: int) -> None:
        """Hold `total` bytes of the budget (what is held already counts), or refuse with a 503."""
        more = total - self.charged
        if more <= 0:
            return
        if not self.bounds.budget.take(more):
            raise Overloaded(
                "The gateway is reading as many request bodies as its memory budget allows "
                "(server.max_inflight_body_bytes); retry shortly.",
                headers=[("Retry-After", str(BUDGET_RETRY_AFTER_S))],
            )
        self.charged = total

    def release(self) -> None:
        if self.charged:
            self.bounds.budget.give(self.charged)
            self.charged = 0


_STATE: Final = web.RequestKey("tokenway_body", BodyState)  # the request's BodyState


def _state_of(request: web.Request) -> BodyState | None:
    """The request's BodyState, if the middleware set one up. Not `request.get`: aiohttp's request
    is a MutableMapping whose `get` is the Python-level `Mapping.get` calling `__getitem__` (two
    frames instead of one, four times per request)."""
    try:
        return request[_STATE]
    except KeyError:
        return None


class BodyDeadline(RequestPayloadError):
    """Set on a payload stream whose body missed the read deadline: every read raises it. A
    RequestPayloadError so aiohttp's lingering read after the answer closes the connection quietly
    (`gateway/http/bodies.py` keeps such client faults out of the error log)."""


# What aiohttp's multipart reader raises for a form the client got wrong: a part header that is not
# one (CR, LF or NUL inside a quoted name, a line with no colon: `InvalidHeader`), a boundary that
# is missing or wrong, a part's Content-Length or transfer encoding it cannot honour. None of them is
# a GatewayError, so unconverted each was aiohttp's plain-text 500.
_FORM_FAULTS: Final = (HttpProcessingError, ValueError, RuntimeError, LookupError)


def malformed_form(exc: Exception) -> InvalidRequest:
    """A 400 naming what is wrong with a multipart body (aiohttp's words, control bytes escaped)."""
    detail = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
    detail = " ".join(detail.split())[:200]
    hint = ""
    if isinstance(exc, InvalidHeader):
        hint = " (a part's header line must be 'Name: value', with no CR, LF or NUL inside a value or quoted name)"
    return InvalidRequest(f"the multipart form is malformed: {detail or type(exc).__name__}{hint}")


class BoundedPart(BodyPartReader):
    """A form part whose reads answer a malformed part as a 400 (`malformed_form`)."""

    async def read_chunk(self, size: int = BodyPartReader.chunk_size) -> bytes:
        try:
            return await super().read_chunk(size)
        except _FORM_FAULTS as exc:
            raise malformed_form(exc) from None

    async def readline(self) -> bytes:
        try:
            return await super().readline()
        except _FORM_FAULTS as exc:
            raise malformed_form(exc) from None


class _NestedForm(MultipartReader):
    """What a part of type multipart/* would be read as: refused (no route takes nested forms)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise InvalidRequest("a multipart form may not nest another multipart form")


class BoundedMultipart(MultipartReader):
    """A multipart reader that refuses forms of more than `max_parts` parts, and answers a malformed
    form (bad part headers, boundary or framing) with a 400 naming the fault instead of a 500."""

    part_reader_cls = BoundedPart
    multipart_reader_cls = _NestedForm

    def __init__(self, headers: Any, content: Any, max_parts: int) -> None:
        try:
            super().__init__(headers, content)
        except _FORM_FAULTS as exc:  # no boundary, or one aiohttp cannot use
            raise malformed_form(exc) from None
        self._max_parts = max_parts
        self._parts = 0

    async def next(self) -> Any:
        try:
            part = await super().next()
        except _FORM_FAULTS as exc:
            raise malformed_form(exc) from None
        if part is not None:
            self._parts += 1
            if self._parts > self._max_parts:
                raise InvalidRequest(f"the form has more than {self._max_parts} parts")
        return part


class BoundedRequest(web.Request):
    """An aiohttp request whose body reads go through the bounds (`bounded_bodies` makes every
    request with a body one of these). `json()`, `text()` and `post()` read through `read()`."""

    async def read(self) -> bytes:
        state = _state_of(self)
        if state is None:  # not set up by the middleware (cannot happen on the gateway's app)
            return await super().read()
        if state.body is None:
            state.parsed = NOT_PARSED
            state.body = await _read(self, state)
            state.parsed = _parse_if_json(state.body)
        return state.body

    async def multipart(self) -> MultipartReader:
        state = _state_of(self)
        if state is None:
            return await super().multipart()
        if not self.content_type.startswith("multipart/"):
            raise InvalidRequest("expected a multipart/form-data body", param="Content-Type")
        if state.decode and _codings(self):
            raise InvalidRequest("a multipart upload cannot have a Content-Encoding", param="Content-Encoding")
        return BoundedMultipart(self.headers, self.content, state.bounds.max_form_parts)


class _NotParsed:
    def __repr__(self) -> str:
        return "NOT_PARSED"


NOT_PARSED: Final[Any] = _NotParsed()


def _parse_if_json(raw: bytes) -> Any:
    """The body's JSON value when it is JSON (nesting bounded: InvalidRequest otherwise), else
    NOT_PARSED: a handler that parses it anyway judges it (its own 400 for "not JSON")."""
    # a JSON API's body starts with its bracket: one C-level test; the regular expression only for a
    # body that starts otherwise (leading whitespace, or not JSON at all)
    if not raw.startswith(_JSON_OPENERS) and _JSON_START.match(raw) is None:
        return NOT_PARSED
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return NOT_PARSED
    bound_depth(raw, value)
    return value


def cached_json(request: web.Request) -> Any:
    """The JSON value `read()` already parsed (the one parse of the request), or NOT_PARSED."""
    state = _state_of(request)
    return NOT_PARSED if state is None or state.body is None else state.parsed


def parsed_body(request: web.Request) -> Any:
    """`cached_json` and `forget_raw` in one look-up of the request's state (the inference walk's
    intake, once per request): the JSON value `read()` parsed, its raw bytes dropped, or NOT_PARSED
    (the raw bytes kept, for the caller to judge)."""
    state = _state_of(request)
    if state is None or state.body is None:
        return NOT_PARSED
    parsed = state.parsed
    if parsed is not NOT_PARSED:
        state.body = b""
    return parsed


async def json_body(request: web.Request) -> Any:
    """The request's body as JSON, parsed once, nesting bounded; InvalidRequest when it is not JSON."""
    raw = await request.read()
    parsed = cached_json(request)
    return parse_json_body(raw) if parsed is NOT_PARSED else parsed


def forget_raw(request: web.Request) -> None:
    """Drop the raw bytes of a body already parsed (its budget stays held): while the prompt is
    counted, only the parsed body is kept in memory."""
    state = _state_of(request)
    if state is not None and state.body is not None and state.parsed is not NOT_PARSED:
        state.body = b""


def release_body(request: web.Request) -> None:
    """The body has been parsed and counted: give back its share of the budget and drop the raw
    bytes (the walk keeps the parsed body; a long stream holds no budget)."""
    state = _state_of(request)
    if state is not None:
        state.release()
        if state.body is not None:
            state.body, state.parsed = b"", NOT_PARSED


def body_budget_of(request: web.Request) -> BodyBudget | None:
    state = _state_of(request)
    return state.bounds.budget if state is not None else None


async def _read(request: web.Request, state: BodyState) -> bytes:
    limit = state.bounds.max_body_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise RequestTooLarge(f"request body of {length} bytes exceeds the limit of {limit}")
    if length:
        state.charge(length)
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
            state.charge(size)
            chunks.append(chunk)
    except BodyDeadline:
        raise _timeout(state) from None
    except RequestPayloadError as exc:  # e.g. broken chunked framing
        raise InvalidRequest(f"the request body could not be read: {str(exc).strip()}") from None
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    del chunks
    if state.decode:
        codings = _codings(request)
        if codings:
            raw = decode_body(raw, codings, limit)
            state.charge(state.charged + len(raw))
    return raw


def _codings(request: web.Request) -> list[str]:
    """The request's content codings other than `identity`, every Content-Encoding header joined."""
    values = request.headers.getall("Content-Encoding", ())
    return [c.strip().lower() for v in values for c in v.split(",") if c.strip() and c.strip().lower() != "identity"]


def decode_body(raw: bytes, codings: list[str], limit: int) -> bytes:
    """`raw` decoded from its one content coding, strictly (module docstring), at most `limit` bytes."""
    if len(codings) > 1:
        raise InvalidRequest(
            f"at most one Content-Encoding is accepted, got {', '.join(codings[:4])}", param="Content-Encoding"
        )
    coding = codings[0]
    wbits = _CODINGS.get(coding)
    if wbits is None:
        raise InvalidRequest(
            f"unsupported Content-Encoding {coding[:40]!r} (use gzip or deflate)", param="Content-Encoding"
        )
    if coding == "deflate" and raw and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, as some clients send it
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(raw, limit + 1)
    except zlib.error:
        raise InvalidRequest(f"the request body is not valid {coding}", param="Content-Encoding") from None
    if len(out) > limit or decoder.unconsumed_tail:
        raise RequestTooLarge(f"the decoded request body exceeds the limit of {limit} bytes")
    if not decoder.eof:
        raise InvalidRequest(f"the {coding} request body is truncated", param="Content-Encoding")
    if decoder.unused_data:
        raise InvalidRequest(
            f"the request body has data after the end of its {coding} stream (a second member?)",
            param="Content-Encoding",
        )
    return out


def _timeout(state: BodyState) -> RequestTimeout:
    return RequestTimeout(f"the request body did not arrive within {state.bounds.read_timeout_s:g}s")


def _expire(request: web.Request, state: BodyState) -> None:
    state.timer = None
    if request.content.is_eof():
        return
    state.expired = True
    request.content.set_exception(BodyDeadline("the request body did not arrive in time"))


# --- the middleware --------------------------------------------------------------------------------
def body_bounds(server: ServerSettings) -> BodyBounds:
    """The bounds `server:` sets (one budget for the whole process)."""
    return BodyBounds(
        max_body_bytes=server.max_body_bytes,
        read_timeout_s=server.request_read_timeout_s,
        budget=BodyBudget(server.max_inflight_body_bytes),
    )


def bounded_bodies(bounds: BodyBounds, render: ErrorRenderer | None = None) -> Any:
    """The middleware that puts every request with a body under `bounds` (module docstring).

    A GatewayError that a handler lets through (a body read that missed its deadline, was too large
    or over the budget), and aiohttp's own 413, are answered in the route's error shape by `render`
    (OpenAI's by default). So is any other exception a handler lets escape, on every route, body or
    not: a 500 `server_error` in the route's shape, logged here once with its traceback, never
    aiohttp's plain-text 500 (`_unexpected`)."""
    answer = render or _openai_shape

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists:
            try:
                return await handler(request)
            except _PASSED_ON:
                raise
            except Exception as exc:
                return _unexpected(request, exc, answer)
        state = BodyState(bounds, decode=bool(request.app.get(RAW_BODIES, False)))
        request[_STATE] = state
        if type(request) is web.Request:
            request.__class__ = BoundedRequest  # same layout; only read() and multipart() differ
        if not request.content.is_eof():  # small bodies arrive with the headers: nothing to time
            state.timer = asyncio.get_running_loop().call_later(bounds.read_timeout_s, _expire, request, state)
            request.content.on_eof(state.timer.cancel)
        try:
            return await handler(request)
        except GatewayError as error:
            return _closing(answer(request, error), state)
        except web.HTTPRequestEntityTooLarge:
            too_large = RequestTooLarge(f"request body exceeds the limit of {bounds.max_body_bytes} bytes")
            return _closing(answer(request, too_large), state)
        except BodyDeadline:
            return _closing(answer(request, _timeout(state)), state)
        except _PASSED_ON:
            raise
        except Exception as exc:
            return _closing(_unexpected(request, exc, answer), state)
        finally:
            if state.timer is not None:
                state.timer.cancel()
            state.release()

    return middleware


# Left to the layers that own them: aiohttp's HTTP exceptions (redirects; 404 / 405 are worded by
# `not_found_middleware`, gateway/app/factory.py), a body the client broke off (a 400 there), a connection already gone.
_PASSED_ON: Final = (web.HTTPException, RequestPayloadError, ConnectionResetError)


def _unexpected(request: web.Request, exc: Exception, answer: ErrorRenderer) -> web.StreamResponse:
    """A bug's answer: logged once (here), a 500 in the route's error shape. An answer already on the
    wire cannot be replaced: then the exception goes on, and aiohttp logs it and ends the connection."""
    if getattr(request.writer, "output_size", 0):
        raise exc  # aiohttp logs it
    log.error("unhandled error answering %s %s", request.method, request.path[:_MAX_PATH_CHARS], exc_info=exc)
    return answer(request, InternalError("The gateway failed while handling the request; it has been logged."))


def _closing(response: web.StreamResponse, state: BodyState) -> web.StreamResponse:
    if state.expired:  # the rest of a body that missed its deadline is not waited for
        response.force_close()
    return response


def _openai_shape(request: web.Request, error: GatewayError) -> web.StreamResponse:
    return error_response(error)
