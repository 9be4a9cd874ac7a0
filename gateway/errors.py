"""The gateway's exception tree, one class per row of the error catalogue (DESIGN.md §6).

    GatewayError                       any failure rendered to the client in OpenAI's error shape
    ├── InvalidRequest        400      malformed JSON, missing/invalid field (param names it)
    │   └── ContextLengthExceeded 400  prompt + max_tokens over the model's context
    ├── InvalidApiKey         401
    ├── ModelNotAllowed       403
    ├── ModelNotFound         404
    ├── RequestTooLarge       413
    ├── Rejected              4xx/5xx  a policy decision's Rejection (rate limits, budgets, SLO)
    ├── NoHealthyBackend      503
    └── UpstreamError         502      upstream failed after retries and fallbacks

Upstream aiohttp errors are mapped into `UpstreamError` at the relay boundary; policies return
`Rejection` values (they cannot import this room) which `Rejected` wraps.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from aiohttp import web

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


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class NoHealthyBackend(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_backend"


class UpstreamError(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


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
