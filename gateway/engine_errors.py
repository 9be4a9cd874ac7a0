"""An engine's 4xx answer rewritten in OpenAI's error shape, whatever the engine sent.

vLLM answers `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}` (older builds
put the same fields at the top level with `"object": "error"`), TensorRT-LLM and hosted APIs have
their own variants, and some send plain text. Clients of an OpenAI-compatible gateway read `type` as
one of OpenAI's (`invalid_request_error`, ...) and `code` as a string or null, so the type comes from
the HTTP status, a numeric code is dropped (or named when the message says what it is), and every
field is bounded in size: an engine echoing a client's input cannot make a huge error body either.
"""

from __future__ import annotations

import re
from typing import Any

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
