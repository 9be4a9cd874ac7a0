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

Two HTTP clients, chosen once per provider endpoint at start (`proxy_for`): where urllib's proxy
rules (`HTTPS_PROXY` / `HTTP_PROXY` by scheme, else `ALL_PROXY`, minus `NO_PROXY`) give the endpoint's
host no proxy, the engine client (`gateway/upstream/client.py`: TLS with the system CAs and SNI,
keep-alive pools, chunked bodies, connect and read timeouts) carries the call; it costs a fraction of
aiohttp's client per call (bench/results/overhead-translation.md), and a provider's API needs nothing
more: the call is a POST of JSON answered with JSON or a chunked stream. No `accept-encoding` is sent;
an answer compressed anyway (gzip, deflate) is inflated here. Where a proxy applies, aiohttp's client
carries it, as it knows proxies' CONNECT tunnels, given the proxy and its credentials found at start
(`aiohttp_proxy`: what `trust_env` would look up per call, in a worker thread). Either way Bedrock's
path is sent exactly as signed (the engine client sends the path as given; aiohttp gets
`yarl.URL(..., encoded=True)`).

First-token deadline (a pool's `first_token_timeout_s`, off unless set): a stream that has shown its
client nothing that long after the call began is cut (the call's connection dropped, over either
client) and fails as a failure before the first byte does: the walk sends it to another endpoint of
the pool, then down the fallback chain; the attempt is not charged. It is the engine path's watch
(`gateway/upstream/replica_loss.py`) with two differences, as a provider is not a replica: the deadline is
the pool's fixed number, not a multiple of a predicted TTFT, and it is armed on every try, the last
included, since the operator set it as the longest wait worth having; and a provider that misses it
is never judged stalled (it stays in routing: slow is not frozen). Once a token reached the client,
nothing cuts the stream. Off by default: a provider may bill a call cut mid-prefill, and its TTFT
varies by model and prompt length far more than an engine's.

Credentials are resolved off the event loop at start-up (`HostedCalls.start`: an environment
variable's key, botocore's AWS chain, Google's application default credentials, an Entra ID token
for Azure's `auth: entra`) and refreshed off the loop before they expire, never per request.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
import urllib.request
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import aiohttp
import orjson
import yarl
from aiohttp import web
from aiohttp.helpers import get_env_proxy_for_url, strip_auth_from_url

from backends.config import EjectionSettings, PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet, Pool
from backends.hosted.anthropic import AnthropicCodec
from backends.hosted.aws import AwsCredentials, CredentialSource, SigV4Error, sign
from backends.hosted.azure_openai import AzureOpenAICodec, EntraToken
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
from backends.hosted.chat_in import with_breakpoints
from backends.hosted.gemini import GeminiCodec, VertexToken, api_key_headers, is_vertex
from backends.types import Endpoint
from gateway.errors import GatewayError
from gateway.request.context import RequestContext, Routed
from gateway.transport.engine import EngineTransport
from gateway.transport.provider_quota import ProviderQuotas
from gateway.upstream.client import CallWatch, UpstreamClient, UpstreamConnectionError
from gateway.upstream.relay import UpstreamTarget
from gateway.upstream.replica_loss import DEADLINE, StallWatch
from predictor.features import Prediction

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
_MODEL = "x-tokenway-hosted-model"
REFRESH_BEFORE_S = 300.0  # credentials that expire sooner are refreshed (off the loop) before the next call
DROPPED_HEADER = "x-tokenway-dropped-fields"
USER_AGENT = "tokenway"  # the engine client sends no User-Agent of its own; some edges refuse calls without one
IDLE_TIMEOUT_S = 15.0  # a provider connection idle longer is not reused (aiohttp's keep-alive default)


def proxy_for(url: str) -> str | None:
    """The proxy a call to `url` goes through under urllib's rules (the environment's `https_proxy` /
    `http_proxy` for its scheme, else `all_proxy`; none when `no_proxy` covers its host), as aiohttp's
    `trust_env` reads them; None when it goes direct. Read once per endpoint at start."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or (parts.hostname and urllib.request.proxy_bypass(parts.hostname)):
        return None
    return proxy


def aiohttp_proxy(url: str, proxy: str) -> tuple[yarl.URL | None, dict[str, str] | None]:
    """`proxy` (what `proxy_for(url)` chose) as aiohttp's client is given it, with its credentials:
    the environment's entry for `url`'s scheme read as aiohttp's `trust_env` reads it (credentials from
    the URL, else netrc: blocking), else an http:// `all_proxy`; (None, None) for a proxy aiohttp cannot
    speak (socks, https). Read once per endpoint at start, not per call as `trust_env` would."""
    try:
        found, auth = get_env_proxy_for_url(yarl.URL(url))
    except LookupError:  # aiohttp reads no all_proxy: take it as given
        found, auth = strip_auth_from_url(yarl.URL(proxy))
        if found.scheme != "http":
            return None, None
    return found, ({"Proxy-Authorization": auth.encode()} if auth is not None else None)


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
    aws: CredentialSource | None = None
    aws_credentials: AwsCredentials | None = None
    vertex: VertexToken | None = None
    vertex_expiry: datetime.datetime | None = None
    entra: EntraToken | None = None  # `auth: entra` (Azure OpenAI); set before `resolve` to use another credential
    entra_expiry_s: float | None = None  # epoch seconds
    refreshing: asyncio.Task[None] | None = None
    proxy: str | None = None  # set at start: the proxy its calls go through (aiohttp), None for direct ones
    proxy_url: yarl.URL | None = None  # that proxy as aiohttp is given it (None: one aiohttp cannot use)
    proxy_headers: dict[str, str] | None = None  # its credentials (`Proxy-Authorization`), from the URL or netrc

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
            self.aws = CredentialSource()
            try:
                self.aws_credentials = self.aws.refresh()
            except SigV4Error as exc:
                raise HostedConfigError(f"pool {pool.name!r}: {exc}") from None
        elif self.engine == "gemini" and is_vertex(self.target.model):
            self.vertex = VertexToken()
            self._refresh_vertex()
        elif self.engine == "azure-openai" and pool.auth == "entra":
            self.entra = self.entra or EntraToken()
            try:
                self._refresh_entra()
            except Exception as exc:  # azure-identity's CredentialUnavailableError, ClientAuthenticationError, ...
                raise HostedConfigError(f"pool {pool.name!r}: no Entra ID token: {exc}") from None

    def _refresh_entra(self) -> None:
        assert self.entra is not None
        token, self.entra_expiry_s = self.entra.refresh()
        self.key_headers = EntraToken.headers(token)

    def _refresh_vertex(self) -> None:
        assert self.vertex is not None
        token, self.vertex_expiry = self.vertex.refresh()
        self.key_headers = VertexToken.headers(token)

    def _refresh(self) -> None:
        if self.aws is not None:
            self.aws_credentials = self.aws.refresh()
        if self.vertex is not None:
            self._refresh_vertex()
        if self.entra is not None:
            self._refresh_entra()

    def expires_in_s(self) -> float | None:
        if self.aws_credentials is not None:
            return CredentialSource.expires_in_s(self.aws_credentials)
        if self.vertex_expiry is not None:  # google-auth's expiry: naive UTC
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            return (self.vertex_expiry - now).total_seconds()
        if self.entra_expiry_s is not None:
            return self.entra_expiry_s - time.time()
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
            call = sign(call, base_url, self.aws_credentials, self.region)
            return dict(call.headers)
        return {**dict(call.headers), **self.key_headers}


# What a codec raises reading an answer that is not the provider's documented one (a field of the
# wrong type, JSON that is not JSON, a missing key): the answer is unreadable, a 502 (or, mid-stream,
# a cut the relay reports), never a request meeting a bug. Found by bench/chaos/upstream_fuzz.py.
UNREADABLE: Final = (ValueError, KeyError, TypeError, AttributeError, IndexError)


def _exhausted(headers: Mapping[str, str]) -> bool:
    """Whether a provider's answer says one of its limits has nothing left (`...-remaining...: 0`);
    `headers` with lower-case names, as both clients' answers are read here."""
    if "0" not in headers.values():  # the usual answer: one scan in C, no header looked at by name
        return False
    return any(value == "0" and "remaining" in name for name, value in headers.items())


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _stamp(completion: dict[str, Any], request_id: str, created: int, model: str) -> dict[str, Any]:
    """Codecs are clock-free: the answer's `id` and `created` are the gateway's; its `model` is the name
    the client asked for (written here, so the relay has no model name to swap)."""
    if not completion.get("id"):
        completion["id"] = f"chatcmpl-{request_id}"
    if not completion.get("created"):
        completion["created"] = created
    if model:
        completion["model"] = model
    return completion


class _Body(Protocol):
    """A provider's answer body as either HTTP client hands it over (the engine client's `Response`
    is one as it is); failures are `UpstreamConnectionError` or `TimeoutError`."""

    async def read(self) -> bytes: ...

    async def next_chunk(self) -> bytes: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class _ProxiedCall:
    """A proxied call (aiohttp's client) as a first-token deadline sees it (`CallWatch.attach`): `abort`
    cancels the call while its head is awaited, and closes its answer after; whatever read comes next
    fails as a dropped connection does (aiohttp may read a closed answer as a clean end)."""

    __slots__ = ("aborted", "last_data_s", "pending", "response")

    def __init__(self) -> None:
        self.aborted = False
        self.last_data_s = 0.0
        self.pending: asyncio.Future[aiohttp.ClientResponse] | None = None
        self.response: aiohttp.ClientResponse | None = None

    def abort(self) -> None:
        self.aborted = True
        if self.response is not None:
            self.response.close()
        elif self.pending is not None:
            self.pending.cancel()

    def check(self) -> None:
        if self.aborted:
            raise UpstreamConnectionError("the call was cut")


class _AiohttpBody:
    """aiohttp's response (the proxied path) as a `_Body`, its errors as the engine client's."""

    __slots__ = ("_call", "_response")

    def __init__(self, response: aiohttp.ClientResponse, call: _ProxiedCall | None = None) -> None:
        self._response = response
        self._call = call

    async def read(self) -> bytes:
        try:
            data = await self._response.read()
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if self._call is not None:
            self._call.check()
        return data

    async def next_chunk(self) -> bytes:
        try:
            data = await self._response.content.readany()
        except aiohttp.ClientError as exc:
            if self._call is not None:
                self._call.check()
            raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if self._call is not None:
            self._call.check()
            self._call.last_data_s = time.monotonic()
        return data

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


INFLATED = frozenset({"gzip", "x-gzip", "deflate"})


class _Inflated:
    """A body the provider compressed although no `accept-encoding` asked for it (a CDN may): inflated
    as it arrives (zlib reads both gzip and zlib-wrapped deflate with `wbits=47`)."""

    __slots__ = ("_body", "_zlib")

    def __init__(self, body: _Body) -> None:
        self._body = body
        self._zlib = zlib.decompressobj(wbits=47)

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes:
        try:
            while data := await self._body.next_chunk():
                if out := self._zlib.decompress(data):
                    return out
            return self._zlib.flush()
        except zlib.error as exc:
            self._body.close()
            raise UpstreamConnectionError(f"the provider's compressed answer is corrupt: {exc}") from None

    def release(self) -> None:
        self._body.release()

    def close(self) -> None:
        self._body.close()


class HostedResponse:
    """A provider's answer as the relay reads an engine's (`gateway/upstream/client.Response`): status,
    headers, `read` / `next_chunk` of chat-completion JSON or SSE, `release` / `close`."""

    __slots__ = ("_body", "_created", "_decoder", "_ended", "_model", "_request_id", "_upstream", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        *,
        upstream: _Body | None = None,
        decoder: StreamDecoder | None = None,
        request_id: str = "",
        model: str = "",
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = _SSE_HEADERS if decoder else _JSON_HEADERS
        self._body = body
        self._upstream = upstream
        self._decoder = decoder
        self._request_id = request_id
        self._model = model
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
                data = await upstream.next_chunk()
                chunks = decoder.feed(data) if data else decoder.close()
            except ProviderStreamError as exc:
                self.close()
                raise UpstreamConnectionError(f"provider error mid-stream: {exc.error.message}") from None
            except UNREADABLE as exc:  # not the provider's documented stream
                self.close()
                raise UpstreamConnectionError(f"unreadable provider stream: {type(exc).__name__}: {exc}") from None
            except UpstreamConnectionError:
                self.close()
                raise
            except TimeoutError as exc:
                self.close()
                raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
            out = b"".join(
                b"data: " + orjson.dumps(_stamp(chunk, self._request_id, self._created, self._model)) + b"\n\n"
                for chunk in chunks
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


_SSE_HEADERS: Mapping[str, str] = {"content-type": "text/event-stream"}
_JSON_HEADERS: Mapping[str, str] = {"content-type": "application/json"}


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
        self.base_urls = {
            endpoint.id: endpoint.base_url
            for pool in fleet.pools.values()
            if pool.config.hosted
            for endpoint in pool.endpoints
        }
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._direct: UpstreamClient | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Credentials resolved off the loop (files, IMDS, token endpoints may block); HostedConfigError
        when a pool has none: the gateway does not start half-configured. Each endpoint's client is
        chosen here, once: aiohttp's where a proxy applies to its host, else the engine client."""
        for provider in self.providers.values():
            await asyncio.to_thread(provider.resolve, self.pools[provider.pool])
            base_url = self.base_urls.get(provider.endpoint, "")
            provider.proxy = proxy_for(base_url)
            if provider.proxy is not None:  # netrc may be read: off the loop
                provider.proxy_url, provider.proxy_headers = await asyncio.to_thread(
                    aiohttp_proxy, base_url, provider.proxy
                )
                log.info("pool %s: calls go through the proxy the environment names", provider.pool)
                if provider.proxy_url is None:
                    log.warning(
                        "pool %s: the proxy %s is not one aiohttp can use: calls go direct",
                        provider.pool,
                        provider.proxy,
                    )
        self._direct = UpstreamClient(
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            idle_timeout_s=IDLE_TIMEOUT_S,
        )
        if any(provider.proxy is not None for provider in self.providers.values()):
            self._session = aiohttp.ClientSession(  # the proxy is given per call: decided above, once
                auto_decompress=True,
                timeout=aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s),
            )

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()
            self._direct = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def proxied(self, endpoint_id: str) -> bool:
        """Whether `endpoint_id`'s calls go through a proxy (aiohttp's client), as decided at start."""
        return self.providers[endpoint_id].proxy is not None

    def call(self, ctx: RequestContext, endpoint: Endpoint, chat: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
        """The URL, headers and body of `chat` for `endpoint`'s provider; a refusal (a field with no
        counterpart) is carried to `post` as a 400 naming the field. Dropped fields are named on the answer."""
        url, headers, body, dropped = self.prepare(endpoint, chat, ctx.facts.request_id, ctx.model)
        if dropped:
            ctx.headers.append((DROPPED_HEADER, ",".join(dropped)))
        return url, headers, body

    def prepare(
        self, endpoint: Endpoint, chat: dict[str, Any], request_id: str, model: str
    ) -> tuple[str, dict[str, str], bytes, tuple[str, ...]]:
        """`call` without the request's context: URL, headers (the marks `post` reads included), body,
        and the fields dropped. `model` is the name the client asked for, written into the answer."""
        provider = self.providers[endpoint.id]
        marks = {_ENDPOINT: endpoint.id, _REQUEST: request_id, _MODEL: model}
        config = self.pools[endpoint.pool]
        if config.cache_breakpoints == "auto":  # the provider caches only where told (backends/hosted/chat_in.py)
            chat = with_breakpoints(chat, config.cache_breakpoint_min_tokens, config.cache_breakpoint_ttl)
        try:
            call = provider.codec.request(chat, provider.target)
        except Untranslatable as exc:
            body = openai_error(400, "invalid_request_error", exc.message, exc.param, "untranslatable_field")
            return endpoint.base_url, {**marks, _REFUSED: "1"}, body, ()
        provider.refresh_soon()
        headers = provider.authorised(call, endpoint.base_url)
        headers.update(marks)
        return endpoint.base_url + call.path, headers, call.body, call.dropped

    async def post(
        self, url: str, headers: Mapping[str, str], body: bytes, watch: CallWatch | None = None
    ) -> HostedResponse:
        """Send the call; the answer as chat completions (or an OpenAI-shaped error with the status the
        walk acts on). Raises UpstreamConnectionError or TimeoutError as the engine client does."""
        sent = dict(headers)
        provider = self.providers[sent.pop(_ENDPOINT)]
        request_id = sent.pop(_REQUEST, "")
        model = sent.pop(_MODEL, "")
        if sent.pop(_REFUSED, None):
            return HostedResponse(400, body)
        stream = (
            sent.get("accept") == "text/event-stream"
            or ":streamGenerateContent" in url
            or url.endswith("/converse-stream")
        )
        status, answer_headers, upstream = await self._send(provider, url, sent, body, watch)
        if status != 200:
            return await self._refused(provider, status, answer_headers, upstream)
        encoding = answer_headers.get("content-encoding", "identity").lower()
        if encoding in INFLATED:
            upstream = _Inflated(upstream)
        elif encoding != "identity":  # none was asked for: nothing the codec could read
            upstream.close()
            message = f"unreadable provider answer: content-encoding {encoding!r}"
            return HostedResponse(502, openai_error(502, "api_error", message))
        if self.quotas is not None and _exhausted(answer_headers):  # parsed only when a limit ran out
            self.quotas.observe(provider.endpoint, provider.codec.rate_limits(answer_headers))
        if stream:
            decoder = provider.codec.stream(provider.target)
            return HostedResponse(200, upstream=upstream, decoder=decoder, request_id=request_id, model=model)
        try:
            raw = await upstream.read()
        finally:
            upstream.release()
        try:
            completion, _ = provider.codec.answer(raw, provider.target)
        except UNREADABLE as exc:  # not the provider's documented answer
            return HostedResponse(502, openai_error(502, "api_error", f"unreadable provider answer: {exc}"))
        return HostedResponse(200, orjson.dumps(_stamp(completion, request_id, int(time.time()), model)))

    async def _send(
        self, provider: Provider, url: str, headers: dict[str, str], body: bytes, watch: CallWatch | None = None
    ) -> tuple[int, Mapping[str, str], _Body]:
        """The call over the endpoint's client: the answer's status, headers (lower-case names) and body.
        A `watch` with a deadline armed may cut it (either client); an unarmed one is not attached."""
        watch = watch if watch is not None and watch.armed else None
        if provider.proxy is None:
            if self._direct is None:
                raise UpstreamConnectionError("the hosted client is not started")
            headers.setdefault("user-agent", USER_AGENT)
            response = await self._direct.post(url, headers, body, watch)
            return response.status, response.headers, response
        if self._session is None:
            raise UpstreamConnectionError("the hosted client is not started")
        call = None
        posting = self._session.post(
            yarl.URL(url, encoded=True),
            headers=headers,
            data=body,
            proxy=provider.proxy_url,
            proxy_headers=provider.proxy_headers,
        )
        try:
            if watch is None:
                answer = await posting
            else:
                call = _ProxiedCall()
                call.pending = asyncio.ensure_future(posting)
                watch.attach(call)
                try:
                    answer = await call.pending
                except asyncio.CancelledError:
                    if not call.aborted:  # the request itself was cancelled (its client left)
                        raise
                    raise UpstreamConnectionError(f"the call was cut: {watch.reason}") from None
                call.response = answer
                if call.aborted:  # cut as its head arrived
                    answer.close()
                    call.check()
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"{type(exc).__name__}: {exc}") from exc
        answer_headers = _lower(answer.headers)
        answer_headers.pop("content-encoding", None)  # aiohttp inflates what it asked for (auto_decompress)
        return answer.status, answer_headers, _AiohttpBody(answer, call)

    async def _refused(
        self, provider: Provider, status: int, headers: Mapping[str, str], upstream: _Body
    ) -> HostedResponse:
        """A provider's error: its own status when the request is at fault (the front's error shape);
        a 5xx when another pool or model may serve it (throttling, overload, the provider's 5xx)."""
        try:
            raw = await upstream.read()
        except (UpstreamConnectionError, TimeoutError):
            raw = b""
        finally:
            upstream.release()
        error: ProviderError = provider.codec.error(status, headers, raw)
        if self.quotas is not None and (status in (429, 529) or error.kind == "rate_limit_error"):
            self.quotas.throttled(provider.endpoint, error.retry_after_s)
        answered = error.status
        if error.retryable and answered < 500:
            answered = 503  # throttled: the walk tries another endpoint, then the fallback chain
        log.warning("pool %s: provider answered %d (%s): %s", provider.pool, status, error.kind, error.message)
        return HostedResponse(answered, openai_error(answered, error.kind, error.message, code=f"provider_{status}"))


class HostedDeadlines(StallWatch):
    """The engine path's watch with the hosted rules (module docstring): a pool's fixed
    `first_token_timeout_s`, and no stall verdicts (its `check` is never run: the app runs the engine
    transport's watch only)."""

    def arm(self, watch: CallWatch, prediction: Prediction | None) -> None:
        entry = self._calls.get(watch.endpoint_id)
        pool = self.fleet.pools.get(entry[0].pool) if entry is not None else None
        seconds = pool.config.first_token_timeout_s if pool is not None else None
        if seconds is not None:
            watch.arm(seconds, DEADLINE)

    def missed_first_token(self, endpoint: Endpoint) -> None:
        """A slow provider is not a frozen replica: it stays in routing (its request moved on)."""


class HostedTransport(EngineTransport):
    """The engine transport over `HostedCalls`: the walk's contract kept by the same code."""

    def __init__(self, *, calls: HostedCalls, **kwargs: Any) -> None:
        server, fleet = kwargs["server"], kwargs["fleet"]
        kwargs.setdefault(
            "stalls", HostedDeadlines(fleet, server.first_token_deadline, server.stall_after_s, EjectionSettings())
        )
        super().__init__(upstream=calls, **kwargs)  # type: ignore[arg-type]  # HostedCalls quacks as UpstreamClient
        self.calls = calls

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> web.StreamResponse:
        # the pool's first-token deadline, where it sets one, on every try (`HostedDeadlines`); else none
        return await super().send(ctx, routed, last=routed.pool.config.first_token_timeout_s is None)

    def target(self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], path: str) -> UpstreamTarget:
        url, headers, data = self.calls.call(ctx, endpoint, body)
        return UpstreamTarget(
            # the answer already names the public model (`_stamp`): nothing for the relay to swap
            url=url,
            headers=headers,
            body=data,
            served_model=ctx.model,
            public_model=ctx.model,
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
