"""Intake: from the HTTP request to the request's frozen facts, and everything it reads from the
client's headers and body on the way (the key, the request id, the SLO, the agent program, the end
user, tags and run budget, who may have the debug headers). Each of these is client input, bounded
and checked here, once; nothing after intake re-reads the headers or the body.

authenticate (headers only) → read (size limit, read deadline, memory budget: gateway/http/bodies.py) →
one orjson parse (nesting bounded) → validate (the API's own checks) → resolve the model (alias,
allow-list, served here) → a look at the limits (no room left: 429 before the prompt is counted) →
estimate (prompt tokens, output reservation, the effective SLO). Every failure is a 4xx from the
error tree; nothing after intake re-reads the body, and its budget is given back when intake ends.

Headers are read safely: values reach aiohttp as bytes and come out as `str` with undecodable bytes
kept as lone surrogates, which fail the moment anything encodes them (a digest, a log line, a ledger
record, a forwarded header). So every header read here is either checked (an API key with such bytes
is simply not a key: 401) or replaced (a request id that is not short visible ASCII gets a generated
one). Session keys are bounded where they are kept (`policies/routing/pipeline.py`).

Program identity: which agent program (one task's run of many calls) a request belongs to
-----------------------------------------------------------------------------------------

An agent's task is tens of calls whose prompts grow each turn; billing and scheduling them one by one
hides the task. Clients already name it, in several ways, so the first one present wins:

1. `x-tokenway-program` — the gateway's own header, for clients that set it on purpose;
2. the session headers agent runtimes send (`x-session-id`, `x-claude-code-session-id`,
   `x-session-affinity`);
3. Anthropic Messages' `metadata.user_id` (Claude Code writes its session into it);
4. OpenAI's `prompt_cache_key`, then `user` (a stable end-user or conversation identifier).

The value is client input that reaches the ledger, the console and (later) maps keyed by program, so
it is bounded like session keys (`policies/routing/pipeline.py`): kept as sent when short valid text,
else '#' + a 128-bit hash of its bytes, so the same program always gets the same id. It is read once
at intake from the already-parsed body (no second parse) and costs a few dictionary look-ups.
Programs are per tenant: two tenants' "run-1" are different programs (the record carries both).

Subjects: what a request names beside its key: its end user, its tags, and the run budget it asks for
-------------------------------------------------------------------------------------------------------

Operators count spend and set limits by more than the key: per end user of an app (OpenAI's `user`),
per feature or cost centre (tags), per agent run (the program, above). These are client input that
reaches admission's counters, the ledger and the console, so each is bounded here, once, at intake:

- **end user**: `x-tokenway-user`, else the body's `user` (OpenAI) or `safety_identifier` (OpenAI's
  newer name for it); kept like program ids (short valid text as sent, else '#' + a 128-bit hash).
- **tags**: `x-tokenway-tags` (comma-separated) and the body's `metadata.tags` (a list, or a
  comma-separated string: OpenAI's `metadata` values are strings), merged, at most `MAX_TAGS`, each
  1-64 characters of `[A-Za-z0-9_.:/-]`. A tag outside that is a 400 naming it, never silently
  dropped: a dropped tag would bill its spend to nobody.
- **run budget**: `x-tokenway-run-budget-usd`, a positive number of dollars; it lowers the agent run's
  `usd_per_run` for this program (never raises it: policies/limits/plan.py) and needs a program.
- **run wall-clock cap**: `x-tokenway-run-seconds`, a positive number of seconds from the run's first
  call; it lowers the run's `seconds_per_run` the same way, and needs a program too.

Limits and budgets apply to them only where policies.yaml has rules of scope `user`, `tag` or
`program` (docs/governance.md); the ledger records user and tags whatever the rules.

Who gets the debug headers (`x-tokenway-debug`): operators only
---------------------------------------------------------------

The debug answer names every replica's routing scores, the prefix-cache hit the router expected
(`x-tokenway-route`), the predictor's numbers and the fields that did not reach the engine. The
expected hit alone is a side channel: a tenant resending another's prompt would read from the
router's estimate what the prefix caches hold. So the headers are answered to the operator only:

- with `server.admin_token` set, the request must carry it in `x-tokenway-admin-token` (the
  `Authorization` header holds the API key), compared in constant time;
- without one (a loopback-only gateway, where `/admin/*` trusts direct local callers), to a caller
  straight from a loopback address and not through a reverse proxy (no `Forwarded`,
  `X-Forwarded-For`, `X-Forwarded-Host`, `X-Real-IP`), the same trust as the admin API's; a
  caller whose address the gateway does not see (the endpoint picker's, behind Envoy) needs the
  token.

Anyone else asking for them is served as if they had not asked. Intake decides (`facts.debug`);
the engine transport writes them (`debug_headers`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from backends.fleet import Fleet
from gateway.app.settings import ServerSettings
from gateway.client_text import encodable, valid_request_id
from gateway.errors import (
    InvalidApiKey,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    Rejected,
    RequestTimeout,
    RequestTooLarge,
)
from gateway.http.bodies import NOT_PARSED, BoundedRequest, parse_json_body, parsed_body, release_body
from gateway.request.apis import NativeApi
from gateway.request.context import RequestContext
from gateway.upstream.relay import check_min_tokens
from policies.estimate import PromptCount, PromptEstimator, body_key, output_reservation
from policies.holder import PolicyHolder
from policies.policy import Policy, TenantView, client_body
from policies.policy import cache_salt as engine_cache_salt
from policies.program import RunawayGuard
from policies.routing.pipeline import MAX_SESSION_KEY_CHARS, bounded_key
from policies.routing.types import RouteDecision
from policies.slo import effective_slo
from policies.types import NO_SUBJECTS, Principal, Rejection, RequestFacts, RequestSubjects
from predictor.features import Prediction

SLO_TTFT_HEADER: Final = "x-slo-ttft-ms"
SLO_TPOT_HEADER: Final = "x-slo-tpot-ms"
_MAX_SLO_MS: Final = 86_400_000.0  # a day: anything longer is a typo, not an objective
_DEFAULT_MAX_TOKENS: Final = 1024  # a model without a policies.yaml entry
INVALID_KEY: Final = "\x00invalid"  # no stored key can hash to this: keys never contain NUL


Precheck = Callable[[Principal, str], Awaitable[Rejection | None]]


def request_id(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id` when it is 1-128 visible ASCII characters, else a generated one
    (it is echoed in a response header, forwarded to the engine and written to the ledger)."""
    return valid_request_id(headers.get("x-request-id")) or os.urandom(16).hex()


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
    return _authenticated(request.headers if isinstance(request, web.Request) else request, policy)


def _authenticated(headers: Mapping[str, str], policy: Policy) -> Principal:
    """`authenticate` for headers as they are: intake's own call skips the isinstance test above,
    which against aiohttp's Request (an abstract Mapping) runs ABCMeta's Python-level check."""
    key = presented_key(headers)
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
    ttft, tpot = headers.get(SLO_TTFT_HEADER), headers.get(SLO_TPOT_HEADER)
    return (
        None if ttft is None else _header_ms(ttft, SLO_TTFT_HEADER),
        None if tpot is None else _header_ms(tpot, SLO_TPOT_HEADER),
    )


def _header_ms(raw: str, name: str) -> float:
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
        headers = request.headers
        principal = self._principal(ctx, headers)
        try:
            raw = await self._read_body(request)
            key = self._body_key(ctx, raw)
            parsed = parsed_body(request)  # one copy of the body while it is counted: the parsed one
            if parsed is not NOT_PARSED:
                raw = b""
            return await self.facts(ctx, raw, headers, principal=principal, parsed=parsed, body_key=key)
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
        body_key: int | None = None,
    ) -> RequestFacts:
        """The facts of a body already read (`read`, or the endpoint picker's, which Envoy sent):
        one parse (nesting bounded; `parsed` when the reader did it), the API's checks, the caller,
        the model, a look at the limits (no room left: refused before the prompt is counted), the count.
        `body_key`: `_body_key` of the raw body, where `read` dropped it after parsing."""
        if parsed is NOT_PARSED:
            parsed = parse_json_body(raw)
            body_key = self._body_key(ctx, raw)
        body = ctx.api.parse(parsed)
        record = ctx.record
        record.program = program_id(headers, body)  # before any refusal: it is on every record
        policy = self.policies.current
        if principal is None:
            principal = self._principal(ctx, headers)
        tenant = policy.tenant_view(principal.tenant)
        body, requested, model = await self._resolve(ctx, policy, tenant, body, principal)
        if record.program is not None:
            self._check_program(tenant, principal, record.program, body)
        if self.precheck is not None:
            rejection = await self.precheck(principal, model)
            if rejection is not None:
                raise Rejected(rejection)
        return await self._estimate(ctx, headers, policy, tenant, body, principal, requested, model, body_key=body_key)

    def _body_key(self, ctx: RequestContext, raw: bytes) -> int | None:
        """The key of the prompt's count in the counters' caches (`policies.estimate.body_key`), for a
        native API's body (its body is the parsed raw JSON) where a counter caches by it: one pass of
        a hash over the raw bytes, where the prompt's own key would copy a long prompt to hash it."""
        api = ctx.api
        if not self.estimator.keys_bodies or type(api) is not NativeApi:
            return None
        return body_key(api.kind, raw)

    def _check_program(self, view: TenantView, principal: Principal, program: str, body: dict[str, Any]) -> None:
        """The runaway guard (policies/program.py), where the caller's tenant sets it: one look-up if not."""
        tenant = view.config
        if tenant is not None and tenant.program_max_repeats is not None:
            rejection = self.runaway.check(
                principal.tenant, program, body, tenant.program_max_repeats, tenant.program_max_cycle
            )
            if rejection is not None:
                raise Rejected(rejection)

    def _principal(self, ctx: RequestContext, headers: Mapping[str, str]) -> Principal:
        with ctx.trace.span("auth"):
            principal = _authenticated(headers, self.policies.current)
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
        tenant = policy.tenant_view(principal.tenant)
        body, requested, model = await self._resolve(ctx, policy, tenant, body, principal)
        return await self._estimate(ctx, {}, policy, tenant, body, principal, requested, model, batch_id=batch_id)

    async def internal(self, ctx: RequestContext, parsed: object, principal: Principal) -> RequestFacts:
        """The facts of a request the gateway makes for an operator (the console's model check,
        gateway/console/check.py): its body already parsed, its caller a principal no key
        authenticates as; admitted, priced and recorded like any request, never a fallback."""
        body = ctx.api.parse(parsed)
        policy = self.policies.current
        ctx.record.tenant, ctx.record.key_id = principal.tenant, principal.key_id
        tenant = policy.tenant_view(principal.tenant)
        body, requested, model = await self._resolve(ctx, policy, tenant, body, principal)
        return await self._estimate(
            ctx, {"x-tokenway-no-fallback": "1"}, policy, tenant, body, principal, requested, model
        )

    async def _resolve(
        self, ctx: RequestContext, policy: Policy, tenant: TenantView, body: dict[str, Any], principal: Principal
    ) -> tuple[dict[str, Any], str, str]:
        """(body as the policy lets it through, requested, public model): served here and allowed."""
        record = ctx.record
        ctx.engine_fields = tenant.engine_fields
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
            # an app built without its middleware, and small bodies, which arrive with the headers. (A type
            # test, not isinstance: aiohttp's Request is an abstract Mapping, whose isinstance runs Python.)
            if type(request) is BoundedRequest or request.content.is_eof():
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
        tenant: TenantView,
        body: dict[str, object],
        principal: Principal,
        requested: str,
        model: str,
        *,
        batch_id: str | None = None,
        body_key: int | None = None,
    ) -> RequestFacts:
        ttft_ms, tpot_ms = parse_slo_headers(headers)  # malformed -> 400 before any counting
        record = ctx.record
        subjects = request_subjects(headers, body, record.program)  # bounded; malformed tags -> 400
        record.user, record.tags = subjects.user, subjects.tags
        api = ctx.api
        counted = (
            api.estimate(self.estimator, body, model, body_key)
            if body_key is not None and isinstance(api, NativeApi)
            else api.estimate(self.estimator, body, model)
        )
        if not isinstance(counted, PromptCount):  # a cached prompt is counted at once: nothing to await
            counted = await counted
        prompt_tokens, ids, tokens_source = counted
        max_tokens = api.max_tokens(body)
        check_min_tokens(body, max_tokens)  # never more than may be produced (gateway/upstream/relay.py)
        model_config = policy.config.models.get(model)
        # Without max_tokens the reservation is the model's default, and the engine is told it as its
        # limit (gateway/upstream/relay.py): a learnt typical length would cut the longer answers short.
        estimate_tokens = model_config.default_max_tokens if model_config else _DEFAULT_MAX_TOKENS
        session_key = headers.get("x-session-id") or body.get("user")
        client_salt = body.get("cache_salt")  # there only where the tenant may name one
        cache_salt = (
            engine_cache_salt(tenant.cache_group, client_salt)
            if client_salt and isinstance(client_salt, str)
            else tenant.cache_salt  # the group's own, worked out once per policy
        )
        no_fallback = headers.get("x-tokenway-no-fallback")
        opt_out = no_fallback is not None and no_fallback.lower() in ("1", "true", "yes")
        # the peer's address is read (a Python-level property) only where the debug headers are asked for
        debug = headers.get(DEBUG_HEADER) == "1" and debug_allowed(
            headers, ctx.http.remote if ctx.http is not None else None, self.server.admin_token
        )
        return RequestFacts(
            request_id=record.request_id,
            api=api.kind,
            body=body,
            requested_model=requested,
            model=model,
            principal=principal,
            stream=bool(body.get("stream")),
            include_usage=api.include_usage(body),
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
            if api.generates
            else 0,
            session_key=session_key if isinstance(session_key, str) else None,
            cache_salt=cache_salt,
            allow_fallback=principal.allow_fallback and not opt_out,
            debug=debug,
            slo=effective_slo(policy.slo_class(principal), ttft_ms, tpot_ms) if batch_id is None else None,
            subjects=subjects,
            prompt_tokens_source=tokens_source,
            batch_id=batch_id,
        )


PROGRAM_HEADER: Final = "x-tokenway-program"
SESSION_HEADERS: Final = ("x-session-id", "x-claude-code-session-id", "x-session-affinity")
MAX_PROGRAM_CHARS: Final = MAX_SESSION_KEY_CHARS  # longer ids are kept as '#' + 32 hex characters


_PROGRAM_FIELDS: Final = frozenset({"metadata", "prompt_cache_key", "user"})  # where a body names its program


def program_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The request's bounded program id from the first source present, or None when it names none."""
    value = headers.get(PROGRAM_HEADER)
    if not value:
        for name in SESSION_HEADERS:
            value = headers.get(name)
            if value:
                break
        else:
            # most bodies name none of the fields: one C-level test instead of three look-ups
            value = None if _PROGRAM_FIELDS.isdisjoint(body) else _body_program(body)
            if value is None:
                return None
    return bounded_key(value)


def _body_program(body: Mapping[str, Any]) -> str | None:
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and user_id:
            return user_id
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value
    return None


USER_HEADER: Final = "x-tokenway-user"
TAGS_HEADER: Final = "x-tokenway-tags"
RUN_BUDGET_HEADER: Final = "x-tokenway-run-budget-usd"
RUN_SECONDS_HEADER: Final = "x-tokenway-run-seconds"
MAX_RUN_SECONDS: Final = 31_536_000.0  # a year: policies.yaml's bound on seconds_per_run
MAX_TAGS: Final = 8
_TAG: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}")


_SUBJECT_FIELDS: Final = frozenset({"user", "safety_identifier", "metadata"})  # where a body names subjects


def request_subjects(headers: Mapping[str, str], body: Mapping[str, Any], program: str | None) -> RequestSubjects:
    """The request's end user, tags, program and run budget, bounded; a 400 for a malformed tag or
    run budget. A request naming none gets the shared empty value (no allocation)."""
    user_header = headers.get(USER_HEADER)
    tags_header = headers.get(TAGS_HEADER)
    run_budget = headers.get(RUN_BUDGET_HEADER)
    run_seconds = headers.get(RUN_SECONDS_HEADER)
    if (
        not user_header
        and not tags_header
        and run_budget is None
        and run_seconds is None
        and _SUBJECT_FIELDS.isdisjoint(body)
    ):  # almost every request: nothing to check, no helper called
        return NO_SUBJECTS if program is None else RequestSubjects(program=program)
    user = _user(user_header, body)
    tags = _tags(tags_header, body)
    run_usd = _run_usd(run_budget, program)
    run_s = _run_seconds(run_seconds, program)
    if user is None and not tags and program is None:
        return NO_SUBJECTS
    return RequestSubjects(user=user, tags=tags, program=program, run_usd=run_usd, run_s=run_s)


def _user(header: str | None, body: Mapping[str, Any]) -> str | None:
    value: Any = header
    if not value:
        value = body.get("user") or body.get("safety_identifier")
    return bounded_key(value) if isinstance(value, str) and value else None


def _tags(header: str | None, body: Mapping[str, Any]) -> tuple[str, ...]:
    found: list[str] = []
    if header:
        found += _split(header, TAGS_HEADER)
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        tags = metadata.get("tags")
        if isinstance(tags, str):
            found += _split(tags, "metadata.tags")
        elif isinstance(tags, list):
            if len(tags) > MAX_TAGS:
                raise InvalidRequest(f"at most {MAX_TAGS} tags, got {len(tags)}", param="metadata.tags")
            for tag in tags:
                if not isinstance(tag, str):
                    raise InvalidRequest("metadata.tags: expected strings", param="metadata.tags")
                found.append(_checked(tag.strip(), "metadata.tags"))
        elif tags is not None:
            raise InvalidRequest("metadata.tags: expected a list of strings", param="metadata.tags")
    if not found:
        return ()
    unique = tuple(sorted(set(found)))  # one order: the same tags are the same admission plan
    if len(unique) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags, got {len(unique)}", param="tags")
    return unique


def _split(value: str, where: str) -> list[str]:
    parts = [part.strip() for part in value.split(",", MAX_TAGS + 1) if part.strip()]
    if len(parts) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags in {where}", param=where)
    return [_checked(part, where) for part in parts]


def _checked(tag: str, where: str) -> str:
    if _TAG.fullmatch(tag) is None:
        shown = tag[:40] + ("..." if len(tag) > 40 else "")
        raise InvalidRequest(
            f"invalid tag {shown!r} in {where}: 1-64 characters of letters, digits and _ . : / -, "
            "starting with a letter or digit",
            param=where,
        )
    return tag


def _run_usd(value: str | None, program: str | None) -> float | None:
    if value is None:
        return None
    try:
        usd = float(value)
    except ValueError:
        usd = math.nan
    if not math.isfinite(usd) or usd <= 0:
        raise InvalidRequest(f"{RUN_BUDGET_HEADER}: expected a positive number of dollars", param=RUN_BUDGET_HEADER)
    if program is None:
        raise InvalidRequest(
            f"{RUN_BUDGET_HEADER} budgets an agent run: name the run (x-tokenway-program)", param=RUN_BUDGET_HEADER
        )
    return usd


def _run_seconds(value: str | None, program: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_RUN_SECONDS:
        raise InvalidRequest(
            f"{RUN_SECONDS_HEADER}: expected a positive number of seconds, at most {MAX_RUN_SECONDS:.0f}",
            param=RUN_SECONDS_HEADER,
        )
    if program is None:
        raise InvalidRequest(
            f"{RUN_SECONDS_HEADER} caps an agent run: name the run (x-tokenway-program)", param=RUN_SECONDS_HEADER
        )
    return seconds


DEBUG_HEADER = "x-tokenway-debug"
ADMIN_TOKEN_HEADER = "x-tokenway-admin-token"
_PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-IP")


def _loopback(remote: str | None) -> bool:
    if not remote:  # unknown: the endpoint picker's requests (Envoy holds the client), a unix socket
        return False
    try:
        return ipaddress.ip_address(remote.strip("[]")).is_loopback
    except ValueError:
        return False


def debug_allowed(headers: Mapping[str, str], remote: str | None, admin_token: str | None) -> bool:
    """Whether this request asked for the debug headers and may have them (see the module doc)."""
    if headers.get(DEBUG_HEADER) != "1":
        return False
    if admin_token:
        given = headers.get(ADMIN_TOKEN_HEADER, "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, admin_token.encode("utf-8"))
    return _loopback(remote) and not any(name in headers for name in _PROXY_HEADERS)


def debug_headers(ctx: RequestContext, decision: RouteDecision) -> list[tuple[str, str]]:
    """The debug headers of an answer (`ctx.facts.debug`: asked for and allowed): the routing scores
    (`x-tokenway-route`), the fields that did not reach the engine, the prompt count and its source,
    and what the predictor expected of the serving endpoint."""
    headers = [("x-tokenway-route", decision.debug_header())]
    if ctx.unforwarded_fields:
        headers.append(("x-tokenway-dropped-fields", ",".join(ctx.unforwarded_fields)))
    source = ctx.facts.prompt_tokens_source
    headers.append(("x-tokenway-prompt-tokens", f"{ctx.facts.prompt_tokens};source={source}"))
    if ctx.prediction is not None:
        headers.append(("x-tokenway-prediction", _prediction_header(ctx.prediction)))
    return headers


def _prediction_header(p: Prediction) -> str:
    """`x-tokenway-prediction`: what the predictor expected of the serving endpoint, in ms."""
    return (
        f"ttft={p.ttft_ms:.2f};ttft_p90={p.ttft_p90_ms:.2f};tpot={p.tpot_ms:.3f};tpot_p90={p.tpot_p90_ms:.3f};"
        f"source={p.source};version={p.model_version}"
    )
