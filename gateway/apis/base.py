"""`ApiCall`: an API the gateway translates per request (not chat / completions / embeddings).

Such an API is an object its route builds for each request, holding that request's translation; the
walk sees it as any other `Api` (`gateway/request/apis.py`): it reads the body (`parse`, then
`prepare` once the caller is known), counts the prompt (`estimate`), says what to send to the chosen
endpoint (`upstream`: natively where the engine serves the API, else a chat completions request),
how to read the answer (`stream_codec`, `unary_transform`) and how to write errors (`render_error`,
`engine_error`). Everything else — admission, routing, prediction, fallbacks, accounting — is the
walk every API shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.request.apis import Api

# Engines whose own server speaks the Responses and Messages APIs (vLLM's /v1/responses and
# /v1/messages; the simulator's). Others (TensorRT-LLM, hosted OpenAI-compatible APIs) get chat.
NATIVE_ENGINES: frozenset[str] = frozenset({"vllm", "vllm-ascend", "sim"})


class ApiCall(Api, Protocol):
    async def finished(self) -> None:
        """After the answer is complete (and before a non-streamed one is sent): store it."""
        ...


def engine_message(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, type, code) of an engine's error body, whatever its shape."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace"), None, None
    error = parsed.get("error") if isinstance(parsed, Mapping) else None
    if isinstance(error, Mapping):
        code = error.get("code")
        return str(error.get("message", "")), error.get("type"), (str(code) if code is not None else None)
    if isinstance(error, str):
        return error, None, None
    return body[:500].decode("utf-8", "replace"), None, None


def json_response(status: int, payload: Any, headers: Iterable[tuple[str, str]]) -> web.Response:
    response = web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")
    for name, value in headers:
        response.headers[name] = value
    return response
