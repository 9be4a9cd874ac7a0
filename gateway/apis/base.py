"""`ApiCall`: the per-request pieces of an API that is not chat / completions / embeddings.

The walk of a request creates nothing API-specific itself: it asks the call to read the body (`parse`,
then `prepare` once the caller is known), to count the prompt (`estimate`), to say what to send
to the chosen endpoint (`upstream`: natively where the engine serves the API, else a chat
completions request), how to read the answer (`stream_codec`, `unary`) and how to write errors
(`render_error`, `upstream_error`). Everything else — admission, routing, prediction, fallbacks,
accounting — is the walk every API shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import orjson
from aiohttp import web

from backends.types import Endpoint
from gateway.errors import GatewayError
from gateway.relay import StreamCodec
from policies.estimate import PromptCount, PromptEstimator
from policies.types import ApiKind, Principal, Usage

# Engines whose own server speaks the Responses and Messages APIs (vLLM's /v1/responses and
# /v1/messages; the simulator's). Others (TensorRT-LLM, hosted OpenAI-compatible APIs) get chat.
NATIVE_ENGINES: frozenset[str] = frozenset({"vllm", "vllm-ascend", "sim"})


class ApiCall(Protocol):
    api: ApiKind

    def parse(self, parsed: Any) -> dict[str, Any]:
        """The validated body (InvalidRequest names the field)."""
        ...

    async def prepare(self, body: dict[str, Any], principal: Principal) -> None:
        """Work that needs the caller (a stored conversation); GatewayError to refuse."""
        ...

    async def estimate(self, estimator: PromptEstimator, model: str) -> PromptCount:
        """Prompt tokens (and their ids, for prefix routing) of the chat the engine renders this
        request as, counted as `model`'s engine counts them (its own tokenizer where one is known)."""
        ...

    def max_tokens(self, body: dict[str, Any]) -> int | None: ...

    def upstream(self, endpoint: Endpoint, pd: bool) -> tuple[str, ApiKind, dict[str, Any]]:
        """(path, the API the body is written in, body) for this endpoint."""
        ...

    def stream_codec(self, public_model: str, reserved_tokens: int, prompt_tokens: int) -> StreamCodec: ...

    def unary(self, parsed: dict[str, Any], public_model: str) -> tuple[bytes, Usage | None]: ...

    def response_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The gateway's response headers as this API writes them (Anthropic's rate-limit names)."""
        ...

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response: ...

    def upstream_error(self, status: int, body: bytes, headers: Iterable[tuple[str, str]]) -> web.Response: ...

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
