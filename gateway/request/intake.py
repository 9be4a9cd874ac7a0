"""Intake: from the HTTP request to the request's frozen facts.

authenticate (headers only) → read (size limit, read deadline, memory budget: gateway/http/bodies.py) →
one orjson parse (nesting bounded) → validate (the API's own checks) → resolve the model (alias,
allow-list, served here) → a look at the limits (no room left: 429 before the prompt is counted) →
estimate (prompt tokens, output reservation, the effective SLO). Every failure is a 4xx from the
error tree; nothing after intake re-reads the body, and its budget is given back when intake ends.

Headers are read safely: values reach aiohttp as bytes and come out as `str` with undecodable bytes
kept as lone surrogates, which fail the moment anything encodes them (a digest, a log line, a ledger
record, a forwarded header). So every header read here is either checked (an API key with such bytes
is simply not a key: 401) or replaced (a request id that is not short visible ASCII gets a generated
one). Session keys are bounded where they are kept (`policies/routing/session.py`).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from backends.fleet import Fleet
from gateway.app.settings import ServerSettings
from gateway.errors import (
    InvalidApiKey,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    Rejected,
    RequestTimeout,
    RequestTooLarge,
)
from gateway.http.bodies import NOT_PARSED, BoundedRequest, cached_json, forget_raw, parse_json_body, release_body
from gateway.request.context import RequestContext
from gateway.request.debug import debug_allowed
from gateway.request.program import program_id
from gateway.request.subjects import request_subjects
from gateway.upstream.engine_control import check_min_tokens
from policies.engine_fields import cache_salt as engine_cache_salt
from policies.engine_fields import client_body
from policies.estimate import PromptEstimator, output_reservation
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.program import RunawayGuard
from policies.slo import effective_slo
from policies.types import Principal, Rejection, RequestFacts

SLO_TTFT_HEADER: Final = "x-slo-ttft-ms"
SLO_TPOT_HEADER: Final = "x-slo-tpot-ms"
_MAX_SLO_MS: Final = 86_400_000.0  # a day: anything longer is a typo, not an objective
_DEFAULT_MAX_TOKENS: Final = 1024  # a model without a policies.yaml entry
MAX_REQUEST_ID_CHARS: Final = 128
_REQUEST_ID: Final = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
INVALID_KEY: Final = "\x00invalid"  # no stored key can hash to this: keys never contain NUL


Precheck = Callable[[Principal, str], Awaitable[Rejection | None]]


def encodable(value: str) -> bool:
    """True when `value` is valid text (no undecodable bytes smuggled in as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def request_id(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id` when it is 1-128 visible ASCII characters, else a generated one
    (it is echoed in a response header, forwarded to the engine and written to the ledger)."""
    presented = headers.get("x-request-id")
    if presented and _REQUEST_ID.fullmatch(presented):
        return presented
    return os.urandom(16).hex()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key of `Authorization: Bearer KEY` or `x-api-key: KEY`, or None when none is given.

    A key that is not valid text cannot match any stored digest: it is returned as a marker that
    authenticates nobody, so the caller answers 401 like any wrong key.
    """
    auth = headers.get("Authorization")
    key: str | None = None
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            key = token.strip()
    if key is None:
        raw = headers.get("x-api-key")
        key = raw.strip() if raw else None
    if key is not None and not encodable(key):
        return INVALID_KEY
    return key or None


def authenticate(request: web.Request | Mapping[str, str], policy: Policy) -> Principal:
    """The caller's principal from its headers (an aiohttp request's, or the endpoint picker's)."""
    key = presented_key(request.headers if isinstance(request, web.Request) else request)
    if key is None:
        raise InvalidApiKey(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
        )
    principal = policy.authenticate(key)
    if principal is None:
        raise InvalidApiKey("Incorrect API key provided.")
    return principal


def parse_slo_headers(headers: Mapping[str, str]) -> tuple[float | None, float | None]:
    """(ttft_ms, tpot_ms) from `x-slo-ttft-ms` / `x-slo-tpot-ms`, None where absent; a 400 naming the
    header when malformed (a silently ignored typo would be an SLO the client believes it has)."""
    return _header_ms(headers, SLO_TTFT_HEADER), _header_ms(headers, SLO_TPOT_HEADER)


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (0 < value <= _MAX_SLO_MS):  # NaN fails too
        raise InvalidRequest(
            f"Invalid '{name}' header {raw[:40]!r}: expected a positive number of milliseconds "
            f"(at most {_MAX_SLO_MS:.0f}).",
            param=name,
        )
    return value


class Intake:
    def __init__(
        self,
        server: ServerSettings,
        policies: PolicyHolder,
        fleet: Fleet,
        estimator: PromptEstimator,
        precheck: Precheck | None = None,
    ) -> None:
        self.server = server
        self.policies = policies
        self.fleet = fleet
        self.estimator = estimator
        self.precheck = precheck  # Admission.precheck: limits with no room left, before the count
        self.runaway = RunawayGuard()  # per tenant, per program: bounded (policies/program.py)

    async def read(self, ctx: RequestContext) -> RequestFacts:
        """The caller first (a wrong key costs no body read), then the body under the bounds of
        `gateway/http/bodies.py`; its budget is given back once it has been parsed and counted."""
        request = ctx.http
        assert request is not None
        principal = self._principal(ctx, request.headers)
        try:
            raw = await self._read_body(request)
            parsed = cached_json(request)
            if parsed is not NOT_PARSED:  # one copy of the body while it is counted: the parsed one
                raw = b""
                forget_raw(request)
            return await self.facts(ctx, raw, request.headers, principal=principal, parsed=parsed)
        finally:
            release_body(request)

    async def facts(
        self,
        ctx: RequestContext,
        raw: bytes,
        headers: Mapping[str, str],
        *,
        principal: Principal | None = None,
        parsed: Any = NOT_PARSED,
    ) -> RequestFacts:
        """The facts of a body already read (`read`, or the endpoint picker's, which Envoy sent):
        one parse (nesting bounded; `parsed` when the reader did it), the API's checks, the caller,
        the model, a look at the limits (no room left: refused before the prompt is counted), the count."""
        if parsed is NOT_PARSED:
            parsed = parse_json_body(raw)
        body = ctx.api.parse(parsed)
        ctx.record.program = program_id(headers, body)  # before any refusal: it is on every record
        policy = self.policies.current
        if principal is None:
            principal = self._principal(ctx, headers)
        body, requested, model = await self._resolve(ctx, policy, body, principal)
        if ctx.record.program is not None:
            self._check_program(policy, principal, ctx.record.program, body)
        if self.precheck is not None:
            rejection = await self.precheck(principal, model)
            if rejection is not None:
                raise Rejected(rejection)
        return await self._estimate(ctx, headers, policy, body, principal, requested, model)

    def _check_program(self, policy: Policy, principal: Principal, program: str, body: dict[str, Any]) -> None:
        """The runaway guard (policies/program.py), where the caller's tenant sets it: one look-up if not."""
        tenant = policy.config.tenants.get(principal.tenant)
        if tenant is not None and tenant.program_max_repeats is not None:
            rejection = self.runaway.check(
                principal.tenant, program, body, tenant.program_max_repeats, tenant.program_max_cycle
            )
            if rejection is not None:
                raise Rejected(rejection)

    def _principal(self, ctx: RequestContext, headers: Mapping[str, str]) -> Principal:
        with ctx.trace.span("auth"):
            principal = authenticate(headers, self.policies.current)
        ctx.record.tenant, ctx.record.key_id = principal.tenant, principal.key_id
        return principal

    async def line(self, ctx: RequestContext, parsed: object, principal: Principal, batch_id: str) -> RequestFacts:
        """The facts of a request made inside the gateway: a batch line, its body already parsed, its
        caller the key that created the batch. It has no latency objective (the batch's window is
        its deadline) and carries its batch id: admission prices it at the batch price."""
        body = ctx.api.parse(parsed)
        policy = self.policies.current
        ctx.record.tenant, ctx.record.key_id = principal.tenant, principal.key_id
        ctx.record.batch_id = batch_id
        ctx.record.program = program_id({}, body)  # a batch line names its program in its body, if at all
        body, requested, model = await self._resolve(ctx, policy, body, principal)
        return await self._estimate(ctx, {}, policy, body, principal, requested, model, batch_id=batch_id)

    async def internal(self, ctx: RequestContext, parsed: object, principal: Principal) -> RequestFacts:
        """The facts of a request the gateway makes for an operator (the console's model check,
        gateway/console/check.py): its body already parsed, its caller a principal no key
        authenticates as; admitted, priced and recorded like any request, never a fallback."""
        body = ctx.api.parse(parsed)
        policy = self.policies.current
        ctx.record.tenant, ctx.record.key_id = principal.tenant, principal.key_id
        body, requested, model = await self._resolve(ctx, policy, body, principal)
        return await self._estimate(ctx, {"x-tokenway-no-fallback": "1"}, policy, body, principal, requested, model)

    async def _resolve(
        self, ctx: RequestContext, policy: Policy, body: dict[str, Any], principal: Principal
    ) -> tuple[dict[str, Any], str, str]:
        """(body as the policy lets it through, requested, public model): served here and allowed."""
        record = ctx.record
        ctx.engine_fields = policy.engine_fields(principal)
        body, ctx.dropped_fields = client_body(body, ctx.engine_fields)  # engine-control fields: policy's
        requested: str = body["model"]
        model = policy.resolve_model(requested)
        record.requested_model, record.model = requested, model
        adapter = self.fleet.adapter(model)
        record.base_model = adapter.base_model if adapter is not None else None  # `usage report --by adapter`
        if not self.fleet.pools_for_model(model):
            raise ModelNotFound(f"The model '{requested}' does not exist or is not served here.", param="model")
        if not (principal.may_use(model) or principal.may_use(requested)) or not policy.adapter_allows(
            model, principal.tenant
        ):
            raise ModelNotAllowed(f"This key may not use the model '{requested}'.", param="model")
        # work that needs the caller (a stored conversation, whose program a continued turn inherits)
        record.program = await ctx.api.prepare(body, principal, record.program)
        return body, requested, model

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.server.max_body_bytes
        length = request.content_length  # a property that parses the header: read once
        if length is not None and length > limit:
            raise RequestTooLarge(f"request body of {length} bytes exceeds the limit of {limit}")
        try:
            # bounded (deadline, size, budget, encoding) by gateway/http/bodies.py; the timer below is for
            # an app built without its middleware, and small bodies, which arrive with the headers
            if isinstance(request, BoundedRequest) or request.content.is_eof():
                return await request.read()
            async with asyncio.timeout(self.server.request_read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes") from exc
        except RequestPayloadError as exc:  # e.g. a Content-Encoding the body does not match
            raise InvalidRequest(f"the request body could not be read: {str(exc).strip()}") from exc
        except TimeoutError as exc:
            raise RequestTimeout(
                f"the request body did not arrive within {self.server.request_read_timeout_s:g}s"
            ) from exc

    async def _estimate(
        self,
        ctx: RequestContext,
        headers: Mapping[str, str],
        policy: Policy,
        body: dict[str, object],
        principal: Principal,
        requested: str,
        model: str,
        *,
        batch_id: str | None = None,
    ) -> RequestFacts:
        ttft_ms, tpot_ms = parse_slo_headers(headers)  # malformed -> 400 before any counting
        subjects = request_subjects(headers, body, ctx.record.program)  # bounded; malformed tags -> 400
        ctx.record.user, ctx.record.tags = subjects.user, subjects.tags
        prompt_tokens, ids, tokens_source = await ctx.api.estimate(self.estimator, body, model)
        max_tokens = ctx.api.max_tokens(body)
        check_min_tokens(body, max_tokens)  # never more than may be produced (gateway/upstream/engine_control.py)
        model_config = policy.model_config(model)
        # Without max_tokens the reservation is the model's default, and the engine is told it as its
        # limit (gateway/upstream/engine_control.py): a learnt typical length would cut the longer answers short.
        estimate_tokens = model_config.default_max_tokens if model_config else _DEFAULT_MAX_TOKENS
        session_key = headers.get("x-session-id") or body.get("user")
        client_salt = body.get("cache_salt")  # there only where the tenant may name one
        cache_salt = engine_cache_salt(
            policy.cache_group(principal), client_salt if isinstance(client_salt, str) else None
        )
        opt_out = headers.get("x-tokenway-no-fallback", "").lower() in ("1", "true", "yes")
        return RequestFacts(
            request_id=ctx.record.request_id,
            api=ctx.api.kind,
            body=body,
            requested_model=requested,
            model=model,
            principal=principal,
            stream=bool(body.get("stream")),
            include_usage=ctx.api.include_usage(body),
            prompt_tokens=prompt_tokens,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            output_reservation=output_reservation(
                body,
                max_tokens=max_tokens,
                estimate_tokens=estimate_tokens,
                context_length=model_config.context_length if model_config else None,
                prompt_tokens=prompt_tokens,
            )
            if ctx.api.generates
            else 0,
            session_key=session_key if isinstance(session_key, str) else None,
            cache_salt=cache_salt,
            allow_fallback=principal.allow_fallback and not opt_out,
            debug=debug_allowed(headers, ctx.http.remote if ctx.http is not None else None, self.server.admin_token),
            slo=effective_slo(policy.slo_class(principal), ttft_ms, tpot_ms) if batch_id is None else None,
            subjects=subjects,
            prompt_tokens_source=tokens_source,
            batch_id=batch_id,
        )
