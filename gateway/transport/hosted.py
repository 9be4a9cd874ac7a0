"""The hosted transport: a routed request sent to a hosted provider's own API (Anthropic, Bedrock,
Gemini/Vertex AI, Azure OpenAI), its answer served as if an engine had answered in chat completions.

The walk already holds a chat-completions body for every front API (chat itself, and Responses and
Messages translated to chat where the upstream lacks its own API). So this transport is the engine
transport (`engine.py`: engine-control fields as policy allows, the adapter's cut, the relay, the
settlement, the `ended` hooks, retries) with one part replaced, the HTTP client under the relay:

    chat body → `codec.request` (backends/hosted/) → credentials added (a key header, SigV4, a
    Vertex bearer) → the provider → its answer or stream read back by the codec → a chat completion
    or `chat.completion.chunk` SSE, usage on the last chunk

The relay, the fronts' renderings (gateway/apis/), the usage that settles the reservation (prompt,
completion, cached tokens) and the one ledger record are the engine path's, unchanged. Failures read
as an engine's do: a field the provider has no place for is a 400 naming it (`Untranslatable`), a
provider's refusal its status in the front's error shape, a retryable one (429, 529, throttling,
5xx) a 5xx the walk retries elsewhere or falls back from, a provider error mid-stream a cut stream.

Why aiohttp's client here and not the engine client (`gateway/upstream/client.py`, which speaks TLS
too): hosted calls leave the network the gateway runs in, through proxies (`HTTPS_PROXY`, honoured by
`trust_env`) and CDNs that compress and redirect, and a provider's latency dwarfs the client's CPU
cost that the engine client was written to save. Bedrock's path is sent exactly as signed
(`yarl.URL(..., encoded=True)`).

Credentials are resolved off the event loop at start-up (`HostedCalls.start`: an environment
variable's key, botocore's AWS chain, Google's application default credentials) and refreshed off
the loop before they expire, never per request.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import yarl
from aiohttp import web

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet, Pool
from backends.hosted import sigv4
from backends.hosted.anthropic import AnthropicCodec
from backends.hosted.azure_openai import AzureOpenAICodec
from backends.hosted.base import (
    ProviderCodec,
    ProviderError,
    ProviderStreamError,
    ProviderTarget,
    StreamDecoder,
    Untranslatable,
    UpstreamCall,
)
from backends.hosted.bedrock import BedrockCodec
from backends.hosted.breakpoints import with_breakpoints
from backends.hosted.gemini import GeminiCodec, VertexToken, api_key_headers, is_vertex
from backends.types import Endpoint
from gateway.errors import GatewayError
from gateway.request.context import RequestContext, Routed
from gateway.transport.engine import EngineTransport
from gateway.transport.provider_quota import ProviderQuotas
from gateway.upstream.client import CallWatch
from gateway.upstream.connection import UpstreamConnectionError
from gateway.upstream.relay import UpstreamTarget

log = logging.getLogger("tokenway.hosted")

CODECS: Mapping[str, type[Any]] = {
    "anthropic": AnthropicCodec,
    "bedrock": BedrockCodec,
    "gemini": GeminiCodec,
    "azure-openai": AzureOpenAICodec,
}
# Headers between the transport and its client only (taken out before anything is sent).
_ENDPOINT = "x-tokenway-hosted-endpoint"
_REFUSED = "x-tokenway-hosted-refused"
_REQUEST = "x-tokenway-hosted-request"
REFRESH_BEFORE_S = 300.0  # credentials that expire sooner are refreshed (off the loop) before the next call
DROPPED_HEADER = "x-tokenway-dropped-fields"


class HostedConfigError(RuntimeError):
    """A hosted pool cannot start: its key's environment variable is unset, no credentials found."""


def openai_error(status: int, kind: str, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """An error body in OpenAI's shape: what `EngineRejected` reads and the fronts render in their own."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


@dataclass(slots=True)
class Provider:
    """One hosted pool's provider: its codec, where and as what it calls, and its credentials."""

    pool: str
    engine: str
    codec: ProviderCodec
    target: ProviderTarget
    endpoint: str = ""  # the endpoint id: a pool's endpoints may each hold their own key or region
    key_env: str | None = None  # the environment variable of its key (the endpoint's, else the pool's)
    key_headers: dict[str, str] = field(default_factory=dict)
    region: str | None = None
    aws: sigv4.CredentialSource | None = None
    aws_credentials: sigv4.AwsCredentials | None = None
    vertex: VertexToken | None = None
    vertex_expiry: datetime.datetime | None = None
    refreshing: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, pool: PoolConfig, endpoint: str = "", static: StaticEndpointConfig | None = None) -> Provider:
        """The provider of one endpoint of `pool`: its own key or region (`static`) where it names one."""
        target = ProviderTarget(
            model=pool.upstream_model,
            api_version=pool.api_version,
            beta=tuple(pool.anthropic_beta),
            allow_drop=pool.allow_dropped_fields,
        )
        key_env = (static.api_key_env if static is not None else None) or pool.api_key_env
        region = (static.region if static is not None else None) or pool.region
        return cls(pool.name, pool.engine, CODECS[pool.engine](), target, endpoint, key_env, region=region)

    def resolve(self, pool: PoolConfig) -> None:
        """The credentials, once (blocking: run off the loop). HostedConfigError when there are none."""
        if self.key_env is not None:
            key = os.environ.get(self.key_env)
            if not key:
                raise HostedConfigError(f"pool {pool.name!r}: environment variable {self.key_env} is not set")
            if self.engine == "anthropic":
                self.key_headers = {"x-api-key": key}
            elif self.engine == "azure-openai":
                self.key_headers = {"api-key": key}
            else:
                self.key_headers = api_key_headers(key)
        if self.engine == "bedrock":
            self.aws = sigv4.CredentialSource()
            try:
                self.aws_credentials = self.aws.refresh()
            except sigv4.SigV4Error as exc:
                raise HostedConfigError(f"pool {pool.name!r}: {exc}") from None
        elif self.engine == "gemini" and is_vertex(self.target.model):
            self.vertex = VertexToken()
            self._refresh_vertex()

    def _refresh_vertex(self) -> None:
        assert self.vertex is not None
        token, self.vertex_expiry = self.vertex.refresh()
        self.key_headers = VertexToken.headers(token)

    def _refresh(self) -> None:
        if self.aws is not None:
            self.aws_credentials = self.aws.refresh()
        if self.vertex is not None:
            self._refresh_vertex()

    def expires_in_s(self) -> float | None:
        if self.aws_credentials is not None:
            return sigv4.CredentialSource.expires_in_s(self.aws_credentials)
        if self.vertex_expiry is not None:  # google-auth's expiry: naive UTC
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            return (self.vertex_expiry - now).total_seconds()
        return None

    def refresh_soon(self) -> None:
        """Credentials close to expiry are refreshed off the loop; calls sign with the current ones meanwhile."""
        left = self.expires_in_s()
        if left is None or left > REFRESH_BEFORE_S or (self.refreshing is not None and not self.refreshing.done()):
            return

        async def refresh() -> None:
            try:
                await asyncio.to_thread(self._refresh)
            except Exception as exc:  # keep the last credentials: the provider says when they are no good
                log.warning("pool %s: refreshing credentials failed: %s", self.pool, exc)

        self.refreshing = asyncio.get_running_loop().create_task(refresh())

    def authorised(self, call: UpstreamCall, base_url: str) -> dict[str, str]:
        """The call's headers with its credentials: SigV4 over these exact bytes, or the key / bearer."""
        if self.aws_credentials is not None:
            assert self.region is not None
            call = sigv4.sign(call, base_url, self.aws_credentials, self.region)
            return dict(call.headers)
        return {**dict(call.headers), **self.key_headers}


def _exhausted(headers: Mapping[str, str]) -> bool:
    """Whether a provider's answer says one of its limits has nothing left (`...-remaining...: 0`)."""
    return any(value == "0" and "remaining" in name.lower() for name, value in headers.items())


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _stamp(completion: dict[str, Any], request_id: str, created: int) -> dict[str, Any]:
    """Codecs are clock-free: the answer's `id` and `created` are the gateway's."""
    if not completion.get("id"):
        completion["id"] = f"chatcmpl-{request_id}"
    if not completion.get("created"):
        completion["created"] = created
    return completion


class HostedResponse:
    """A provider's answer as the relay reads an engine's (`gateway/upstream/client.Response`): status,
    headers, `read` / `next_chunk` of chat-completion JSON or SSE, `release` / `close`."""

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        *,
        upstream: aiohttp.ClientResponse | None = None,
        decoder: StreamDecoder | None = None,
        request_id: str = "",
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {"content-type": "text/event-stream" if decoder else "application/json"}
        self._body = body
        self._upstream = upstream
        self._decoder = decoder
        self._request_id = request_id
        self._created = int(time.time())
        self._ended = False

    async def read(self) -> bytes:
        if self._decoder is None:
            return self._body
        parts: list[bytes] = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes:
        """The stream's next chat chunks as SSE events (b"" at its end); a provider error inside the
        stream, or a broken connection, is `UpstreamConnectionError`: the relay cuts the client's stream."""
        decoder, upstream = self._decoder, self._upstream
        if decoder is None or upstream is None:
            body, self._body = self._body, b""
            return body
        while not self._ended:
            try:
                data = await upstream.content.readany()
                chunks = decoder.feed(data) if data else decoder.close()
            except ProviderStreamError as exc:
                self.close()
                raise UpstreamConnectionError(f"provider error mid-stream: {exc.error.message}") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.close()
                raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
            out = b"".join(
                b"data: " + orjson.dumps(_stamp(chunk, self._request_id, self._created)) + b"\n\n" for chunk in chunks
            )
            if not data:
                self.release()
                return out + b"data: [DONE]\n\n"
            if out:
                return out
        return b""

    def release(self) -> None:
        if not self._ended:
            self._ended = True
            if self._upstream is not None:
                self._upstream.release()

    def close(self) -> None:
        """Drop the provider's connection now (a client that went away stops the generation it pays for)."""
        if not self._ended:
            self._ended = True
            if self._upstream is not None:
                self._upstream.close()

    async def __aenter__(self) -> HostedResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class HostedCalls:
    """The client under the relay for hosted pools: `post` as the engine client's, the provider's
    answer read back into chat completions by the pool's codec."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float | None = 600.0,
        quotas: ProviderQuotas | None = None,
    ) -> None:
        self.pools = {pool.name: pool.config for pool in fleet.pools.values() if pool.config.hosted}
        self.quotas = quotas  # what each provider says of its own limits, learnt (provider_quota.py)
        # one provider per endpoint: a pool's endpoints may be several keys or regions, balanced by routing
        self.providers = {
            endpoint.id: Provider.of(pool.config, endpoint.id, static)
            for pool in fleet.pools.values()
            if pool.config.hosted
            for endpoint, static in zip(pool.endpoints, pool.config.endpoints, strict=False)
        }
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Credentials resolved off the loop (files, IMDS, token endpoints may block); HostedConfigError
        when a pool has none: the gateway does not start half-configured."""
        for provider in self.providers.values():
            await asyncio.to_thread(provider.resolve, self.pools[provider.pool])
        self._session = aiohttp.ClientSession(
            trust_env=True,
            auto_decompress=True,
            timeout=aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def call(self, ctx: RequestContext, endpoint: Endpoint, chat: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
        """The URL, headers and body of `chat` for `endpoint`'s provider; a refusal (a field with no
        counterpart) is carried to `post` as a 400 naming the field. Dropped fields are named on the answer."""
        provider = self.providers[endpoint.id]
        marks = {_ENDPOINT: endpoint.id, _REQUEST: ctx.facts.request_id}
        config = self.pools[endpoint.pool]
        if config.cache_breakpoints == "auto":  # the provider caches only where told (breakpoints.py)
            chat = with_breakpoints(chat, config.cache_breakpoint_min_tokens, config.cache_breakpoint_ttl)
        try:
            call = provider.codec.request(chat, provider.target)
        except Untranslatable as exc:
            body = openai_error(400, "invalid_request_error", exc.message, exc.param, "untranslatable_field")
            return endpoint.base_url, {**marks, _REFUSED: "1"}, body
        if call.dropped:
            ctx.headers.append((DROPPED_HEADER, ",".join(call.dropped)))
        provider.refresh_soon()
        headers = provider.authorised(call, endpoint.base_url)
        return endpoint.base_url + call.path, {**headers, **marks}, call.body

    async def post(
        self, url: str, headers: Mapping[str, str], body: bytes, watch: CallWatch | None = None
    ) -> HostedResponse:
        """Send the call; the answer as chat completions (or an OpenAI-shaped error with the status the
        walk acts on). Raises UpstreamConnectionError or TimeoutError as the engine client does."""
        sent = dict(headers)
        provider = self.providers[sent.pop(_ENDPOINT)]
        request_id = sent.pop(_REQUEST, "")
        if sent.pop(_REFUSED, None):
            return HostedResponse(400, body)
        if self._session is None:
            raise UpstreamConnectionError("the hosted client is not started")
        stream = (
            sent.get("accept") == "text/event-stream"
            or ":streamGenerateContent" in url
            or url.endswith("/converse-stream")
        )
        try:
            response = await self._session.post(yarl.URL(url, encoded=True), headers=sent, data=body)
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if response.status != 200:
            return await self._refused(provider, response)
        if self.quotas is not None and _exhausted(response.headers):  # parsed only when a limit ran out
            self.quotas.observe(provider.endpoint, provider.codec.rate_limits(_lower(response.headers)))
        if stream:
            return HostedResponse(
                200, upstream=response, decoder=provider.codec.stream(provider.target), request_id=request_id
            )
        try:
            raw = await response.read()
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            response.release()
        try:
            completion, usage = provider.codec.answer(raw, provider.target)
        except (ValueError, KeyError, TypeError) as exc:  # not the provider's documented answer
            return HostedResponse(502, openai_error(502, "api_error", f"unreadable provider answer: {exc}"))
        completion = _stamp(completion, request_id, int(time.time()))
        completion["usage"] = usage.chat_usage()
        return HostedResponse(200, orjson.dumps(completion))

    async def _refused(self, provider: Provider, response: aiohttp.ClientResponse) -> HostedResponse:
        """A provider's error: its own status when the request is at fault (the front's error shape);
        a 5xx when another pool or model may serve it (throttling, overload, the provider's 5xx)."""
        try:
            raw = await response.read()
        except aiohttp.ClientError:
            raw = b""
        finally:
            response.release()
        error: ProviderError = provider.codec.error(response.status, _lower(response.headers), raw)
        if self.quotas is not None and (response.status in (429, 529) or error.kind == "rate_limit_error"):
            self.quotas.throttled(provider.endpoint, error.retry_after_s)
        status = error.status
        if error.retryable and status < 500:
            status = 503  # throttled: the walk tries another endpoint, then the fallback chain
        log.warning("pool %s: provider answered %d (%s): %s", provider.pool, response.status, error.kind, error.message)
        return HostedResponse(
            status, openai_error(status, error.kind, error.message, code=f"provider_{response.status}")
        )


class HostedTransport(EngineTransport):
    """The engine transport over `HostedCalls`: the walk's contract kept by the same code."""

    def __init__(self, *, calls: HostedCalls, **kwargs: Any) -> None:
        super().__init__(upstream=calls, **kwargs)  # type: ignore[arg-type]  # HostedCalls quacks as UpstreamClient
        self.calls = calls

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> web.StreamResponse:
        # no first-token deadline: a provider's latency is not a stalled replica, and its call cannot be cut by a watch
        return await super().send(ctx, routed, last=True)

    def target(self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], path: str) -> UpstreamTarget:
        url, headers, data = self.calls.call(ctx, endpoint, body)
        return UpstreamTarget(
            url=url, headers=headers, body=data, served_model=endpoint.served_model, public_model=ctx.model
        )


class PoolTransports:
    """The walk's one transport where hosted pools exist: each routed attempt goes to the transport of
    its pool (hosted or engine); refusals and routing are the engine transport's."""

    follows = False

    def __init__(self, engine: EngineTransport, hosted: HostedTransport) -> None:
        self.engine = engine
        self.hosted = hosted

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        return self.engine.unreachable(pools)

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> web.StreamResponse:
        transport = self.hosted if routed.pool.config.hosted else self.engine
        return await transport.send(ctx, routed, last=last)

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        return self.engine.refuse(ctx, error, headers)
