"""POST /v1/messages (Anthropic Messages) as an `ApiCall`, and /v1/messages/count_tokens.

Natively to engines that serve /v1/messages (vLLM), as chat completions elsewhere. Every error
under /v1/messages is Anthropic's (`{"type": "error", "error": {"type", "message"}, "request_id"}`,
`overloaded_error` for 503 / 529); the gateway's `x-ratelimit-*` headers are also written as
`anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` (reset as an RFC 3339 instant).
count_tokens is answered by the gateway's own count (the same rendering as the prompt it admits),
without an engine call, under the rules of the main route: the key must be valid (checked before a
byte of the body is read) and may use the model (403 / 404 as on /v1/messages), and each call is one
request against the key's request limits (RPM, RPD, concurrency), never its token limits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from backends.protocols import ProtocolError, anthropic
from backends.types import Endpoint
from gateway.apis.responses import NATIVE_ENGINES, engine_message, json_response
from gateway.apis.streams import MessagesFromChat, NativeMessages, messages_usage
from gateway.app import keys as appkeys
from gateway.errors import (
    EngineRejected,
    GatewayError,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    Rejected,
    error_response,
)
from gateway.http.bodies import json_body, release_body
from gateway.request.apis import UnaryTransform
from gateway.request.intake import authenticate
from gateway.request.intake import request_id as request_id_of
from gateway.upstream.relay import StreamCodec
from policies.estimate import PromptCount, PromptEstimator
from policies.limits.admission import Admission
from policies.types import ApiKind, Principal, Rejection, RequestFacts, Usage


def anthropic_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    headers = list(headers)
    return [*headers, *anthropic.ratelimit_headers(headers, time.time())]


def anthropic_error(error: GatewayError, headers: Iterable[tuple[str, str]], request_id: str | None) -> web.Response:
    kind = anthropic.error_type(error.status)
    if error.status == 429 and error.type == "insufficient_quota":
        kind = "rate_limit_error"
    payload = anthropic.error_body(error.status, error.message, request_id, kind)
    return json_response(error.status, payload, anthropic_headers([*error.headers, *headers]))


def _request_id(headers: Iterable[tuple[str, str]]) -> str | None:
    return next((v for k, v in headers if k == "x-request-id"), None)


def translate(body: Any, *, count_only: bool = False) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        if body.get("tool_choice") is not None:  # checked with or without tools (a native engine sees it)
            anthropic.chat_tool_choice(body["tool_choice"])
        return anthropic.to_chat(body, count_only=count_only)
    except ProtocolError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None


class MessagesCall:
    kind: ApiKind = "messages"
    generates = True

    def __init__(self) -> None:
        self.body: dict[str, Any] = {}
        self.chat: dict[str, Any] = {}
        self.native = False

    def parse(self, parsed: Any) -> dict[str, Any]:
        self.chat = translate(parsed)
        self.body = dict(parsed)
        stream = parsed.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest("stream: must be a boolean", param="stream")
        return self.body

    async def prepare(self, body: dict[str, Any], principal: Principal, program: str | None) -> str | None:
        return program

    async def estimate(self, estimator: PromptEstimator, body: dict[str, Any], model: str) -> PromptCount:
        return await estimator.count("chat", self.chat, model)

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        return int(body["max_tokens"])

    def include_usage(self, body: dict[str, Any]) -> bool:
        return False  # the API's own stream carries usage in its last event (the codec writes it)

    def upstream(self, facts: RequestFacts, endpoint: Endpoint, pd: bool) -> tuple[str, ApiKind, dict[str, Any]]:
        self.native = endpoint.engine in NATIVE_ENGINES and not pd
        if self.native:
            return "/v1/messages", "messages", {**self.body, "model": endpoint.served_model}
        return "/v1/chat/completions", "chat", {**self.chat, "model": endpoint.served_model}

    def stream_codec(self, public_model: str, reserved_tokens: int, prompt_tokens: int) -> StreamCodec:
        if self.native:
            return NativeMessages(reserved_tokens)
        return MessagesFromChat(self.body, public_model, reserved_tokens, prompt_tokens)

    def unary_transform(self, public_model: str) -> UnaryTransform:
        return partial(self.unary, public_model=public_model)

    def unary(self, parsed: dict[str, Any], public_model: str) -> tuple[bytes | None, Usage | None]:
        if self.native:
            usage = messages_usage(parsed.get("usage"))
            if parsed.get("model") == public_model:
                return None, usage  # the engine's bytes are the answer (as chat completions relays them)
            message = dict(parsed)
            message["model"] = public_model
            return orjson.dumps(message), usage
        message = anthropic.from_chat(parsed, self.body, model=public_model)
        return orjson.dumps(message), Usage.from_chat(parsed.get("usage"))

    def response_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return anthropic_headers(headers)

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        headers = list(headers)
        return anthropic_error(error, headers, _request_id(headers))

    def engine_error(self, error: EngineRejected, body: bytes, headers: Iterable[tuple[str, str]]) -> web.Response:
        status = error.status
        headers = list(headers)
        message, kind, _code = engine_message(body)
        anthropic_kind = kind if kind in set(anthropic._ERROR_TYPES.values()) else None
        payload = anthropic.error_body(status, message, _request_id(headers), anthropic_kind)
        return json_response(status, payload, headers)

    async def finished(self) -> None:
        return None


def error_in_route_shape(request: web.Request, error: GatewayError) -> web.StreamResponse:
    """`error` in the error shape of the route it answers: Anthropic's under /v1/messages, OpenAI's
    elsewhere (the body bounds' answer, `gateway/http/bodies.py`, on every route)."""
    request_id = request_id_of(request.headers)
    headers = [("x-request-id", request_id)]
    if request.path.startswith("/v1/messages"):
        return anthropic_error(error, headers, request_id)
    return error_response(error, headers)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt's tokens as the gateway counts them (module docstring)."""
    request_id = request_id_of(request.headers)
    headers = [("x-request-id", request_id)]
    app = request.app
    try:
        principal = authenticate(request, app[appkeys.POLICIES].current)  # before the body is read
        parsed = await json_body(request)
        chat = translate(parsed, count_only=True)
        policy = app[appkeys.POLICIES].current
        requested = str(parsed["model"])
        model = policy.resolve_model(requested)
        if not app[appkeys.FLEET].pools_for_model(model):
            raise ModelNotFound(f"The model '{requested}' does not exist or is not served here.", param="model")
        if not (principal.may_use(model) or principal.may_use(requested)):
            raise ModelNotAllowed(f"This key may not use the model '{requested}'.", param="model")
        limits = await count_request(app[appkeys.ADMISSION], principal, model, requested, request_id)
        estimator = app[appkeys.DIRECTOR].intake.estimator
        tokens, _ids = await estimator.chat(chat["messages"], chat.get("tools"))
    except GatewayError as error:
        return anthropic_error(error, headers, request_id)
    finally:
        release_body(request)
    return json_response(200, {"input_tokens": tokens}, anthropic_headers([*limits, *headers]))


async def count_request(
    admission: Admission, principal: Principal, model: str, requested: str, request_id: str
) -> tuple[tuple[str, str], ...]:
    """Charge one request (no tokens, no spend) to every request limit of (key, model), or raise the
    429 that says which is spent. The concurrency slot it takes is given back at once."""
    facts = RequestFacts(  # an embeddings-shaped request of 0 tokens: buckets of tokens are charged 0
        request_id=request_id, api="embeddings", body={}, requested_model=requested, model=model, principal=principal
    )
    admitted = await admission.admit(facts, model)
    if isinstance(admitted, Rejection):
        raise Rejected(admitted)
    await admission.settle(admitted, Usage(), model=model)
    return admitted.headers
