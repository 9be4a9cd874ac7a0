"""`ApiCall`, the shape of an API translated per request, and the first of them: POST /v1/responses
(with GET / DELETE /v1/responses/{id}).

## `ApiCall`

An `ApiCall` is an API the gateway translates per request (not chat / completions / embeddings).
Such an API is an object its route builds for each request, holding that request's translation; the
walk sees it as any other `Api` (`gateway/request/apis.py`): it reads the body (`parse`, then
`prepare` once the caller is known), counts the prompt (`estimate`), says what to send to the chosen
endpoint (`upstream`: natively where the engine serves the API, else a chat completions request),
how to read the answer (`stream_codec`, `unary_transform`) and how to write errors (`render_error`,
`engine_error`). Everything else — admission, routing, prediction, fallbacks, accounting — is the
walk every API shares.

`messages.py` is the other `ApiCall`; both share `NATIVE_ENGINES`, `engine_message` and
`json_response` from here.

## The Responses API

POST /v1/responses as an `ApiCall`, and GET / DELETE /v1/responses/{id}.

The gateway owns the conversation and names it: every response gets the gateway's own random id
(`new_response_id`) in place of the engine's (vLLM derives its ids from the request's
`x-request-id`, so two requests sending the same header would share one, and the second would
overwrite the first). `previous_response_id` is looked up in the gateway's own store (per API key;
another key's id is a 404 like an unknown one) and the engine gets the whole conversation as
`input` with `store: false` — engine-side stores are per replica, and the next turn may be routed
anywhere. Natively to engines that serve /v1/responses; as chat completions elsewhere, with the
answer and the stream translated back (`backends.protocols.responses`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from functools import partial
from typing import Any, Protocol

import orjson
from aiohttp import web

from backends.protocols import ProtocolError, responses
from backends.types import Endpoint
from gateway.apis.store import ResponseStore, entry_blob, new_response_id
from gateway.apis.streams import NativeResponses, ResponsesFromChat, responses_usage
from gateway.errors import EngineRejected, GatewayError, InvalidRequest, error_response
from gateway.request.apis import Api, UnaryTransform
from gateway.upstream.relay import StreamCodec
from policies.estimate import PromptCount, PromptEstimator
from policies.routing.pipeline import bounded_key
from policies.types import ApiKind, Principal, RequestFacts, Usage

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


class PreviousResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "previous_response_not_found"


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


def _check(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if "input" not in body:
        raise InvalidRequest("'input' is required", param="input")
    for name in ("stream", "store", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"'{name}' must be a boolean", param=name)
    if body.get("background"):
        raise InvalidRequest("'background' responses are not supported", param="background")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
    if body.get("conversation") is not None:
        raise InvalidRequest("'conversation' is not supported; use previous_response_id", param="conversation")
    return body


class ResponsesCall:
    kind: ApiKind = "responses"
    generates = True

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self.body: dict[str, Any] = {}
        self.prior: list[dict[str, Any]] = []
        self.chat: dict[str, Any] = {}
        self.principal: Principal | None = None
        self.program: str | None = None  # kept with the stored response: the chain's next turn inherits it
        self.native = False
        self.final: dict[str, Any] | None = None
        self.final_bytes: bytes | None = None  # `final` as the client got it, where it was encoded here
        self.response_id = new_response_id()
        self._stored = False

    def _translate(self) -> dict[str, Any]:
        try:
            return responses.to_chat(self.body, self.prior)
        except ProtocolError as exc:
            raise InvalidRequest(exc.message, param=exc.param) from None

    def parse(self, parsed: Any) -> dict[str, Any]:
        self.body = _check(parsed)
        self.chat = self._translate()  # every item checked before anything is admitted
        return self.body

    async def prepare(self, body: dict[str, Any], principal: Principal, program: str | None) -> str | None:
        """The stored conversation this turn continues; the program is the request's own, else the
        chain's (kept with each stored response), else the chain's first response id: a conversation
        continued by `previous_response_id` is one program without the client naming it."""
        self.principal = principal
        self.program = program
        previous = body.get("previous_response_id")
        if previous is None:
            return program
        entry = await self.store.get(principal.key_id, previous) if self.store is not None else None
        if entry is None:
            raise PreviousResponseNotFound(
                f"Previous response with id '{previous}' not found.", param="previous_response_id"
            )
        self.prior = list(entry.get("items") or ())
        self.chat = self._translate()
        if program is None:
            chained = entry.get("program")
            self.program = chained if isinstance(chained, str) and chained else bounded_key(previous)
        return self.program

    async def estimate(self, estimator: PromptEstimator, body: dict[str, Any], model: str) -> PromptCount:
        # vLLM's Responses renderer tokenizes the rendered chat with the tokenizer's special tokens
        # (a second BOS where the template writes one too): count as it does.
        return await estimator.count("chat", {**self.chat, "add_special_tokens": True}, model)

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_output_tokens")
        return value if isinstance(value, int) else None

    def include_usage(self, body: dict[str, Any]) -> bool:
        return False  # the API's own stream carries usage in its last event (the codec writes it)

    def upstream(self, facts: RequestFacts, endpoint: Endpoint, pd: bool) -> tuple[str, ApiKind, dict[str, Any]]:
        self.native = endpoint.engine in NATIVE_ENGINES and not pd
        if self.native:
            native = {k: v for k, v in self.body.items() if k != "previous_response_id"}
            native["model"] = endpoint.served_model
            native["store"] = False
            if self.prior:
                native["input"] = [*self.prior, *responses.input_items(self.body.get("input"))]
            return "/v1/responses", "responses", native
        chat = dict(self.chat)
        chat["model"] = endpoint.served_model
        return "/v1/chat/completions", "chat", chat

    def _keep(self, response: dict[str, Any]) -> Awaitable[None] | None:
        self.final = response
        return self.finished() if self.store is not None else None

    def stream_codec(self, public_model: str, reserved_tokens: int, prompt_tokens: int) -> StreamCodec:
        previous = self.body.get("previous_response_id")
        if self.native:
            return _Holding(NativeResponses(reserved_tokens, previous, self.response_id), self._keep)
        return _Holding(
            ResponsesFromChat(self.body, public_model, reserved_tokens, previous, self.response_id), self._keep
        )

    def unary_transform(self, public_model: str) -> UnaryTransform:
        return partial(self.unary, public_model=public_model)

    def unary(self, parsed: dict[str, Any], public_model: str) -> tuple[bytes | None, Usage | None]:
        previous, store = self.body.get("previous_response_id"), self.body.get("store", True)
        if self.native:
            usage = responses_usage(parsed.get("usage"))
            response = parsed  # parsed for this request alone: rewritten in place, not copied
            response["id"] = self.response_id  # never the engine's (always re-encoded, then)
            response["model"] = public_model
        else:
            response = responses.from_chat(parsed, self.body, self.response_id, model=public_model)
            usage = Usage.from_chat(parsed.get("usage"))
        response["previous_response_id"] = previous
        response["store"] = store
        self.final = response
        self.final_bytes = orjson.dumps(response)
        return self.final_bytes, usage

    def response_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return headers

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        return error_response(error, headers)

    def engine_error(self, error: EngineRejected, body: bytes, headers: Iterable[tuple[str, str]]) -> web.Response:
        status = error.status
        message, kind, code = engine_message(body)
        payload = {"error": {"message": message, "type": kind or "invalid_request_error", "param": None, "code": code}}
        return json_response(status, payload, headers)

    async def finished(self) -> None:
        """Store the answer (once), if it is to be kept: called when a stream's final event is
        ready, and after the walk; one coroutine, not two, on every request's path."""
        final = self.final
        if self._stored or final is None or self.store is None or self.principal is None:
            return
        if self.body.get("store") is False or final.get("status") not in ("completed", "incomplete"):
            return
        self._stored = True
        items = responses.conversation_items(self.body, final)
        if self.prior:
            items = [*self.prior, *items]
        response = self.final_bytes if self.final_bytes is not None else orjson.dumps(final)
        await self.store.put(self.principal.key_id, self.response_id, entry_blob(response, items, self.program))


class _Holding:
    """A responses codec whose final response is stored before the last event is written (the
    client may send its next turn the moment it reads that event)."""

    def __init__(self, inner: NativeResponses | ResponsesFromChat, keep: Any) -> None:
        self.inner = inner
        self.keep = keep
        self._pending: Awaitable[None] | None = None
        self._kept = False

    def begin(self) -> bytes:
        return self.inner.begin()

    def _check_final(self) -> None:
        if not self._kept and self.inner.final is not None:
            self._kept = True
            self._pending = self.keep(self.inner.final)

    def events(self, events: list[bytes], outcome: Any, ticket: Any, swap: tuple[bytes, bytes] | None) -> bytes:
        out = self.inner.events(events, outcome, ticket, swap)
        self._check_final()
        return out

    def broken(self, message: str) -> bytes:
        return self.inner.broken(message)

    def failover(self, marker: Mapping[str, Any]) -> bytes:
        """The failover marker of a translated stream (a native one is never failed over)."""
        return self.inner.failover(marker) if isinstance(self.inner, ResponsesFromChat) else b""

    def end(self) -> bytes:
        out = self.inner.end()
        self._check_final()
        return out

    def hold(self) -> Awaitable[None] | None:
        pending, self._pending = self._pending, None
        return pending


async def get_response(store: ResponseStore | None, principal: Principal, response_id: str) -> web.Response:
    entry = await store.get(principal.key_id, response_id) if store is not None else None
    if entry is None:
        return error_response(ResponseNotFound(f"Response with id '{response_id}' not found.", param="response_id"))
    return web.Response(body=orjson.dumps(entry["response"]), content_type="application/json")


async def delete_response(store: ResponseStore | None, principal: Principal, response_id: str) -> web.Response:
    deleted = await store.delete(principal.key_id, response_id) if store is not None else False
    if not deleted:
        return error_response(ResponseNotFound(f"Response with id '{response_id}' not found.", param="response_id"))
    body = {"id": response_id, "object": "response.deleted", "deleted": True}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
