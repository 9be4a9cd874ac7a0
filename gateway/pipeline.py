"""The walk of one request (DESIGN.md §2): read, authenticate, resolve, estimate, admit, route,
forward, account.

Decisions are made by the policies room (pure functions and objects that hold no sockets); this
module sequences them, does the I/O, and guarantees the bookkeeping invariants: every admitted
reservation is settled or released exactly once, every endpoint load ticket is ended, and every
request (served, rejected, failed or aborted) produces exactly one `RequestRecord`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from backends.adapters.registry import get_adapter
from backends.errors import PdError
from backends.fleet import Fleet, Pool
from backends.types import Endpoint
from gateway import intake
from gateway.apis.base import ApiCall
from gateway.components import AdmissionPort, RecordSink
from gateway.engine_errors import openai_error
from gateway.engine_tokens import EngineTokenizer
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    NoHealthyBackend,
    Rejected,
    RequestTooLarge,
    UpstreamError,
    error_response,
)
from gateway.record import RequestRecord
from gateway.relay import (
    RelayOutcome,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTarget,
    call_json,
    relay_stream,
    relay_unary,
)
from gateway.settings import ServerSettings
from gateway.slo import (
    REASON_QUEUE_FULL,
    REASON_QUEUE_TIMEOUT,
    REASON_QUEUED,
    REASON_SHED,
    REASON_UNATTAINABLE,
    SloGate,
    SloMiss,
    parse_slo_headers,
    slo_miss,
)
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace
from gateway.upstream import UpstreamClient
from gateway.validate import validate_body
from policies.estimate import PromptEstimator
from policies.fallback import check_context, choose_fallback, context_tokens
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.pricing import price_usd
from policies.routing.predictions import PREDICTIONS_ATTR
from policies.routing.types import RouteDecision, Router
from policies.slo import RUNNING_TPOT_SLO_ATTR, Meet, Miss, Slo, decide, effective_slo
from policies.types import ApiKind, Principal, Rejection, RequestFacts, Usage
from predictor.service import LatencyPredictor
from predictor.types import Prediction, RequestShape

log = logging.getLogger("tokenway.pipeline")

_API_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}

BodyShaper = Callable[[Endpoint, dict[str, Any], ApiKind], dict[str, Any]]


def _identity_shape(endpoint: Endpoint, body: dict[str, Any], api: ApiKind) -> dict[str, Any]:
    return body


class _Exhausted(Exception):
    """Nothing reached the client and no endpoint of the model could serve: maybe fall back."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class _RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


@dataclass(slots=True)
class Walk:
    """Per-request state that outlives the individual steps (for headers, accounting, records)."""

    record: RequestRecord
    trace: RequestTrace
    arrived_s: float
    headers: list[tuple[str, str]] = field(default_factory=list)
    prediction: Prediction | None = None  # for the endpoint that served, made before it ran
    slo: Slo | None = None  # the effective latency SLO, None without one
    slo_queued_s: float = 0.0  # time spent in the SLO queue before dispatch
    call: ApiCall | None = None  # the per-request pieces of a Responses / Messages request


@dataclass(slots=True)
class Pipeline:
    server: ServerSettings
    policies: PolicyHolder  # `.current` is the live policy (hot-reloaded)
    fleet: Fleet
    upstream: UpstreamClient  # pooled keep-alive connections to the engines
    routers: Mapping[str, Router]  # by pool name
    admission: AdmissionPort
    estimator: PromptEstimator = field(default_factory=PromptEstimator)
    sinks: Sequence[RecordSink] = ()
    start_trace: Callable[[str, Any], RequestTrace] | None = None
    report_success: Callable[[Endpoint], None] = lambda endpoint: None
    report_failure: Callable[[Endpoint, float], None] = lambda endpoint, now: None
    shape_body: BodyShaper = _identity_shape
    on_route: Callable[[RouteDecision], None] = lambda decision: None
    engine_tokens: EngineTokenizer | None = None  # precise prefix index over real engines
    metrics: GatewayMetrics | None = None  # per-decision series (routes, upstream errors, retries)
    predictor: LatencyPredictor | None = None  # latency predictions, online training, output lengths
    slo: SloGate = field(default_factory=SloGate)  # running TPOT SLOs and the SLO queue
    _background: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    # ------------------------------------------------------------------ entry
    async def handle(self, request: web.Request, api: ApiKind, call: ApiCall | None = None) -> web.StreamResponse:
        arrived_s = time.perf_counter()
        request_id = intake.request_id(request.headers)
        record = RequestRecord(request_id=request_id, api=api, started_at_unix_s=time.time())
        trace = self.start_trace(request_id, request.headers) if self.start_trace else NOOP_TRACE
        walk = Walk(record, trace, arrived_s, [("x-request-id", request_id)], call=call)
        try:
            return await self._walk(request, api, walk)
        except GatewayError as error:
            record.status = "rejected" if error.status < 500 or isinstance(error, Rejected) else "error"
            record.http_status = error.status
            record.error_code = error.code or error.type
            if isinstance(error, Rejected):
                record.reject_reason = error.reason
            return call.render_error(error, walk.headers) if call else error_response(error, walk.headers)
        except asyncio.CancelledError:
            record.status = "aborted"
            record.http_status = 499
            raise
        except Exception as exc:  # a bug must still answer in OpenAI's shape and leave a record
            log.exception("request %s failed unexpectedly", request_id)
            record.status, record.http_status, record.error_code = "error", 500, "internal_error"
            internal = GatewayError(f"internal error: {type(exc).__name__}")
            return call.render_error(internal, walk.headers) if call else error_response(internal, walk.headers)
        finally:
            record.duration_s = time.perf_counter() - arrived_s
            self._finish(walk)

    def _finish(self, walk: Walk) -> None:
        for sink in self.sinks:
            try:
                sink.observe(walk.record)
            except Exception:  # a broken sink must not break the others or the response
                log.exception("record sink %s failed", type(sink).__name__)
        walk.trace.end(walk.record)

    # ------------------------------------------------------------------ intake
    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {limit}")
        try:
            if request.content.is_eof():  # small bodies arrive with the headers: no timer needed
                return await request.read()
            async with asyncio.timeout(self.server.request_read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes") from exc
        except RequestPayloadError as exc:  # e.g. a Content-Encoding the body does not match
            raise InvalidRequest(f"the request body could not be read: {str(exc).strip()}") from exc
        except TimeoutError as exc:
            raise _RequestTimeout(
                f"the request body did not arrive within {self.server.request_read_timeout_s:g}s"
            ) from exc

    def authenticate(self, request: web.Request, policy: Policy) -> Principal:
        key = intake.presented_key(request.headers)
        if key is None:
            raise InvalidApiKey(
                "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
            )
        principal = policy.authenticate(key)
        if principal is None:
            raise InvalidApiKey("Incorrect API key provided.")
        return principal

    async def _walk(self, request: web.Request, api: ApiKind, walk: Walk) -> web.StreamResponse:
        record = walk.record
        raw = await self._read_body(request)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
        body = walk.call.parse(parsed) if walk.call is not None else validate_body(api, parsed)
        policy: Policy = self.policies.current
        with walk.trace.span("auth"):
            principal = self.authenticate(request, policy)
        record.tenant, record.key_id = principal.tenant, principal.key_id
        requested = body["model"]
        model = policy.resolve_model(requested)
        record.requested_model, record.model = requested, model
        if not self.fleet.pools_for_model(model):
            raise ModelNotFound(f"The model '{requested}' does not exist or is not served here.", param="model")
        if not (principal.may_use(model) or principal.may_use(requested)):
            raise ModelNotAllowed(f"This key may not use the model '{requested}'.", param="model")
        if walk.call is not None:
            await walk.call.prepare(body, principal)
        facts = await self._facts(request, api, body, principal, requested, model, walk)
        return await self._serve(request, facts, walk)

    async def _facts(
        self,
        request: web.Request,
        api: ApiKind,
        body: dict[str, Any],
        principal: Principal,
        requested: str,
        model: str,
        walk: Walk,
    ) -> RequestFacts:
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if walk.call is not None:
            prompt_tokens, ids = await walk.call.estimate(self.estimator, body)
            max_tokens = walk.call.max_tokens(body)
            options = {}
        elif api == "chat":
            prompt_tokens, ids = await self.estimator.chat(body["messages"], body.get("tools"), want_ids=True)
        elif api == "completions":
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt_tokens, ids = await self.estimator.texts(prompt), None
            else:
                prompt_tokens, ids = await self.estimator.completion(prompt, want_ids=True)
        else:
            value = body["input"]
            if isinstance(value, str):
                prompt_tokens = await self.estimator.texts([value])
            elif value and isinstance(value[0], str):
                prompt_tokens = await self.estimator.texts(value)
            elif value and isinstance(value[0], list):
                prompt_tokens = sum(len(v) for v in value)
            else:
                prompt_tokens = len(value)
            ids = None
        n = int(body.get("n") or 1)
        model_config = self.policies.current.model_config(model)
        default_output = model_config.default_max_tokens if model_config else 1024
        if max_tokens is None and self.predictor is not None and api != "embeddings":
            estimate = self.predictor.output_tokens_estimate(principal.tenant, model)
            if estimate is not None:  # what this tenant's requests to this model really use (p90)
                default_output = min(default_output, max(1, estimate.p90_tokens))
        output_reservation = 0 if api == "embeddings" else (max_tokens or default_output) * n
        session_key = request.headers.get("x-session-id") or body.get("user")
        opt_out = request.headers.get("x-tokenway-no-fallback", "").lower() in ("1", "true", "yes")
        return RequestFacts(
            request_id=walk.record.request_id,
            api=api,
            body=body,
            requested_model=requested,
            model=model,
            principal=principal,
            stream=stream,
            include_usage=bool(options.get("include_usage")),
            prompt_tokens=prompt_tokens,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            output_reservation=output_reservation,
            session_key=session_key if isinstance(session_key, str) else None,
            cache_salt=body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
            allow_fallback=principal.allow_fallback and not opt_out,
            debug=request.headers.get("x-tokenway-debug") == "1",
            arrived_at_s=walk.arrived_s,
        )

    # ------------------------------------------------------------------ admit, fall back
    async def _serve(self, request: web.Request, facts: RequestFacts, walk: Walk) -> web.StreamResponse:
        policy: Policy = self.policies.current
        model = facts.model
        visited = {model}
        # SLO: the request's effective SLO; malformed headers -> 400
        self._slo_of(request, facts, policy, walk)
        while True:
            rejection = check_context(policy, model, facts.prompt_tokens, facts.max_tokens)
            ticket: Any = None
            if rejection is None:
                with walk.trace.span("admission", model=model):
                    admitted = await self.admission.admit(facts, model)
                if isinstance(admitted, Rejection):
                    rejection = admitted
                else:
                    ticket = admitted
            if rejection is not None:
                following = self._fallback(policy, model, rejection.reason, facts, visited)
                if following is None:
                    raise Rejected(rejection)
                model = self._note_fallback(walk, facts, model, following, rejection.reason)
                continue
            try:
                return await self._forward(request, facts, model, ticket, walk)
            except _Exhausted as exhausted:
                await self.admission.release(ticket)
                following = self._fallback(policy, model, "upstream_error", facts, visited)
                if following is None:
                    raise exhausted.error from None
                model = self._note_fallback(walk, facts, model, following, "upstream_error")
            # SLO: a miss releases the reservation; on_miss fallback walks the chain
            except SloMiss as miss:
                await self.admission.release(ticket)
                trigger = miss.rejection.reason
                following = self._fallback(policy, model, trigger, facts, visited) if miss.fallback else None
                if following is None:
                    raise Rejected(miss.rejection) from None
                model = self._note_fallback(walk, facts, model, following, trigger)

    def _fallback(self, policy: Policy, model: str, trigger: str, facts: RequestFacts, visited: set[str]) -> str | None:
        if not facts.allow_fallback or not trigger:
            return None
        following = choose_fallback(
            policy,
            model,
            trigger,
            facts.principal,
            tried=visited,
            min_context_tokens=context_tokens(facts.prompt_tokens, facts.max_tokens),
        )
        if following is None or not self.fleet.pools_for_model(following):
            return None
        visited.add(following)
        return following

    @staticmethod
    def _note_fallback(walk: Walk, facts: RequestFacts, model: str, following: str, trigger: str) -> str:
        record = walk.record
        if record.fallback_from is None:
            record.fallback_from = facts.model
        record.fallback_reason = trigger
        record.model = following
        walk.headers = [h for h in walk.headers if h[0] != "x-tokenway-fallback"]
        walk.headers.append(("x-tokenway-fallback", f"{record.fallback_from}->{following};reason={trigger}"))
        return following

    # ------------------------------------------------------------------ route, forward
    def _route(
        self, facts: RequestFacts, pools: Sequence[Pool], exclude: set[str]
    ) -> tuple[Pool, RouteDecision] | None:
        now = time.monotonic()
        for pool in pools:
            router = self.routers.get(pool.name)
            if router is None:
                continue
            decision = router.route(facts, pool, now, exclude)
            if decision is not None:
                return pool, decision
        return None

    def _predict(self, facts: RequestFacts, pool: Pool, decision: RouteDecision, model: str) -> Prediction | None:
        """The serving endpoint's prediction: the latency scorer's if it made one, else one made now."""
        assert self.predictor is not None
        made = facts.attrs.get(PREDICTIONS_ATTR)
        if isinstance(made, dict) and decision.endpoint.id in made:
            prediction: Prediction = made[decision.endpoint.id]
        else:
            shape = RequestShape(facts.prompt_tokens, facts.max_tokens, facts.principal.tenant, model)
            prediction = self.predictor.predict(
                pool.name, shape, [decision.endpoint], [decision.cached_tokens_estimate]
            )[0]
        return prediction

    def _upstream_body(self, facts: RequestFacts, endpoint: Endpoint) -> dict[str, Any]:
        """The client's body for this endpoint: served model name, stream usage on, engine shaping."""
        body = dict(facts.body)
        body["model"] = endpoint.served_model
        if facts.stream:
            body["stream_options"] = {**(facts.body.get("stream_options") or {}), "include_usage": True}
        return self.shape_body(endpoint, body, facts.api)

    def _target(
        self, facts: RequestFacts, endpoint: Endpoint, body: dict[str, Any], model: str, walk: Walk, path: str = ""
    ) -> UpstreamTarget:
        headers = {"Content-Type": "application/json", "x-request-id": facts.request_id}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        traceparent = walk.trace.traceparent()
        if traceparent:
            headers["traceparent"] = traceparent
        return UpstreamTarget(
            url=endpoint.base_url + (path or _API_PATHS[facts.api]),
            headers=headers,
            body=orjson.dumps(body),
            served_model=endpoint.served_model,
            public_model=model,
        )

    async def _prefill_leg(
        self, facts: RequestFacts, decision: RouteDecision, body: dict[str, Any], model: str, walk: Walk, path: str = ""
    ) -> dict[str, Any] | None:
        """Run the PD prefill leg; the decode leg's body, or None when the decode endpoint must prefill.

        A failed prefill leg (refused, 5xx, 4xx, no transfer params) is a KV-transfer failure: counted,
        and the request continues as prefill + decode on the decode endpoint.
        """
        prefill = decision.prefill_endpoint
        assert prefill is not None
        adapter = get_adapter(decision.endpoint.engine)
        load = prefill.inflight.begin(decision.uncached_prefill_tokens(facts.prompt_tokens))
        try:
            leg = self._target(facts, prefill, adapter.prefill_leg_body(body), model, walk, path)
            with walk.trace.span("prefill", endpoint=prefill.id):
                answer = await call_json(self.upstream, leg)
            decode_body = adapter.decode_leg_body(body, answer)
        except (RetryableUpstream, UpstreamRejected, PdError) as exc:
            if isinstance(exc, RetryableUpstream):
                self.report_failure(prefill, time.monotonic())
            walk.record.kv_transfer_failed = True
            log.warning("PD prefill leg on %s failed, decoding endpoint prefills: %s", prefill.id, exc)
            return None
        finally:
            load.end()
        self.report_success(prefill)
        if "kv_transfer_params" not in decode_body and "disaggregated_params" not in decode_body:
            walk.record.kv_transfer_failed = True
            return None
        return decode_body

    async def _forward(
        self, request: web.Request, facts: RequestFacts, model: str, ticket: Any, walk: Walk
    ) -> web.StreamResponse:
        record = walk.record
        pools = self.fleet.pools_for_model(model)
        if self.engine_tokens is not None and pools:
            await self.engine_tokens.annotate(facts, pools[0])
        exclude: set[str] = set()
        last_detail = ""
        for _ in range(1 + self.server.upstream_retries):
            facts.attrs.pop(PREDICTIONS_ATTR, None)  # SLO: never another pool's predictions
            with walk.trace.span("routing", model=model):
                routed = self._route(facts, pools, exclude)
            if routed is None:
                break
            # SLO: an endpoint predicted to meet the SLO, or the miss policy
            if walk.slo is not None:
                try:
                    routed = await self._slo_gate(facts, pools, exclude, routed, model, walk)
                except asyncio.CancelledError:
                    self._release_soon(ticket)
                    raise
            pool, decision = routed
            endpoint = decision.endpoint
            self.on_route(decision)
            record.pool, record.endpoint, record.route_reason = pool.name, endpoint.id, decision.reason
            record.engine = endpoint.engine
            if self.metrics is not None:
                self.metrics.observe_route(
                    decision.reason,
                    pool.name,
                    prompt_tokens=facts.prompt_tokens,
                    estimated_hit_tokens=decision.cached_tokens_estimate,
                )
            record.served_model = endpoint.served_model
            record.pd_reason = decision.pd_reason
            if record.upstream_attempts and self.metrics is not None:
                self.metrics.observe_retry(pool.name)
            record.upstream_attempts += 1
            router = self.routers[pool.name]
            router.on_dispatch(facts, decision)
            if self.predictor is not None and (facts.stream or PREDICTIONS_ATTR in facts.attrs):
                walk.prediction = self._predict(facts, pool, decision, model)  # streams show TTFT: learnable
            call, path = walk.call, ""
            if call is not None:  # another API: its body for this endpoint (native or chat)
                path, upstream_api, body = call.upstream(endpoint, decision.prefill_endpoint is not None)
                body = self.shape_body(endpoint, body, upstream_api)
            else:
                body = self._upstream_body(facts, endpoint)
            local_prefill = max(facts.prompt_tokens - decision.cached_tokens_estimate, 0)
            if decision.prefill_endpoint is not None:
                decode_body = await self._prefill_leg(facts, decision, body, model, walk, path)
                if decode_body is not None:
                    body, local_prefill = decode_body, 0
            target = self._target(facts, endpoint, body, model, walk, path)
            headers = [
                *walk.headers,
                *getattr(ticket, "headers", ()),
                ("x-tokenway-model", model),
                ("x-tokenway-endpoint", endpoint.id),
            ]
            if facts.debug:
                headers.append(("x-tokenway-route", decision.debug_header()))
            # SLO: what was predicted, the queue wait, the TPOT SLO now running there
            if facts.debug and walk.prediction is not None:
                headers.append(("x-tokenway-prediction", _prediction_header(walk.prediction)))
            if walk.slo_queued_s:
                headers.append(("x-tokenway-slo-queued-ms", f"{walk.slo_queued_s * 1000:.0f}"))
            if call is not None:
                headers = call.response_headers(headers)
            running_slo = self.slo.running.begin(endpoint.id, walk.slo.tpot_ms) if walk.slo is not None else None
            load = endpoint.inflight.begin(local_prefill)
            outcome = RelayOutcome()
            if walk.prediction is not None and self.predictor is not None and facts.stream:
                outcome.on_first_token = partial(self._first_token, pool.name, walk)
            record.gateway_overhead_s = time.perf_counter() - walk.arrived_s
            try:
                with walk.trace.span("upstream", endpoint=endpoint.id, model=model):
                    if facts.stream:
                        await relay_stream(
                            self.upstream,
                            request,
                            target,
                            load,
                            outcome,
                            client_wants_usage=facts.include_usage,
                            response_headers=headers,
                            prompt_tokens=facts.prompt_tokens + facts.output_reservation,
                            codec=call.stream_codec(
                                model, facts.prompt_tokens + facts.output_reservation, facts.prompt_tokens
                            )
                            if call is not None
                            else None,
                        )
                    else:
                        transform = partial(call.unary, public_model=model) if call is not None else None
                        outcome = await relay_unary(self.upstream, target, load, transform)
                    if outcome.first_token_at_s is not None:
                        at = record.started_at_unix_s + (outcome.first_token_at_s - walk.arrived_s)
                        walk.trace.event("first_token", at_unix_s=at)
            except RetryableUpstream as exc:
                self.report_failure(endpoint, time.monotonic())
                exclude.add(endpoint.id)
                last_detail = exc.detail
                if self.metrics is not None:
                    kind = f"http_{exc.status}" if exc.status else "connect"
                    self.metrics.observe_upstream_error(endpoint.id, kind)
                log.warning("upstream %s failed before the first byte: %s", endpoint.id, exc.detail)
                continue
            except UpstreamRejected as exc:
                self.report_success(endpoint)
                if self.metrics is not None:
                    self.metrics.observe_upstream_error(endpoint.id, f"http_{exc.status}")
                await self._account(facts, model, ticket, None, walk, rejected_status=exc.status)
                return self._upstream_error_response(exc, walk, headers)
            except asyncio.CancelledError:
                outcome.aborted = True
                self._account_soon(facts, model, ticket, outcome, walk)
                raise
            finally:
                load.end()
                self.slo.ended(pool.name, running_slo)  # SLO: wake the pool's queue
            self.report_success(endpoint)
            queued_prediction = self._slo_unlearnable(walk)
            await self._account(facts, model, ticket, outcome, walk)
            if queued_prediction is not None:
                self._learn_queued(walk, queued_prediction, outcome)
            response = outcome.response
            assert response is not None
            if not facts.stream:
                for name, value in headers:
                    response.headers[name] = value
            return response
        if record.upstream_attempts == 0:
            raise _Exhausted(
                NoHealthyBackend(
                    f"No healthy endpoint can serve '{model}' right now.",
                    headers=[("retry-after", str(self.server.retry_after_s))],
                )
            )
        raise _Exhausted(UpstreamError(f"The upstream failed for '{model}': {last_detail}"))

    # SLO gate (DESIGN.md §2 step 7)
    def _slo_of(self, request: web.Request, facts: RequestFacts, policy: Policy, walk: Walk) -> None:
        """The effective SLO (class tightened by headers) into the walk and the facts routing reads."""
        ttft_ms, tpot_ms = parse_slo_headers(request.headers)
        slo = effective_slo(policy.slo_class(facts.principal), ttft_ms, tpot_ms)
        if slo is None:
            return
        walk.slo = slo
        facts.slo_ttft_ms, facts.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
        facts.attrs[RUNNING_TPOT_SLO_ATTR] = self.slo.running.floors
        if slo.class_name:
            walk.record.extra["slo_class"] = slo.class_name

    def _slo_verdict(
        self, facts: RequestFacts, routed: tuple[Pool, RouteDecision], model: str, walk: Walk
    ) -> Meet | Miss | None:
        """Decide over the router's predictions (or the chosen endpoint's alone, for routers that
        make none); None when nothing can be predicted (predictor disabled): proceed."""
        assert walk.slo is not None
        pool, decision = routed
        made = facts.attrs.get(PREDICTIONS_ATTR)
        if not isinstance(made, dict) or decision.endpoint.id not in made:
            if self.predictor is None:
                return None
            made = {decision.endpoint.id: self._predict(facts, pool, decision, model)}
            facts.attrs[PREDICTIONS_ATTR] = made
        return decide(
            walk.slo,
            made.values(),
            priority=facts.principal.priority,
            running_tpot_slo_ms=self.slo.running.floors,
            elapsed_ms=(time.perf_counter() - walk.arrived_s) * 1000.0,
        )

    def _slo_restrict(
        self, facts: RequestFacts, routed: tuple[Pool, RouteDecision], verdict: Meet | Miss | None, exclude: set[str]
    ) -> tuple[Pool, RouteDecision]:
        """When the router's choice misses the SLO but others meet it, route again among those."""
        if not isinstance(verdict, Meet) or routed[1].endpoint.id in verdict.endpoint_ids:
            return routed
        made = facts.attrs[PREDICTIONS_ATTR]
        missing = {endpoint_id for endpoint_id in made if endpoint_id not in verdict.endpoint_ids}
        again = self._route(facts, [routed[0]], exclude | missing)
        facts.attrs[PREDICTIONS_ATTR] = made  # the verdict's predictions, for reuse and learning
        return again or routed

    def _slo_route(
        self, facts: RequestFacts, pools: Sequence[Pool], exclude: set[str], model: str, walk: Walk
    ) -> tuple[tuple[Pool, RouteDecision] | None, Meet | Miss | None]:
        """Route and decide again (a queued request after a wake-up)."""
        facts.attrs.pop(PREDICTIONS_ATTR, None)
        routed = self._route(facts, pools, exclude)
        if routed is None:
            return None, None
        verdict = self._slo_verdict(facts, routed, model, walk)
        return self._slo_restrict(facts, routed, verdict, exclude), verdict

    async def _slo_gate(
        self,
        facts: RequestFacts,
        pools: Sequence[Pool],
        exclude: set[str],
        routed: tuple[Pool, RouteDecision],
        model: str,
        walk: Walk,
    ) -> tuple[Pool, RouteDecision]:
        """DESIGN §2 step 7: proceed on an endpoint that meets the SLO, or act on the miss (SloMiss)."""
        slo = walk.slo
        assert slo is not None
        verdict = self._slo_verdict(facts, routed, model, walk)
        routed = self._slo_restrict(facts, routed, verdict, exclude)
        record = walk.record
        if isinstance(verdict, Meet) and verdict.idle_only:
            record.extra["slo_idle_admit"] = True  # none meets it; an idle endpoint always admits
        if not isinstance(verdict, Miss) or verdict.action == "proceed":
            return routed
        if verdict.action != "queue":
            raise slo_miss(verdict, slo, model, REASON_SHED if verdict.action == "shed" else REASON_UNATTAINABLE)
        if self.slo.queue.queued(slo.class_name) >= slo.max_queued:
            raise slo_miss(verdict, slo, model, REASON_QUEUE_FULL)
        started_s = time.perf_counter()
        deadline_s = started_s + slo.max_queue_ms / 1000.0
        if slo.ttft_ms is not None:  # past the TTFT objective, waiting cannot help any more
            deadline_s = min(deadline_s, walk.arrived_s + slo.ttft_ms / 1000.0)
        last: list[Miss] = [verdict]

        def attempt() -> tuple[Pool, RouteDecision] | None:
            found, again = self._slo_route(facts, pools, exclude, model, walk)
            if found is None or isinstance(again, Miss):
                if isinstance(again, Miss):
                    last[0] = again
                return None
            return found

        with walk.trace.span("slo_queue", model=model):
            found = await self.slo.queue.wait_for(routed[0].name, slo, facts.principal.priority, deadline_s, attempt)
        walk.slo_queued_s = time.perf_counter() - started_s
        record.extra["slo_queue_ms"] = round(walk.slo_queued_s * 1000.0, 3)
        if found is None:
            raise slo_miss(last[0], slo, model, REASON_QUEUE_TIMEOUT, waited_ms=walk.slo_queued_s * 1000.0)
        record.reject_reason = REASON_QUEUED
        return found

    def _slo_unlearnable(self, walk: Walk) -> Prediction | None:
        """A queued request's TTFT includes its wait: keep its prediction away from `_learn`."""
        if not walk.slo_queued_s or walk.prediction is None:
            return None
        prediction, walk.prediction = walk.prediction, None
        return prediction

    def _first_token(self, pool: str, walk: Walk, first_token_at_s: float) -> None:
        """The predictor hears of a first token as it is relayed, not when the request ends: the
        last second's TTFT errors correct its next TTFT predictions (predictor/recent.py)."""
        if self.predictor is not None and walk.prediction is not None:
            ttft_ms = (first_token_at_s - walk.arrived_s - walk.slo_queued_s) * 1000.0  # from dispatch
            self.predictor.observe_first_token(pool, walk.prediction, ttft_ms)

    def _learn_queued(self, walk: Walk, prediction: Prediction, outcome: RelayOutcome) -> None:
        """Learn from a queued request with its TTFT measured from dispatch, not arrival."""
        record = walk.record
        waited_ms = walk.slo_queued_s * 1000.0
        record.predicted_ttft_ms = prediction.ttft_ms + waited_ms  # as the client sees it
        record.predicted_tpot_ms = prediction.tpot_ms
        if self.predictor is None or outcome.aborted or outcome.broken or record.ttft_s is None:
            return
        tpot_ms = record.tpot_s * 1000 if record.tpot_s is not None else None
        ttft_ms = max(record.ttft_s * 1000 - waited_ms, 0.0)
        self.predictor.observe(record.pool, prediction.features, ttft_ms, tpot_ms, predicted=prediction)

    def _release_soon(self, ticket: Any) -> None:
        """Release a reservation from a cancelled request, in a task the cancellation cannot cut."""
        task = asyncio.get_running_loop().create_task(self.admission.release(ticket))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _upstream_error_response(
        self, exc: UpstreamRejected, walk: Walk, headers: list[tuple[str, str]]
    ) -> web.Response:
        """An engine's 4xx, passed on in OpenAI's error shape (engines differ: normalise)."""
        walk.record.status = "error"
        walk.record.http_status = exc.status
        if walk.call is not None:
            walk.record.error_code = "upstream_4xx"
            return walk.call.upstream_error(exc.status, exc.body, headers)
        body = openai_error(exc.status, exc.body)
        walk.record.error_code = str(body["error"]["code"] or "upstream_4xx")
        response = web.Response(status=exc.status, body=orjson.dumps(body), content_type="application/json")
        for name, value in headers:
            response.headers[name] = value
        return response

    # ------------------------------------------------------------------ account
    def _account_soon(self, facts: RequestFacts, model: str, ticket: Any, outcome: RelayOutcome, walk: Walk) -> None:
        """Accounting for a cancelled request: in its own task, so the cancellation cannot cut it."""
        self._fill_record(facts, model, outcome, walk)
        usage = outcome.usage
        counted = outcome.counted_completion_tokens
        task = asyncio.get_running_loop().create_task(
            self.admission.settle(ticket, usage, model=model, charged_output_tokens=counted)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _account(
        self,
        facts: RequestFacts,
        model: str,
        ticket: Any,
        outcome: RelayOutcome | None,
        walk: Walk,
        rejected_status: int | None = None,
    ) -> None:
        with walk.trace.span("accounting"):
            if outcome is None:
                await self.admission.settle(ticket, Usage(), model=model, charged_output_tokens=0)
                return
            self._fill_record(facts, model, outcome, walk)
            await self.admission.settle(
                ticket, outcome.usage, model=model, charged_output_tokens=outcome.counted_completion_tokens
            )

    def _learn(self, facts: RequestFacts, model: str, record: RequestRecord, prediction: Prediction | None) -> None:
        """Feed the predictor: latency samples (streamed requests show TTFT/TPOT) and output lengths."""
        assert self.predictor is not None
        if record.usage_source == "engine" and facts.api != "embeddings":
            self.predictor.observe_output(facts.principal.tenant, model, record.completion_tokens)
        if prediction is None or record.ttft_s is None:
            return
        tpot_ms = record.tpot_s * 1000 if record.tpot_s is not None else None
        self.predictor.observe(record.pool, prediction.features, record.ttft_s * 1000, tpot_ms, predicted=prediction)

    def _fill_record(self, facts: RequestFacts, model: str, outcome: RelayOutcome, walk: Walk) -> None:
        record = walk.record
        record.stream = facts.stream
        usage = outcome.usage
        if usage is not None:
            record.usage_source = "engine"
        elif outcome.counted_completion_tokens or outcome.aborted or outcome.broken:
            usage = Usage(prompt_tokens=facts.prompt_tokens, completion_tokens=outcome.counted_completion_tokens)
            record.usage_source = "counted"
        if usage is not None:
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            record.cached_tokens = usage.cached_tokens
            record.cost_usd = price_usd(self.policies.current, model, usage)
        if outcome.first_token_at_s is not None and facts.stream:
            record.ttft_s = outcome.first_token_at_s - walk.arrived_s
            if outcome.last_token_at_s is not None and record.completion_tokens > 1:
                record.tpot_s = (outcome.last_token_at_s - outcome.first_token_at_s) / (record.completion_tokens - 1)
        if outcome.engine_metrics:
            record.extra["engine"] = outcome.engine_metrics
        if walk.prediction is not None:
            record.predicted_ttft_ms = walk.prediction.ttft_ms
            record.predicted_tpot_ms = walk.prediction.tpot_ms
        if self.predictor is not None and not outcome.aborted and not outcome.broken:
            self._learn(facts, model, record, walk.prediction)
        if outcome.aborted:
            record.status = "aborted"
            record.http_status = 499
        elif outcome.broken:
            record.status = "error"
            record.error_code = "upstream_error"


def _prediction_header(p: Prediction) -> str:
    """`x-tokenway-prediction` (debug): what the predictor expected of the serving endpoint, in ms."""
    return (
        f"ttft={p.ttft_ms:.2f};ttft_p90={p.ttft_p90_ms:.2f};tpot={p.tpot_ms:.3f};tpot_p90={p.tpot_p90_ms:.3f};"
        f"source={p.source};version={p.model_version}"
    )
