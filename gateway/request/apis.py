"""The API kinds the gateway serves, one `ApiSpec` each: how a body is checked and counted, where it
goes upstream, and how an error is rendered to that API's clients.

The walk asks the spec, never which kind it holds, so a new API surface (another vendor's request
shape) is a new spec — its validation, its token count, its error shape — and one entry in `APIS`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from aiohttp import web

from gateway.errors import GatewayError, InternalError, error_response
from gateway.validate import validate_body
from policies.estimate import PromptEstimator
from policies.types import ApiKind

Counted = tuple[int, Sequence[int] | None]  # (prompt tokens, their ids when counted locally)


@dataclass(frozen=True, slots=True)
class ApiSpec:
    kind: ApiKind
    upstream_path: str  # the engine route the request is relayed to
    validate: Callable[[Any], dict[str, Any]]  # parsed JSON -> the body, or raise InvalidRequest
    count: Callable[[PromptEstimator, dict[str, Any]], Awaitable[Counted]]  # prompt tokens (and ids)
    render_error: Callable[[GatewayError, Iterable[tuple[str, str]]], web.Response] = error_response
    generates: bool = True  # produces output tokens (so has an output reservation, TTFT, TPOT)


async def _count_chat(estimator: PromptEstimator, body: dict[str, Any]) -> Counted:
    tokens, ids = await estimator.chat(body["messages"], body.get("tools"), want_ids=True)
    return tokens, ids


async def _count_completion(estimator: PromptEstimator, body: dict[str, Any]) -> Counted:
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return await estimator.texts(prompt), None
    tokens, ids = await estimator.completion(prompt, want_ids=True)
    return tokens, ids


async def _count_embeddings(estimator: PromptEstimator, body: dict[str, Any]) -> Counted:
    value = body["input"]
    if isinstance(value, str):
        return await estimator.texts([value]), None
    if value and isinstance(value[0], str):
        return await estimator.texts(value), None
    if value and isinstance(value[0], list):
        return sum(len(v) for v in value), None
    return len(value), None


def _validator(kind: ApiKind) -> Callable[[Any], dict[str, Any]]:
    def validate(parsed: Any) -> dict[str, Any]:
        return validate_body(kind, parsed)

    return validate


async def _counted_by_call(estimator: PromptEstimator, body: dict[str, Any]) -> Counted:
    raise InternalError("this API is counted by its per-request ApiCall (gateway/apis/)")


def _validated_by_call(parsed: Any) -> dict[str, Any]:
    raise InternalError("this API is validated by its per-request ApiCall (gateway/apis/)")


def _translated(kind: ApiKind) -> ApiSpec:
    """An API whose every request brings an `ApiCall` (gateway/apis/base.py) that parses, counts,
    writes the upstream body and renders errors for it: the spec only names the kind."""
    return ApiSpec(kind, "", _validated_by_call, _counted_by_call)


APIS: Mapping[str, ApiSpec] = MappingProxyType(
    {
        "chat": ApiSpec("chat", "/v1/chat/completions", _validator("chat"), _count_chat),
        "completions": ApiSpec("completions", "/v1/completions", _validator("completions"), _count_completion),
        "embeddings": ApiSpec(
            "embeddings", "/v1/embeddings", _validator("embeddings"), _count_embeddings, generates=False
        ),
        "responses": _translated("responses"),
        "messages": _translated("messages"),
    }
)
