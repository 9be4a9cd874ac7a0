"""An engine's 4xx answer rewritten in OpenAI's error shape, whatever the engine sent.

vLLM answers `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}` (older builds
put the same fields at the top level with `"object": "error"`), TensorRT-LLM and hosted APIs have
their own variants, and some send plain text. Clients of an OpenAI-compatible gateway read `type` as
one of OpenAI's (`invalid_request_error`, ...) and `code` as a string or null, so the type comes from
the HTTP status, a numeric code is dropped (or named when the message says what it is), and every
field is bounded in size: an engine echoing a client's input cannot make a huge error body either.

An engine's 5xx is read too (`engine_fault`), to tell an overloaded or broken replica, which another
may replace, from a request that makes engines fail, which must not be sent to every engine and
fallback model in turn (one request, three crashes).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson

MAX_MESSAGE_CHARS = 2048
MAX_PARAM_CHARS = 128
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "requests"}
_OPENAI_TYPES = frozenset(
    {"invalid_request_error", "permission_error", "authentication_error", "not_found_error", "requests", "tokens"}
)


def openai_error(status: int, raw: bytes) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` for an engine's answer `raw` with `status`."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    fields: dict[str, Any] = {}
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict):
            fields = inner
        elif isinstance(inner, str):
            fields = {"message": inner}
        elif "message" in parsed:
            fields = parsed  # vLLM's older top-level ErrorResponse
    message = fields.get("message")
    if not isinstance(message, str) or not message:
        message = raw[:MAX_MESSAGE_CHARS].decode("utf-8", "replace").strip() or f"the engine answered {status}"
    message = message[:MAX_MESSAGE_CHARS]
    param = fields.get("param")
    param = param[:MAX_PARAM_CHARS] if isinstance(param, str) and param else None
    engine_type = fields.get("type")
    kind = engine_type if engine_type in _OPENAI_TYPES else _TYPES.get(status, "invalid_request_error")
    code = _code(fields.get("code"), status, message, param)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _code(code: Any, status: int, message: str, param: str | None) -> str | None:
    if isinstance(code, str) and _CODE.fullmatch(code):
        return code
    lowered = message.lower()
    if "maximum context length" in lowered or ("context length" in lowered and "exceed" in lowered):
        return "context_length_exceeded"
    if status == 404 and param == "model":
        return "model_not_found"
    if status == 401:
        return "invalid_api_key"
    if status == 429:
        return "rate_limit_exceeded"
    return None


# Engine error types that say the request, not the engine, is at fault (vLLM's, OpenAI's, pydantic's)
_REQUEST_TYPES = frozenset(
    {
        "BadRequestError",
        "invalid_request_error",
        "NotFoundError",
        "UnprocessableEntityError",
        "RequestValidationError",
        "ValidationError",
    }
)
_OVERLOAD = frozenset({502, 503, 504})


def engine_fault(status: int, raw: bytes) -> Literal["endpoint", "request", "crash"]:
    """Whose fault an engine's 5xx answer `raw` is, as the walk retries it (docs/routing.md).

    - "endpoint": 502, 503, 504 (overload, a proxy in front of a dead engine, a timeout) or a 5xx
      without a body: another replica or the fallback chain may well serve the request;
    - "request": an error body naming a request problem (a 4xx `code`, or a client-error `type`):
      the request fails the same way everywhere, and is answered with that 4xx;
    - "crash": any other 5xx with an error body, the engine failing on this request: tried once more
      on another replica (the replica may be broken), never on the fallback chain.
    """
    if status in _OVERLOAD or not raw.strip():
        return "endpoint"
    fields = _fields(raw)
    code, kind = fields.get("code"), fields.get("type")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return "request"
    if isinstance(kind, str) and kind in _REQUEST_TYPES:
        return "request"
    return "crash"


def request_status(raw: bytes) -> int:
    """The 4xx a "request" fault is answered with: the body's own 4xx `code`, else 400."""
    code = _fields(raw).get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return code
    return 400


def _fields(raw: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    inner = parsed.get("error")
    if isinstance(inner, dict):
        return inner
    return parsed
