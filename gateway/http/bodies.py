"""Request bodies, bounded the same way on every route: one reader, one JSON parser, one middleware;
the few request shapes the gateway reads in them checked; the connections they arrive on served.

Everything a client controls about what it sends is decided here: the bytes (bounded, decoded,
parsed once), the shape the gateway must read (validated), and the connection itself (a client that
half-closed after sending is still answered). The sections say why each is done as it is.

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

Request shapes
--------------

Minimal validation of the OpenAI request shapes the gateway must understand to do its job.

Only what admission, routing and accounting read is checked here (model, messages/prompt/input,
stream, stream_options, max_tokens, n), plus what an engine would fail on instead of rejecting
(token ids outside int32, sampling parameters outside OpenAI's documented ranges) and what the
gateway keeps (`model` and `metadata` within bounded sizes); everything else passes through for the
engine to judge. Hand-written checks over the parsed dict: no per-request pydantic on the hot path.

Ranges (OpenAI API reference): temperature [0, 2], top_p [0, 1], n [1, 128], presence_penalty and
frequency_penalty [-2, 2], top_logprobs [0, 20] (with `logprobs: true`), completions `logprobs`
[0, 20] (OpenAI documents 5; vLLM's default `max_logprobs` is 20, and the gateway refuses nothing an
engine behind it accepts), best_of [1, 20] and >= n, metadata at most 16 pairs of strings (keys up
to 64 characters, values up to 512).

Half-closed clients
-------------------

Answering clients that half-close, without serving clients that left.

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
import re
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import BodyPartReader, HttpVersion11, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError, InvalidHeader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

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
from policies.types import ApiKind

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


# ---- Request shapes

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_TOKEN_ID = 2**31 - 1  # engines hold ids as int32: anything above is no token of any vocabulary
MAX_MODEL_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("temperature", 0.0, 2.0),
    ("top_p", 0.0, 1.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
)
_RANGE_FIELDS = frozenset(field for field, _low, _high in _RANGES)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _int_in(body: Mapping[str, Any], field: str, low: int, high: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequest(f"'{field}' must be an integer from {low} to {high}, got {value!r}", param=field)
    return int(value)


def _check_sampling(api: ApiKind, body: Mapping[str, Any]) -> None:
    # one C-level test first: most requests set none of these (the loop then checks them in order)
    if not _RANGE_FIELDS.isdisjoint(body):
        for field, low, high in _RANGES:
            value = body.get(field)
            if value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidRequest(f"'{field}' must be a number", param=field)
            if not low <= value <= high:  # NaN fails too
                raise InvalidRequest(f"'{field}' must be from {low:g} to {high:g}, got {value!r}", param=field)
    # each check only for a field the body sets (a call less per field it does not)
    n = _int_in(body, "n", 1, 128) if "n" in body else None
    if api == "chat":
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest("'logprobs' must be a boolean", param="logprobs")
        if "top_logprobs" in body and _int_in(body, "top_logprobs", 0, 20) is not None and logprobs is not True:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    elif api == "completions":
        _int_in(body, "logprobs", 0, 20)
        best_of = _int_in(body, "best_of", 1, 20)
        if best_of is not None and best_of < (n or 1):
            raise InvalidRequest(f"'best_of' ({best_of}) must be at least 'n' ({n})", param="best_of")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"'metadata' keys are strings of at most {MAX_METADATA_KEY_CHARS} characters and values strings "
                f"of at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _positive_int(body: Mapping[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise InvalidRequest(f"'{field}' must be an integer >= 1, got {value!r}", param=field)
    return int(value)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is None:
            if role != "assistant" and role != "function":
                raise InvalidRequest(f"messages[{i}].content is required", param=f"messages[{i}].content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}] must be an object with a 'type'",
                        param=f"messages[{i}].content[{j}]",
                    )
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content"
            )


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return
        if all(isinstance(p, str) for p in prompt):
            return
    raise InvalidRequest(
        f"'prompt' must be a string, an array of strings or an array of token ids (0 to {MAX_TOKEN_ID})",
        param="prompt",
    )


def _check_input(value: Any) -> None:
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_is_token_id(v) for v in value):
            return
        if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
            return
    raise InvalidRequest(
        f"'input' must be a non-empty string or array of strings/token ids (token ids from 0 to {MAX_TOKEN_ID})",
        param="input",
    )


def validate_body(api: ApiKind, body: Any) -> dict[str, Any]:
    """Check the fields the gateway reads; returns the body (a dict) or raises InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequest(f"'model' must be at most {MAX_MODEL_CHARS} characters", param="model")
    if api == "chat":
        _check_messages(body.get("messages"))
    elif api == "completions":
        if "prompt" not in body:
            raise InvalidRequest("'prompt' is required", param="prompt")
        _check_prompt(body["prompt"])
    else:
        if "input" not in body:
            raise InvalidRequest("'input' is required", param="input")
        _check_input(body["input"])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise InvalidRequest("'stream_options.include_usage' must be a boolean", param="stream_options")
    if "max_tokens" in body:  # the helpers only for the fields a body sets
        _positive_int(body, "max_tokens")
    if "max_completion_tokens" in body:
        _positive_int(body, "max_completion_tokens")
    _check_sampling(api, body)
    metadata = body.get("metadata")
    if metadata is not None:
        _check_metadata(metadata)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", param="user")
    return body


# ---- Half-closed clients

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
