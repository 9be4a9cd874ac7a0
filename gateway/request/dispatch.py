"""Dispatch: one model's attempt at serving the request.

route → gate hooks → dispatched hooks → PD prefill leg → relay, and again on another endpoint of the
model when the upstream fails before the first byte (`server.upstream_retries` times). When no
endpoint could serve, a `Detour` with trigger `upstream_error` hands the request back to the
director's fallback chain. Sent is settled: from the moment a relay begins, the request's
reservation is charged with what it used, whatever happens next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from backends.adapters.registry import get_adapter
from backends.config import EjectionSettings
from backends.errors import PdError
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, LoadTicket
from gateway.app.settings import ServerSettings
from gateway.errors import EngineRejected, NoHealthyBackend, UpstreamError
from gateway.request.accounting import Accounting
from gateway.request.apis import NativeApi, native_body
from gateway.request.context import RequestContext, Routed
from gateway.request.detour import Detour
from gateway.request.hooks import Hooks
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.client import CallWatch, Response, UpstreamClient
from gateway.upstream.engine_control import engine_body
from gateway.upstream.engine_errors import engine_fault, request_status
from gateway.upstream.migrate import Resumer, can_migrate
from gateway.upstream.relay import (
    RelayOutcome,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTarget,
    call_json,
    open_stream,
    relay_stream,
    relay_unary,
)
from gateway.upstream.stalls import DEADLINE, StallWatch
from policies.routing.types import RouteDecision, Router
from policies.types import ApiKind
from predictor.types import Prediction

log = logging.getLogger("tokenway.request")

BodyShaper = Callable[[Endpoint, dict[str, Any], ApiKind], dict[str, Any]]


def _identity_shape(endpoint: Endpoint, body: dict[str, Any], api: ApiKind) -> dict[str, Any]:
    return body


def _no_report(endpoint: Endpoint) -> None:
    return None


def _no_failure(endpoint: Endpoint, now_s: float) -> None:
    return None


class Dispatch:
    def __init__(
        self,
        *,
        server: ServerSettings,
        fleet: Fleet,
        upstream: UpstreamClient,
        router: Router,
        hooks: Hooks,
        accounting: Accounting,
        metrics: GatewayMetrics | None = None,
        shape_body: BodyShaper = _identity_shape,
        report_success: Callable[[Endpoint], None] = _no_report,
        report_failure: Callable[[Endpoint, float], None] = _no_failure,
        stalls: StallWatch | None = None,
    ) -> None:
        self.server = server
        # first-token deadlines and stalled replicas (gateway/upstream/stalls.py; the app runs its checks)
        self.stalls = stalls or StallWatch(fleet, server.first_token_deadline, server.stall_after_s, EjectionSettings())
        self.fleet = fleet
        self.upstream = upstream
        self.router = router
        self.hooks = hooks
        self.accounting = accounting
        self.metrics = metrics
        self.shape_body = shape_body
        self.report_success = report_success
        self.report_failure = report_failure

    async def serve(self, ctx: RequestContext) -> web.StreamResponse:
        """Serve on `ctx.model` (its reservation held), or raise `Detour("upstream_error")`."""
        pools = self.fleet.pools_for_model(ctx.model)
        exclude: set[str] = set()
        last_detail = ""
        attempts = 0
        crashes, crash_detail = 0, ""  # engines that failed on this request's content (engine_errors.engine_fault)
        for _ in range(1 + self.server.upstream_retries):
            with ctx.trace.span("routing", model=ctx.model):
                routed = self.route(ctx, pools, exclude)
            if routed is None:
                break

            def reroute(more: Collection[str], pools: Sequence[Pool] = pools) -> Routed | None:
                return self.route(ctx, pools, exclude.union(more))

            routed = await self.hooks.gate(ctx, routed, reroute)
            attempts += 1
            endpoint = routed.endpoint
            watch = self.stalls.begin(endpoint, stream=ctx.facts.stream)
            # a deadline only while another endpoint may still take it: the last try waits for the engine
            deadline = attempts <= self.server.upstream_retries and self._others(pools, exclude, endpoint)
            try:
                response = await self._attempt(ctx, routed, watch, deadline)
            except RetryableUpstream as exc:
                fault = engine_fault(exc.status, exc.body) if exc.status else "endpoint"
                kind = f"http_{exc.status}" if exc.status else "connect"
                if watch.reason == DEADLINE:  # slow or frozen, not failed: the stall watch judges it
                    self.stalls.missed_first_token(endpoint)
                    kind = "first_token_deadline"
                elif watch.reason:  # its replica stalled (and was ejected)
                    kind = "stalled"
                elif exc.status:  # the engine answered 5xx: the endpoint's fault only if another serves it
                    ctx.answered_5xx.append(endpoint)
                else:  # no answer at all: that is the endpoint's
                    self.report_failure(endpoint, time.monotonic())
                exclude.add(endpoint.id)
                last_detail = f"cut: {watch.reason}" if watch.reason else exc.detail
                ctx.outcome = None  # nothing reached the client: this attempt is not charged
                if self.metrics is not None:
                    self.metrics.observe_upstream_error(endpoint.id, kind)
                log.warning("upstream %s failed before the first byte: %s", endpoint.id, last_detail)
                if fault == "request":  # the engine says the request is wrong: so it is everywhere
                    raise Detour(
                        "upstream_error", EngineRejected(request_status(exc.body), exc.body), fallback=False
                    ) from None
                if fault == "crash":
                    crashes, crash_detail = crashes + 1, exc.detail
                    if crashes >= 2:  # the request made two engines fail: it is the request
                        raise Detour(
                            "upstream_error", _crashed(ctx.model, crashes, exc.detail), fallback=False
                        ) from None
                continue
            finally:
                self.stalls.end(watch)
            if ctx.outcome is not None:  # served (an engine's 4xx is the request's fault, not theirs)
                for failed in ctx.answered_5xx:  # they answered 5xx to what another endpoint served
                    self.report_failure(failed, time.monotonic())
            ctx.answered_5xx.clear()
            return response
        if attempts == 0:
            error: NoHealthyBackend | UpstreamError = NoHealthyBackend(
                f"No healthy endpoint can serve '{ctx.model}' right now.",
                headers=[("retry-after", str(self.server.retry_after_s))],
            )
        elif crashes:  # an engine failed on it: never walked down the fallback chain
            raise Detour("upstream_error", _crashed(ctx.model, crashes, crash_detail), fallback=False)
        else:
            error = UpstreamError(f"The upstream failed for '{ctx.model}': {last_detail}")
        raise Detour("upstream_error", error)

    @staticmethod
    def _others(pools: Sequence[Pool], exclude: Collection[str], endpoint: Endpoint) -> bool:
        """Whether an endpoint besides `endpoint` (and those tried) could take the request."""
        return any(e is not endpoint and e.id not in exclude for pool in pools for e in pool.servable())

    def route(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None:
        assert ctx.routing is not None
        now = time.monotonic()
        for pool in pools:
            decision = self.router.route(ctx.routing, pool, now, exclude)
            if decision is not None:
                return Routed(pool, decision)
        return None

    async def _attempt(
        self, ctx: RequestContext, routed: Routed, watch: CallWatch | None = None, deadline: bool = False
    ) -> web.StreamResponse:
        facts, record = ctx.facts, ctx.record
        decision = routed.decision
        endpoint = decision.endpoint
        self.commit(ctx, routed)
        api = ctx.api
        try:
            # a translated API writes the engine's own API where it has it, else chat completions
            path, upstream_api, body = api.upstream(facts, endpoint, decision.prefill_endpoint is not None)
            body = self._shaped(ctx, endpoint, body, self._engine_body(ctx, endpoint, body, upstream_api), upstream_api)
            local_prefill = max(facts.prompt_tokens - decision.cached_tokens_estimate, 0)
            if decision.prefill_endpoint is not None:
                decode_body = await self._prefill_leg(ctx, decision, body, path)
                if decode_body is not None:
                    body, local_prefill = decode_body, 0
            target = self._target(ctx, endpoint, body, path)
            target.watch = watch
            headers = api.response_headers(self.response_headers(ctx, decision))
            load = endpoint.inflight.begin(local_prefill)
            presumed = (
                None
                if facts.stream
                else presume_prefilled(load, decision, facts.prompt_tokens + facts.output_reservation)
            )
            outcome = ctx.outcome = RelayOutcome()
            if facts.stream and watch is not None and deadline:  # moved elsewhere if no token comes by then
                self.stalls.arm(watch, ctx.prediction or decision.prediction)
                outcome.on_first_token = partial(_first_token, watch, self.hooks, ctx)
            elif facts.stream and self.hooks.want_first_token:
                outcome.on_first_token = partial(self.hooks.first_token, ctx)
            record.gateway_overhead_s = time.perf_counter() - ctx.arrived_s
            try:
                with ctx.trace.span("upstream", endpoint=endpoint.id, model=ctx.model):
                    if facts.stream:
                        assert ctx.http is not None, "a request made inside the gateway is not streamed"
                        await relay_stream(
                            self.upstream,
                            _client_request(ctx),
                            target,
                            load,
                            outcome,
                            client_wants_usage=facts.include_usage,
                            response_headers=headers,
                            prompt_tokens=facts.prompt_tokens + facts.output_reservation,
                            codec=api.stream_codec(
                                ctx.model, facts.prompt_tokens + facts.output_reservation, facts.prompt_tokens
                            ),
                            resume=self._resumer(ctx, routed, path),
                        )
                    else:
                        transform = api.unary_transform(ctx.model)
                        outcome = ctx.outcome = await relay_unary(self.upstream, target, load, transform)
                    if outcome.first_token_at_s is not None:
                        at = record.started_at_unix_s + (outcome.first_token_at_s - ctx.arrived_s)
                        ctx.trace.event("first_token", at_unix_s=at)
            except UpstreamRejected as exc:
                self.report_success(endpoint)
                if self.metrics is not None:
                    self.metrics.observe_upstream_error(endpoint.id, f"http_{exc.status}")
                ctx.outcome = None
                error = EngineRejected(exc.status, exc.body)
                await self.accounting.settle_unused(ctx, error)
                return api.engine_error(error, exc.body, headers)  # in the API's own error shape
            finally:
                if presumed is not None:
                    presumed.cancel()
                load.end()
        finally:
            self.hooks.ended(ctx)
        self.report_success(endpoint)
        await self.accounting.settle(ctx)
        response = outcome.response
        assert response is not None
        if not facts.stream:
            for name, value in headers:
                response.headers[name] = value
        return response

    def commit(self, ctx: RequestContext, routed: Routed) -> None:
        """The walk goes with `routed`: the record, the router (prefix index, session) and the
        dispatched hooks hear of it. (The endpoint picker commits here and lets Envoy send.)"""
        ctx.routed = routed
        self._note_route(ctx, routed)
        assert ctx.routing is not None
        self.router.on_dispatch(ctx.routing, routed.decision)
        self.hooks.dispatched(ctx)

    def _note_route(self, ctx: RequestContext, routed: Routed) -> None:
        record, decision, pool = ctx.record, routed.decision, routed.pool
        endpoint = decision.endpoint
        record.pool, record.endpoint, record.route_reason = pool.name, endpoint.id, decision.reason
        record.engine = endpoint.engine
        record.served_model = endpoint.served_model
        record.pd_reason = decision.pd_reason
        record.prefill_endpoint = decision.prefill_endpoint.id if decision.prefill_endpoint is not None else ""
        if self.metrics is not None:
            self.metrics.observe_route(
                decision.reason,
                pool.name,
                prompt_tokens=ctx.facts.prompt_tokens,
                estimated_hit_tokens=decision.cached_tokens_estimate,
            )
            if record.upstream_attempts:
                self.metrics.observe_retry(pool.name)
        record.upstream_attempts += 1

    def response_headers(self, ctx: RequestContext, decision: RouteDecision) -> list[tuple[str, str]]:
        assert ctx.reservation is not None
        headers = [
            *ctx.headers,
            *ctx.reservation.ticket.headers,
            ("x-tokenway-model", ctx.model),
            ("x-tokenway-endpoint", decision.endpoint.id),
        ]
        if ctx.facts.debug:
            headers.append(("x-tokenway-route", decision.debug_header()))
            if ctx.unforwarded_fields:
                headers.append(("x-tokenway-dropped-fields", ",".join(ctx.unforwarded_fields)))
            source = ctx.facts.prompt_tokens_source
            headers.append(("x-tokenway-prompt-tokens", f"{ctx.facts.prompt_tokens};source={source}"))
            if ctx.prediction is not None:
                headers.append(("x-tokenway-prediction", _prediction_header(ctx.prediction)))
        if ctx.gate_wait_s:
            headers.append(("x-tokenway-queued-ms", f"{ctx.gate_wait_s * 1000:.0f}"))
        return headers

    def _resumer(self, ctx: RequestContext, routed: Routed, path: str) -> Resumer | None:
        """How a plain stream continues on another replica of its pool if its own cuts it
        (`gateway/upstream/migrate.py`); None where the pool or the request does not allow it."""
        facts, pool = ctx.facts, routed.pool
        native = isinstance(ctx.api, NativeApi)  # a translated API's stream is not continued
        if not native or not pool.config.migrates_streams or not can_migrate(facts.body, facts.api):
            return None

        def route(avoid: frozenset[str]) -> Endpoint | None:
            found = self.route(ctx, [pool], avoid)
            return found.endpoint if found is not None else None

        async def send(endpoint: Endpoint, body: dict[str, Any]) -> Response | None:
            target = self._target(ctx, endpoint, self.upstream_body(ctx, endpoint, body), path)
            try:
                return await open_stream(self.upstream, target)
            except (RetryableUpstream, UpstreamRejected) as exc:
                log.warning("stream continuation on %s failed: %s", endpoint.id, exc)
                return None

        def others(avoid: frozenset[str]) -> bool:
            return any(e.id not in avoid for e in pool.endpoints)

        async def wait_turn() -> Endpoint | None:
            """A preempted stream waits its turn at the gate again, like any request of the pool."""

            def reroute(more: Collection[str]) -> Routed | None:
                return self.route(ctx, [pool], more)

            found = reroute(())
            if found is None:
                return None
            try:
                turn = await self.hooks.gate(ctx, found, reroute)
            except Detour as detour:
                log.warning("a preempted stream found no turn: %s", detour.trigger)
                return None
            return turn.endpoint

        return Resumer(facts.body, facts.api, facts.prompt_tokens, routed.endpoint.id, route, send, others, wait_turn)

    def upstream_body(
        self, ctx: RequestContext, endpoint: Endpoint, client_body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The body `endpoint` gets for this request (the endpoint picker's: Envoy sends it), or for
        `client_body`, a native stream's continuation of it (`gateway/upstream/migrate.py`)."""
        if client_body is None:
            _path, upstream_api, body = ctx.api.upstream(ctx.facts, endpoint, False)
        else:
            body, upstream_api = native_body(ctx.facts, endpoint, client_body), ctx.facts.api
        return self._shaped(ctx, endpoint, body, self._engine_body(ctx, endpoint, body, upstream_api), upstream_api)

    def _shaped(
        self, ctx: RequestContext, endpoint: Endpoint, sent: dict[str, Any], body: dict[str, Any], api: ApiKind
    ) -> dict[str, Any]:
        """The engine adapter's cut of `body`; on debug, the fields of `sent` (the client's body, or its
        translation) that do not reach the engine are named in `x-tokenway-dropped-fields`: engine-control
        fields the policy took out, and those the adapter does not forward (e.g. `top_k` to a remote
        OpenAI pool without extra_request_fields). Fields the gateway adds itself are not named."""
        shaped = self.shape_body(endpoint, body, api)
        if ctx.facts.debug:
            ctx.unforwarded_fields = tuple(sorted({*ctx.dropped_fields, *(k for k in sent if k not in shaped)}))
        return shaped

    def _engine_body(
        self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], api: ApiKind
    ) -> dict[str, Any]:
        """A copy of `body` whose engine-control fields are the policy's: a client's dropped unless its
        tenant may set them, the scheduling priority from its tier, the output limit the reservation
        on this model, the cache salt the tenant's (gateway/upstream/engine_control.py)."""
        reserved = ctx.reservation.ticket.output_tokens if ctx.reservation is not None else 0
        return engine_body(
            body,
            ctx.facts.principal,
            ctx.engine_fields,
            api=api,
            reserved_output_tokens=reserved if ctx.api.generates else 0,
            context_room=endpoint.max_model_len - ctx.facts.prompt_tokens if endpoint.max_model_len else None,
            cache_salt=ctx.facts.cache_salt,
        )

    def _target(self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], path: str) -> UpstreamTarget:
        headers = {"Content-Type": "application/json", "x-request-id": ctx.facts.request_id}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        traceparent = ctx.trace.traceparent()
        if traceparent:
            headers["traceparent"] = traceparent
        return UpstreamTarget(
            url=endpoint.base_url + path,
            headers=headers,
            body=orjson.dumps(body),
            served_model=endpoint.served_model,
            public_model=ctx.model,
        )

    async def _prefill_leg(
        self, ctx: RequestContext, decision: RouteDecision, body: dict[str, Any], path: str
    ) -> dict[str, Any] | None:
        """Run the PD prefill leg; the decode leg's body, or None when the decode endpoint must prefill.

        A failed prefill leg (refused, 5xx, 4xx, no transfer params) is a KV-transfer failure: counted,
        and the request continues as prefill + decode on the decode endpoint.
        """
        prefill = decision.prefill_endpoint
        assert prefill is not None
        adapter = get_adapter(decision.endpoint.engine)
        load = prefill.inflight.begin(decision.uncached_prefill_tokens(ctx.facts.prompt_tokens))
        try:
            leg = self._target(ctx, prefill, adapter.prefill_leg_body(body), path)
            with ctx.trace.span("prefill", endpoint=prefill.id):
                answer = await call_json(self.upstream, leg)
            decode_body = adapter.decode_leg_body(body, answer)
        except (RetryableUpstream, UpstreamRejected, PdError) as exc:
            if isinstance(exc, RetryableUpstream) and exc.status:
                ctx.answered_5xx.append(prefill)  # counted only if the decode endpoint then serves it
            elif isinstance(exc, RetryableUpstream):
                self.report_failure(prefill, time.monotonic())
            ctx.record.kv_transfer_failed = True
            log.warning("PD prefill leg on %s failed, decoding endpoint prefills: %s", prefill.id, exc)
            return None
        finally:
            load.end()
        self.report_success(prefill)
        if "kv_transfer_params" not in decode_body and "disaggregated_params" not in decode_body:
            ctx.record.kv_transfer_failed = True
            return None
        return decode_body


def presume_prefilled(load: LoadTicket, decision: RouteDecision, context_tokens: int) -> asyncio.TimerHandle | None:
    """A non-streamed request shows no first token until its whole answer: its prompt counts as
    prefilled (no longer pending on the endpoint, for routing and flow control's clear lane) once its
    predicted TTFT has passed, when the router predicted one; without a prediction, at the answer."""
    prediction = decision.prediction
    if prediction is None or not load.prefill_tokens:
        return None
    loop = asyncio.get_running_loop()
    return loop.call_later(max(prediction.ttft_ms, 0.0) / 1000.0, load.first_token, context_tokens)


def _first_token(watch: CallWatch, hooks: Hooks, ctx: RequestContext, at_s: float) -> None:
    """The first token is relayed: its deadline no longer applies; the hooks hear of it."""
    watch.disarm()
    if hooks.want_first_token:
        hooks.first_token(ctx, at_s)


def _crashed(model: str, crashes: int, detail: str) -> UpstreamError:
    """The answer to a request that made engines fail (a 5xx with an error body): not retried further,
    not sent to a fallback model, and the client's SDK is told not to send it again."""
    where = "two replicas" if crashes > 1 else "its replica"
    return UpstreamError(
        f"The engine serving '{model}' failed on this request on {where}; it was not retried further: {detail}",
        headers=[("x-should-retry", "false")],
    )


def _prediction_header(p: Prediction) -> str:
    """`x-tokenway-prediction` (debug): what the predictor expected of the serving endpoint, in ms."""
    return (
        f"ttft={p.ttft_ms:.2f};ttft_p90={p.ttft_p90_ms:.2f};tpot={p.tpot_ms:.3f};tpot_p90={p.tpot_p90_ms:.3f};"
        f"source={p.source};version={p.model_version}"
    )


def _client_request(ctx: RequestContext) -> web.Request:
    assert ctx.http is not None, "only the HTTP gateway relays (the endpoint picker lets Envoy do it)"
    return ctx.http
