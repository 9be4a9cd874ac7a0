"""What every provider codec gives the gateway: the call to make, the answer and stream as chat, usage.

The pivot is the chat-completions body the gateway already holds for every front API. A codec turns
it into one `UpstreamCall` (path, headers, body: signing happens after, on those exact bytes), and
turns what the provider sent back into chat-completion dicts, so the fronts' existing renderings
(Responses, Messages) serve hosted answers unchanged. A field with no counterpart upstream raises
`Untranslatable` naming it (the gateway answers 400), unless the caller allows dropping, in which
case the codec lists it in `UpstreamCall.dropped` (sent back in `x-tokenway-dropped-fields`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.protocols import ProtocolError


class Untranslatable(ProtocolError):
    """A request field the provider has no place for: refused (400, `param` names it), never dropped silently."""


# UpstreamCall and ProviderUsage are made once per request and never changed after: value objects, but
# not `frozen` dataclasses, whose __init__ (object.__setattr__ per field) costs about three times a
# plain one's on the per-request path (bench/results/overhead-translation.md).


@dataclass(slots=True)
class UpstreamCall:
    """One HTTP request to a provider, before signing (SigV4 and bearer tokens sign these exact bytes)."""

    method: str
    path: str  # path and query, appended to the pool's base URL
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stream: bool
    dropped: tuple[str, ...] = ()


@dataclass(slots=True)
class ProviderUsage:
    """Tokens as the provider billed them; `input_tokens` is the whole prompt (cache reads and writes included).

    Providers disagree on whether cached tokens are part of the input count (Anthropic and Bedrock
    report them apart, Gemini and OpenAI inside): codecs normalise to the whole prompt here so that
    pricing can take the cached parts out at their own prices.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0  # written at the provider's default cache lifetime (5 minutes on Anthropic)
    cache_write_1h_tokens: int = 0
    reasoning_tokens: int = 0  # part of output_tokens

    def chat_usage(self) -> dict[str, Any]:
        """The chat-completions `usage` object, with cache writes under tokenway's own detail keys."""
        details: dict[str, Any] = {"cached_tokens": self.cache_read_tokens}
        if self.cache_write_tokens or self.cache_write_1h_tokens:
            details["cache_write_tokens"] = self.cache_write_tokens
            details["cache_write_1h_tokens"] = self.cache_write_1h_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
            "prompt_tokens_details": details,
        }
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


@dataclass(frozen=True, slots=True)
class ProviderError:
    """A provider's error, read into what the front APIs' error shapes need."""

    status: int  # the status the gateway answers with (a provider's 529 "overloaded" becomes 503)
    kind: str  # OpenAI-style type: invalid_request_error, authentication_error, rate_limit_error, ...
    message: str
    retryable: bool  # worth a fallback to another pool or model (throttling, overload, 5xx)
    retry_after_s: float | None = None


class ProviderStreamError(Exception):
    """A provider error inside a stream already answered 200 (Anthropic's `error` event, a Bedrock
    exception frame, a truncated or corrupt stream): raised by `StreamDecoder.feed` / `close`."""

    def __init__(self, error: ProviderError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class RateLimitState:
    """What a provider said about its own limits on the last answer (`anthropic-ratelimit-*`, `x-ratelimit-*`)."""

    requests_remaining: int | None = None
    tokens_remaining: int | None = None
    input_tokens_remaining: int | None = None
    output_tokens_remaining: int | None = None
    reset_s: float | None = None  # seconds until the tightest limit resets
    extra: dict[str, str] = field(default_factory=dict)


class StreamDecoder(Protocol):
    """Provider stream bytes in, chat.completion.chunk dicts out (the last one carries `usage`)."""

    def feed(self, data: bytes) -> list[dict[str, Any]]: ...

    def close(self) -> list[dict[str, Any]]: ...

    @property
    def usage(self) -> ProviderUsage | None: ...


@dataclass(frozen=True, slots=True)
class ProviderTarget:
    """Where and as what a pool calls its provider (filled from the pool's config by the gateway)."""

    model: str  # the provider's model id (Bedrock model id or inference profile, Gemini model, Azure deployment)
    api_version: str | None = None  # anthropic-version, Azure api-version
    beta: Sequence[str] = ()  # anthropic-beta values the policy passes
    allow_drop: bool = False  # list untranslatable fields in `dropped` instead of refusing
    extra_headers: Mapping[str, str] = field(default_factory=dict)


class ProviderCodec(Protocol):
    """One provider's wire format; every method is pure (no I/O, no clock)."""

    name: str

    def request(self, chat: Mapping[str, Any], target: ProviderTarget) -> UpstreamCall: ...

    def answer(self, body: bytes, target: ProviderTarget) -> tuple[dict[str, Any], ProviderUsage]:
        """The chat completion (its `usage` already `ProviderUsage.chat_usage()`: the transport sends
        it as it is) and the usage; one parse of `body`."""
        ...

    def stream(self, target: ProviderTarget) -> StreamDecoder: ...

    def error(self, status: int, headers: Mapping[str, str], body: bytes) -> ProviderError: ...

    def rate_limits(self, headers: Mapping[str, str]) -> RateLimitState: ...
