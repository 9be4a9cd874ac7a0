"""The gateway's exception tree, one class per row of the error catalogue (README "Errors").

    GatewayError              500      any failure rendered to the client in its API's error shape
    ├── InvalidRequest        400      malformed JSON, missing/invalid field or header (param names it)
    │   └── ContextLengthExceeded 400  prompt + max_tokens over the model's context
    ├── InvalidApiKey         401      missing or unknown key
    ├── ModelNotAllowed       403      the key may not use the model
    ├── ModelNotFound         404      no pool serves the model
    ├── RequestTimeout        408      the body did not arrive within request_read_timeout_s
    ├── RequestTooLarge       413      the body is over max_body_bytes
    ├── Overloaded            503      the in-flight body budget (max_inflight_body_bytes) is spent
    ├── Rejected              4xx/5xx  a policy decision's Rejection: rate limits (429), budgets
    │                                  (429), the limiter store down (503), an SLO miss (503)
    ├── EngineRejected        4xx      the engine's own 4xx, normalised to the error shape
    ├── NoHealthyBackend      503      no endpoint of the model could take the request
    ├── StorageFailed         507/503  the gateway's own store refused a write (full: 507)
    ├── UpstreamError         502      the upstream failed after retries and fallbacks
    └── InternalError         500      a bug: still answered in the error shape, still recorded

Translation at the boundaries: the relay maps the upstream client's errors into `RetryableUpstream`
/ `UpstreamRejected` (`gateway/upstream/relay.py`), which the dispatch stage turns into this tree; policies
return `Rejection` values (they cannot import this room) which `Rejected` wraps. "Not here, instead"
— a rejection the model's fallback chain may still turn into an answer — travels as a
`gateway.request.director.Detour` carrying one of these errors.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Final

import orjson
from aiohttp import web

from gateway.upstream.engine_errors import openai_error
from policies.types import Rejection


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: list[tuple[str, str]] = list(headers)

    @property
    def reason(self) -> str:
        """Short label for metrics and the usage ledger."""
        return self.code or self.type

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class InvalidApiKey(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotAllowed(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(GatewayError):
    """The process-wide budget of request bodies in memory is spent (`gateway/http/bodies.py`): retry."""

    status = 503
    type = "server_error"
    code = "overloaded"


class StorageFailed(GatewayError):
    """The gateway's own store refused a write a request needs (a batch file, a batch's state: its
    disk, or the Redis holding them): the client's request was fine and may be retried once space
    or the store is back. 507 when the store is full (RFC 4918 "Insufficient Storage": a full disk
    or quota, Redis at its `maxmemory`), else 503; never a 500 with a traceback."""

    status = 503
    type = "server_error"
    code = "storage_unavailable"

    @classmethod
    def of(cls, exc: OSError, what: str) -> StorageFailed:
        if exc.errno in _NO_SPACE:
            return cls.full(what, "its disk is full")
        return cls(f"The gateway cannot store {what}: {exc.strerror or type(exc).__name__}; retry later.")

    @classmethod
    def full(cls, what: str, why: str) -> StorageFailed:
        error = cls(f"The gateway cannot store {what}: {why}; retry later.", code="insufficient_storage")
        error.status = 507
        return error


_NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # full disk, quota, file size limit


class NoHealthyBackend(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_backend"


class UpstreamError(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class InternalError(GatewayError):
    code = "internal_error"


class EngineRejected(GatewayError):
    """The engine answered 4xx before streaming: its error passed on in OpenAI's shape, whatever the
    engine sent (`gateway/upstream/engine_errors.py` normalises and bounds it)."""

    def __init__(self, status: int, body: bytes) -> None:
        error = openai_error(status, body)["error"]
        super().__init__(str(error["message"]), param=error["param"], code=error["code"])
        self.status = status
        self.type = str(error["type"])

    @property
    def reason(self) -> str:
        return self.code or "upstream_4xx"


class Rejected(GatewayError):
    """A policy's Rejection (429 rate limit, 429 quota, 503 SLO, ...), rendered as it says."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message, param=rejection.param, code=rejection.code, headers=rejection.headers)
        self.rejection = rejection
        self.status = rejection.status
        self.type = rejection.type

    @property
    def reason(self) -> str:
        return self.rejection.reason or super().reason


def error_response(error: GatewayError, extra_headers: Iterable[tuple[str, str]] = ()) -> web.Response:
    response = web.Response(status=error.status, body=orjson.dumps(error.body()), content_type="application/json")
    for name, value in (*error.headers, *extra_headers):
        response.headers[name] = value
    return response


def sse_error_event(error: GatewayError) -> bytes:
    """The one event that reports a failure after a 200 was sent (openai-python raises APIError on it)."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"
