"""Azure OpenAI: the codec of chat completions to Azure's deployments, and the Microsoft Entra ID bearer
tokens its `auth: entra` pools send.

The codec
---------
Chat completions → Azure OpenAI, for pools with `engine: azure-openai`.

Azure speaks chat completions itself, so the codec is mostly the address and the field checks:

- Path: `target.api_version` `v1` (or `preview`) uses the v1 API, `/openai/v1/chat/completions` with
  the deployment as `model` in the body (`api-version=preview` is kept as a query for preview
  features); any dated version uses `/openai/deployments/{deployment}/chat/completions?api-version=`,
  `DEFAULT_API_VERSION` when the target names none.
- Credentials are not part of the call: the transport adds `api-key` or `Authorization: Bearer`
  (an Entra ID token), like `target.extra_headers`.
- Fields: the chat body passes as it is, minus tokenway's `cache_control` marks (Azure caches
  prompts of 1024 tokens and more by itself, and refuses unknown properties); a streamed call asks
  for `stream_options.include_usage` so that the last chunk carries the usage to settle. Refused
  (or listed in `dropped` when the target allows): `web_search_options` (not served by Azure's chat
  completions) and any field that is not a chat-completions or Azure field.
- Answers: Azure's additions (`prompt_filter_results`, per-choice `content_filter_results`, the
  stream's leading filter-only chunk) are taken out so that the front API's own shape is all a
  client sees. Usage: `prompt_tokens` is the whole prompt, `prompt_tokens_details.cached_tokens` the
  part read from cache (Azure bills no cache writes), `completion_tokens_details.reasoning_tokens`
  part of the completion.
- Errors: `{"error": {"code", "message", ...}}`; 429 carries `retry-after-ms` / `retry-after`;
  rate limits arrive as `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.

Entra ID tokens
---------------
Microsoft Entra ID bearer tokens for Azure OpenAI pools (`auth: entra`).

Azure OpenAI accepts `Authorization: Bearer TOKEN` with a token for the Cognitive Services scope
instead of an `api-key` (Microsoft Learn, "How to configure Azure OpenAI in Azure AI Foundry Models
with Microsoft Entra ID authentication"). The token comes from azure-identity's
`DefaultAzureCredential` (environment, workload identity, managed identity, Azure CLI, ...): its
`get_token` may block on a token endpoint or a subprocess, so the transport calls `refresh` off the
event loop at start-up and again before the token's expiry, never per request, as it does for
Bedrock's and Vertex AI's credentials. azure-identity is optional (`pip install 'tokenway[azure]'`),
imported on first use. Any object with azure-core's `get_token(*scopes)` returning an `AccessToken`
(`token`, `expires_on` in epoch seconds) may stand in for the default credential.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any, Final, Protocol

import orjson

from backends.hosted.base import (
    ProviderError,
    ProviderStreamError,
    ProviderTarget,
    ProviderUsage,
    RateLimitState,
    Untranslatable,
    UpstreamCall,
)
from backends.hosted.chat_in import header
from backends.protocols import split_event
from backends.protocols.anthropic import duration_s
from backends.types import EventBuffer, usage_count

DEFAULT_API_VERSION = "2024-10-21"
V1_VERSIONS = ("v1", "preview")

# chat-completions request fields (OpenAI's and Azure's own) that pass unchanged.
_PASSED = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "data_sources", "user_security_context",
}  # fmt: skip
_REFUSED = {"web_search_options": "Azure OpenAI chat completions has no web search"}
_COMPLETION_KEYS = ("id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier")
_CHOICE_KEYS = ("index", "message", "delta", "finish_reason", "logprobs")
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_KINDS |= {408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def _strip_cache_marks(value: Any) -> Any:
    """The body without `cache_control` on messages, content parts and tools (Azure caches by itself)."""
    if isinstance(value, list):
        return [_strip_cache_marks(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _strip_cache_marks(v) for k, v in value.items() if k != "cache_control"}
    return value


def chat_request(chat: Mapping[str, Any], target: ProviderTarget) -> tuple[str, dict[str, Any], list[str]]:
    """(path and query, body, dropped fields) of the Azure call for a chat body."""
    dropped: list[str] = []
    body: dict[str, Any] = {}
    for name, value in chat.items():
        if name in _PASSED:
            body[name] = value
            continue
        why = _REFUSED.get(name, "not a chat-completions field Azure OpenAI takes")
        if not target.allow_drop:
            raise Untranslatable(f"{name}: {why}", name)
        dropped.append(name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("messages must be a non-empty array", "messages")
    body["messages"] = _strip_cache_marks(messages)
    if "tools" in body:
        body["tools"] = _strip_cache_marks(body["tools"])
    body["model"] = target.model
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    version = target.api_version or DEFAULT_API_VERSION
    if version in V1_VERSIONS:
        path = "/openai/v1/chat/completions" + ("?api-version=preview" if version == "preview" else "")
    else:
        deployment = urllib.parse.quote(target.model, safe="")
        query = urllib.parse.urlencode({"api-version": version})
        path = f"/openai/deployments/{deployment}/chat/completions?{query}"
    return path, body, dropped


def usage_from(raw: Mapping[str, Any] | None) -> ProviderUsage:
    if not raw:
        return ProviderUsage()
    prompt = raw.get("prompt_tokens_details") or {}
    completion = raw.get("completion_tokens_details") or {}
    return ProviderUsage(
        input_tokens=usage_count(raw.get("prompt_tokens")),
        output_tokens=usage_count(raw.get("completion_tokens")),
        cache_read_tokens=usage_count(prompt.get("cached_tokens")),
        reasoning_tokens=usage_count(completion.get("reasoning_tokens")),
    )


def _clean(completion: Mapping[str, Any], model: str) -> dict[str, Any]:
    """Only chat completions' own fields: Azure's content-filter annotations taken out."""
    out = {k: completion[k] for k in _COMPLETION_KEYS if k in completion}
    out["choices"] = [{k: c[k] for k in _CHOICE_KEYS if k in c} for c in completion.get("choices") or ()]
    out["model"] = out.get("model") or model
    return out


class AzureStreamDecoder:
    """Azure's `data:` stream → chat.completion.chunk dicts (filter-only chunks dropped, usage chunk last)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._buffer = EventBuffer(crlf=True)  # the provider's stream is input: bounded, read once
        self._usage: ProviderUsage | None = None
        self._done = False

    @property
    def usage(self) -> ProviderUsage | None:
        return self._usage

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for raw in self._buffer.feed(data):
            _name, payload = split_event(raw)
            if payload is None:
                continue
            if payload.strip() == b"[DONE]":
                self._done = True
                continue
            chunk = orjson.loads(payload)
            if isinstance(chunk.get("error"), Mapping):
                raise ProviderStreamError(_error_from(500, chunk["error"], None))
            if not chunk.get("choices") and not chunk.get("usage"):
                continue  # Azure's leading prompt_filter_results chunk
            if chunk.get("usage"):
                self._usage = usage_from(chunk["usage"])
            cleaned = _clean(chunk, self.model)
            cleaned["object"] = "chat.completion.chunk"
            out.append(cleaned)
        return out

    def close(self) -> list[dict[str, Any]]:
        if not self._done:
            raise ProviderStreamError(
                ProviderError(502, "server_error", "Azure OpenAI stream ended before [DONE]", True)
            )
        return []


def _error_from(status: int, error: Mapping[str, Any], retry_after: float | None) -> ProviderError:
    code = str(error.get("code") or "")
    if status == 500 and code.isdigit() and 400 <= int(code) < 600:
        status = int(code)  # a mid-stream error names its status only in `code`
    kind = _KINDS.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    if code == "content_filter":
        kind = "content_filter"
    message = str(error.get("message") or code or f"HTTP {status}")
    retryable = status in (408, 429) or status >= 500
    return ProviderError(status=status, kind=kind, message=message, retryable=retryable, retry_after_s=retry_after)


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _retry_after(headers: Mapping[str, str]) -> float | None:
    ms = _number(header(headers, "retry-after-ms"))
    if ms is not None:
        return ms / 1000
    return _number(header(headers, "retry-after"))


class AzureOpenAICodec:
    """The `ProviderCodec` for Azure OpenAI chat completions (deployments and the v1 API)."""

    name = "azure_openai"

    def request(self, chat: Mapping[str, Any], target: ProviderTarget) -> UpstreamCall:
        path, body, dropped = chat_request(chat, target)
        headers = [("content-type", "application/json")]
        if body.get("stream"):
            headers.append(("accept", "text/event-stream"))
        headers.extend(target.extra_headers.items())
        return UpstreamCall("POST", path, tuple(headers), orjson.dumps(body), bool(body.get("stream")), tuple(dropped))

    def answer(self, body: bytes, target: ProviderTarget) -> tuple[dict[str, Any], ProviderUsage]:
        completion = orjson.loads(body)
        usage = usage_from(completion.get("usage"))
        cleaned = _clean(completion, target.model)
        cleaned["usage"] = usage.chat_usage()  # normalised as every codec's (tokenway's cache detail keys)
        return cleaned, usage

    def stream(self, target: ProviderTarget) -> AzureStreamDecoder:
        return AzureStreamDecoder(target.model)

    def error(self, status: int, headers: Mapping[str, str], body: bytes) -> ProviderError:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        error = parsed.get("error") if isinstance(parsed, Mapping) else None
        if not isinstance(error, Mapping):
            error = {"message": body.decode("utf-8", "replace")[:500] or f"HTTP {status}"}
        return _error_from(status, error, _retry_after(headers))

    def rate_limits(self, headers: Mapping[str, str]) -> RateLimitState:
        """`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as Go durations) and `retry-after(-ms)`.

        `reset_s` is the retry delay when sent, else the latest reset among exhausted limits, else the soonest.
        """
        state = RateLimitState()
        remaining_requests = _number(header(headers, "x-ratelimit-remaining-requests"))
        remaining_tokens = _number(header(headers, "x-ratelimit-remaining-tokens"))
        state.requests_remaining = int(remaining_requests) if remaining_requests is not None else None
        state.tokens_remaining = int(remaining_tokens) if remaining_tokens is not None else None
        resets: dict[str, float] = {}
        for name, value in headers.items():
            lower = name.lower()
            if not lower.startswith("x-ratelimit-"):
                continue
            state.extra[lower] = value
            if lower.startswith("x-ratelimit-reset-"):
                seconds = duration_s(value) if not value.replace(".", "", 1).isdigit() else float(value)
                if seconds is not None:
                    resets[lower.removeprefix("x-ratelimit-reset-")] = seconds
        retry = _retry_after(headers)
        if retry is not None:
            state.reset_s = retry
        else:
            exhausted = [s for kind, s in resets.items() if state.extra.get(f"x-ratelimit-remaining-{kind}") == "0"]
            state.reset_s = max(exhausted) if exhausted else (min(resets.values()) if resets else None)
        return state


SCOPE: Final = "https://cognitiveservices.azure.com/.default"


class TokenCredential(Protocol):
    """azure-core's `TokenCredential`, as far as it is used here."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Any: ...


class EntraToken:
    """One pool endpoint's Entra ID token source; `refresh` blocks (run it off the loop)."""

    def __init__(self, credential: TokenCredential | None = None) -> None:
        self._credential = credential

    def refresh(self) -> tuple[str, float]:
        """(access token, its expiry in epoch seconds) for the Cognitive Services scope."""
        if self._credential is None:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise RuntimeError("`auth: entra` needs azure-identity: pip install 'tokenway[azure]'") from exc
            self._credential = DefaultAzureCredential()
        token = self._credential.get_token(SCOPE)
        return str(token.token), float(token.expires_on)

    @staticmethod
    def headers(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}
