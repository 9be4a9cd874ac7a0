"""The API a client called, as the walk sees it: one `Api` per request, asked at every step that
depends on the API — never "which kind is this?".

An `Api` reads and checks the body (`parse`, then `prepare` once the caller is known), counts the
prompt (`estimate`), writes what goes to the chosen endpoint (`upstream`), reads the answer back
(`stream_codec`, `unary_transform`) and writes errors in its clients' shape (`render_error`,
`engine_error`). Admission, routing, hooks, fallbacks and accounting are the walk every API shares.

The APIs the engines speak as they are (chat completions, completions, embeddings) are `NativeApi`
values in `APIS`: stateless, so one object serves every request of its kind and chat pays nothing for
the generality (a new such API is one entry). An API the gateway translates per request (OpenAI
Responses, Anthropic Messages: `gateway/apis/`) is an object its route builds for each request,
holding that request's translation; it plugs into the same walk through this protocol, and the walk
imports none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from aiohttp import web

from backends.types import Endpoint
from gateway.errors import EngineRejected, GatewayError, error_response
from gateway.http.shapes import validate_body
from gateway.upstream.relay import StreamCodec
from policies.estimate import PromptCount, PromptEstimator
from policies.types import ApiKind, Principal, RequestFacts, Usage

# (the answer's bytes, or None where the engine's are the answer as they are; its usage)
UnaryTransform = Callable[[dict[str, Any]], tuple[bytes | None, Usage | None]]


class Translation(Protocol):
    """The part of an `Api` a transport asks (`gateway/request/context.py`): the request written for
    the endpoint, and its answer, stream and errors read back in the client's API. A native API
    passes them through; a translated one (`gateway/apis/`) writes chat completions where the engine
    lacks the client's API and translates the answer back."""

    def upstream(self, facts: RequestFacts, endpoint: Endpoint, pd: bool) -> tuple[str, ApiKind, dict[str, Any]]:
        """(path, the API the body is written in, body) for this endpoint (before engine shaping)."""
        ...

    def stream_codec(self, public_model: str, reserved_tokens: int, prompt_tokens: int) -> StreamCodec | None:
        """How to rewrite the engine's stream for the client; None: relayed as it is."""
        ...

    def unary_transform(self, public_model: str) -> UnaryTransform | None:
        """How to rewrite the engine's answer for the client; None: relayed as it is."""
        ...

    def response_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The gateway's response headers as this API writes them (Anthropic's rate-limit names)."""
        ...

    def engine_error(self, error: EngineRejected, body: bytes, headers: Iterable[tuple[str, str]]) -> web.Response:
        """The engine's own 4xx (`error`, normalised from its `body`) in this API's shape."""
        ...


class Api(Translation, Protocol):
    @property
    def kind(self) -> ApiKind: ...

    @property
    def generates(self) -> bool:
        """Produces output tokens (so has an output reservation, TTFT, TPOT)."""
        ...

    def parse(self, parsed: Any) -> dict[str, Any]:
        """The validated body of the parsed JSON (InvalidRequest names the field)."""
        ...

    async def prepare(self, body: dict[str, Any], principal: Principal, program: str | None) -> str | None:
        """Work that needs the caller (a stored conversation); GatewayError to refuse. Returns the
        request's agent program: `program` (what it names itself), else the program of the stored
        conversation it continues (Responses' `previous_response_id` chain), else None."""
        ...

    def estimate(
        self, estimator: PromptEstimator, body: dict[str, Any], model: str
    ) -> PromptCount | Awaitable[PromptCount]:
        """Prompt tokens (and their ids, for prefix routing) as `model`'s engine counts them: the count
        itself when known at once (a cached prompt: no coroutine), else an awaitable (an `async def`
        implementation is one)."""
        ...

    def max_tokens(self, body: dict[str, Any]) -> int | None: ...

    def include_usage(self, body: dict[str, Any]) -> bool:
        """The client asked for a usage chunk at the end of its stream."""
        ...

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response: ...


def native_body(facts: RequestFacts, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """A copy of `body` (the client's, or a stream's continuation of it) for `endpoint`: its served
    model name, and stream usage on (the gateway reads usage whether or not the client wants it)."""
    body = dict(body)
    body["model"] = endpoint.served_model
    if facts.stream:
        body["stream_options"] = {**(facts.body.get("stream_options") or {}), "include_usage": True}
    return body


@dataclass(frozen=True, slots=True)
class NativeApi:
    """An API the engines serve as the client sent it: checked, counted, passed on."""

    kind: ApiKind
    path: str  # the engine route the request is relayed to
    generates: bool = True

    def parse(self, parsed: Any) -> dict[str, Any]:
        return validate_body(self.kind, parsed)

    async def prepare(self, body: dict[str, Any], principal: Principal, program: str | None) -> str | None:
        return program

    def estimate(
        self, estimator: PromptEstimator, body: dict[str, Any], model: str, body_key: int | None = None
    ) -> PromptCount | Awaitable[PromptCount]:
        # the model's own tokenizer, else its engine's /tokenize, else the labelled cl100k estimate.
        # `body_key`: the hash of the raw body (`policies.estimate.body_key`), which keys the count of a
        # native API's body: it is the client's JSON as sent (less engine-control fields, none of which
        # changes the prompt)
        return estimator.counted(self.kind, body, model, body_key)

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
        assert value is None or isinstance(value, int)  # validated
        return value

    def include_usage(self, body: dict[str, Any]) -> bool:
        options = body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def upstream(self, facts: RequestFacts, endpoint: Endpoint, pd: bool) -> tuple[str, ApiKind, dict[str, Any]]:
        return self.path, self.kind, native_body(facts, endpoint, facts.body)

    def stream_codec(self, public_model: str, reserved_tokens: int, prompt_tokens: int) -> StreamCodec | None:
        return None

    def unary_transform(self, public_model: str) -> UnaryTransform | None:
        return None

    def response_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return headers

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        return error_response(error, headers)

    def engine_error(self, error: EngineRejected, body: bytes, headers: Iterable[tuple[str, str]]) -> web.Response:
        return error_response(error, headers)


APIS: Mapping[str, NativeApi] = MappingProxyType(
    {
        "chat": NativeApi("chat", "/v1/chat/completions"),
        "completions": NativeApi("completions", "/v1/completions"),
        "embeddings": NativeApi("embeddings", "/v1/embeddings", generates=False),
    }
)
