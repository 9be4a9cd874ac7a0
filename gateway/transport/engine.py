"""The engine transport: a routed request relayed to its engine over HTTP, the answer to the client.

    the API's request for the endpoint (`Api.upstream`: a translated API writes chat completions
    where the engine lacks its own) → the engine-control fields as policy allows → the adapter's cut
    → the PD prefill leg (`pd.py`) → the relay (`gateway/upstream/relay.py`: streamed or whole,
    through the API's codec) → settled

It keeps the seam's contract (`gateway/request/transport.py`): the `ended` hooks once per send, the
reservation settled once anything reached an engine, `NotSent` for a failure before the first
byte, classified here (a replica that stalled or missed its first-token deadline, a 5xx, no answer,
an engine that says the request is wrong or crashed on it: `gateway/upstream/engine_errors.py`).
A plain stream cut mid-way continues on another replica of its pool (`_resumer`), and for a model
with `stream_failover`, then on its fallback model (`_failover`, `failover.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import partial
from typing import Any, Protocol

import orjson
from aiohttp import web

from backends.config import EjectionSettings
from backends.fleet import Fleet, Pool
from backends.lora import LoraAdapter
from backends.types import Endpoint, LoadTicket
from gateway.app.settings import ServerSettings
from gateway.errors import EngineRejected, GatewayError, UpstreamError
from gateway.request.accounting import Accounting
from gateway.request.apis import NativeApi, Translation, native_body
from gateway.request.context import RequestContext, Routed
from gateway.request.debug import debug_headers
from gateway.request.detour import Detour
from gateway.request.hooks import Hooks
from gateway.request.transport import NotSent
from gateway.telemetry.metrics import GatewayMetrics
from gateway.transport import failover
from gateway.transport.lora import AdapterLoader, LoadFailed, fleet_budget
from gateway.transport.lora_keeper import AdapterKeeper
from gateway.transport.pd import prefill_leg
from gateway.upstream.client import CallWatch, Response, UpstreamClient
from gateway.upstream.engine_control import engine_body
from gateway.upstream.engine_errors import engine_fault, request_status
from gateway.upstream.migrate import Resumer, can_fail_over, can_migrate
from gateway.upstream.relay import (
    RelayOutcome,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTarget,
    open_stream,
    relay_stream,
    relay_unary,
)
from gateway.upstream.stalls import DEADLINE, StallWatch
from policies.routing.types import RouteDecision
from policies.types import ApiKind

log = logging.getLogger("tokenway.request")


class Turns(Protocol):
    """The walk's routing and gate (`gateway/request/dispatch.py`'s `Dispatch`), for a cut stream."""

    def route(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None: ...

    async def turn(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None: ...


BodyShaper = Callable[[Endpoint, dict[str, Any], ApiKind], dict[str, Any]]


def _identity_shape(endpoint: Endpoint, body: dict[str, Any], api: ApiKind) -> dict[str, Any]:
    return body


def _no_report(endpoint: Endpoint) -> None:
    return None


def _no_failure(endpoint: Endpoint, now_s: float) -> None:
    return None


def _no_event(adapter: str, event: str) -> None:
    return None


class EngineTransport:
    follows = False

    def __init__(
        self,
        *,
        server: ServerSettings,
        fleet: Fleet,
        upstream: UpstreamClient,
        hooks: Hooks,
        accounting: Accounting,
        turns: Turns,
        metrics: GatewayMetrics | None = None,
        shape_body: BodyShaper = _identity_shape,
        report_success: Callable[[Endpoint], None] = _no_report,
        report_failure: Callable[[Endpoint, float], None] = _no_failure,
        stalls: StallWatch | None = None,
    ) -> None:
        # first-token deadlines and stalled replicas (gateway/upstream/stalls.py; the app runs its checks)
        self.stalls = stalls or StallWatch(fleet, server.first_token_deadline, server.stall_after_s, EjectionSettings())
        self.upstream = upstream
        self.hooks = hooks
        self.accounting = accounting
        self.turns = turns  # the walk's routing and gate, for a preempted stream's new turn
        self.metrics = metrics
        self.shape_body = shape_body
        self.report_success = report_success
        self.report_failure = report_failure
        self.fleet = fleet
        # LoRA adapters loaded on first demand (transport/lora.py); preloaded and idle-unloaded by the keeper
        self.lora = AdapterLoader(
            upstream,
            on_event=metrics.observe_lora_event if metrics is not None else _no_event,
            budget_of=fleet_budget(fleet),  # a pool's lora_memory_budget_mb: room made before a load
            adapter_of=fleet.adapter,
        )
        self.lora_keeper = AdapterKeeper(fleet, self.lora)
        self.lora.kept = self.lora_keeper.hot_on  # a pool's hottest adapters: evicted for the memory budget last

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        return set()

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        return ctx.render_error(error, headers)

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> web.StreamResponse:
        endpoint = routed.endpoint
        adapter = self.fleet.adapter(ctx.model)
        ctx.record.base_model = adapter.base_model if adapter is not None else None  # after any fallback
        if adapter is not None:
            await self._load_adapter(ctx, endpoint, adapter)
            self.lora.begin(endpoint, adapter.name)  # in use: the keeper does not unload it meanwhile
        watch = self.stalls.begin(endpoint, stream=ctx.facts.stream)
        try:
            response = await self._relay(ctx, routed, watch, deadline=not last)
        except RetryableUpstream as exc:
            raise self._not_sent(ctx, endpoint, watch, exc) from None
        finally:
            self.stalls.end(watch)
            if adapter is not None:
                self.lora.end(endpoint, adapter.name)
        if ctx.outcome is not None:  # served (an engine's 4xx is the request's fault, not theirs)
            for failed in ctx.answered_5xx:  # they answered 5xx to what another endpoint served
                self.report_failure(failed, time.monotonic())
        ctx.answered_5xx.clear()
        return response

    async def _load_adapter(self, ctx: RequestContext, endpoint: Endpoint, adapter: LoraAdapter) -> None:
        """Register the LoRA adapter on `endpoint` before its first request there; a refusal (4xx: the
        adapter is wrong everywhere) answers 502 naming it, no answer tries another endpoint."""
        try:
            await self.lora.ensure(endpoint, adapter)
        except LoadFailed as exc:
            self.hooks.ended(ctx)  # once per send, as `_relay` would
            log.warning("%s", exc.message)
            if exc.status:
                raise NotSent(exc.message, fault="request", error=UpstreamError(exc.message)) from None
            raise NotSent(exc.message, fault="endpoint") from None

    def _lost_adapter(self, ctx: RequestContext, endpoint: Endpoint, status: int) -> None:
        """An engine that restarted (or unloaded an adapter under its own rules) answers 404 for an adapter
        the gateway registered there: forget what the endpoint held and try again, so the next send loads
        it, instead of answering the client a 404 for a model the policy serves."""
        if status != 404:
            return
        adapter = self.fleet.adapter(ctx.model)
        if adapter is None or not self.lora.registered(endpoint, adapter.name):
            return
        self.lora.lost(endpoint, adapter.name)  # its listing too: the engine said otherwise since
        log.warning("endpoint %s no longer holds the adapter %s: loading it again", endpoint.id, adapter.name)
        raise NotSent(f"the adapter {adapter.name} was no longer loaded on {endpoint.id}", fault="adapter_lost")

    def _not_sent(self, ctx: RequestContext, endpoint: Endpoint, watch: CallWatch, exc: RetryableUpstream) -> NotSent:
        """What a failure before the first byte says, and whose it is."""
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
        detail = f"cut: {watch.reason}" if watch.reason else exc.detail
        if self.metrics is not None:
            self.metrics.observe_upstream_error(endpoint.id, kind)
        log.warning("upstream %s failed before the first byte: %s", endpoint.id, detail)
        if fault == "request":  # the engine says the request is wrong: so it is everywhere
            return NotSent(detail, fault="request", error=EngineRejected(request_status(exc.body), exc.body))
        return NotSent(exc.detail if fault == "crash" else detail, fault=fault)

    async def _relay(self, ctx: RequestContext, routed: Routed, watch: CallWatch, deadline: bool) -> web.StreamResponse:
        facts, record = ctx.facts, ctx.record
        decision = routed.decision
        endpoint = decision.endpoint
        api: Translation = ctx.api  # the client's API at the seam: what is sent, how the answer reads back
        try:
            # a translated API writes the engine's own API where it has it, else chat completions (and
            # always, for a stream that may fail over: a fallback model's continuation splices into chat)
            chat_only = decision.prefill_endpoint is not None or self._fails_over(ctx, routed)
            path, upstream_api, body = api.upstream(facts, endpoint, chat_only)
            unshaped = body
            body = self._shaped(ctx, endpoint, body, self._engine_body(ctx, endpoint, body, upstream_api), upstream_api)
            local_prefill = max(facts.prompt_tokens - decision.cached_tokens_estimate, 0)
            if decision.prefill_endpoint is not None:
                decode_body = await prefill_leg(self, ctx, decision, body, path)
                if decode_body is not None:
                    body, local_prefill = decode_body, 0
            target = self.target(ctx, endpoint, body, path)
            target.watch = watch
            headers = api.response_headers(answer_headers(ctx, decision))
            load = endpoint.inflight.begin(local_prefill)
            presumed = (
                None
                if facts.stream
                else presume_prefilled(load, decision, facts.prompt_tokens + facts.output_reservation)
            )
            outcome = ctx.outcome = RelayOutcome()
            outcome.price = price = self.accounting.price(ctx)  # show_cost: the cost in the final usage
            if facts.stream and deadline:  # moved elsewhere if no token comes by then
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
                            ctx.http,
                            target,
                            load,
                            outcome,
                            client_wants_usage=facts.include_usage,
                            response_headers=headers,
                            prompt_tokens=facts.prompt_tokens + facts.output_reservation,
                            codec=api.stream_codec(
                                ctx.model, facts.prompt_tokens + facts.output_reservation, facts.prompt_tokens
                            ),
                            resume=failover.chain(
                                self._resumer(ctx, routed, path),
                                self._failover(ctx, routed, path, upstream_api, unshaped),
                            ),
                        )
                    else:
                        transform = api.unary_transform(ctx.model)
                        outcome = ctx.outcome = await relay_unary(self.upstream, target, load, transform, price)
                    if outcome.first_token_at_s is not None:
                        at = record.started_at_unix_s + (outcome.first_token_at_s - ctx.arrived_s)
                        ctx.trace.event("first_token", at_unix_s=at)
            except UpstreamRejected as exc:
                self._lost_adapter(ctx, endpoint, exc.status)  # raises NotSent: retried, the adapter loaded again
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
            out = response.headers  # a property of aiohttp's: read once, not per header
            for name, value in headers:
                out[name] = value
            # what this answer cost the caller, priced by settle (policies' Price.cost_usd): docs/governance.md
            out["x-tokenway-cost-usd"] = f"{record.cost_usd:.9f}"
        return response

    def _resumer(self, ctx: RequestContext, routed: Routed, path: str) -> Resumer | None:
        """How a plain stream continues on another replica of its pool if its own cuts it
        (`gateway/upstream/migrate.py` splices it); None where the pool or the request does not allow
        it (a translated API's stream is not continued). A stream flow control preempted waits its
        new turn through the walk's routing and gate (`Dispatch.turn`), like any request of the pool."""
        facts, pool = ctx.facts, routed.pool
        if not pool.config.migrates_streams or not isinstance(ctx.api, NativeApi):
            return None
        if not can_migrate(facts.body, facts.api):
            return None
        turns = self.turns

        def route(avoid: frozenset[str]) -> Endpoint | None:
            found = turns.route(ctx, [pool], avoid)
            return found.endpoint if found is not None else None

        async def send(endpoint: Endpoint, body: dict[str, Any]) -> Response | None:
            target = self.target(ctx, endpoint, self.upstream_body(ctx, endpoint, body), path)
            try:
                return await open_stream(self.upstream, target)
            except (RetryableUpstream, UpstreamRejected) as exc:
                log.warning("stream continuation on %s failed: %s", endpoint.id, exc)
                return None

        def others(avoid: frozenset[str]) -> bool:
            return any(e.id not in avoid for e in pool.endpoints)

        async def wait_turn() -> Endpoint | None:
            try:
                turn = await turns.turn(ctx, [pool], ())
            except Detour as detour:
                log.warning("a preempted stream found no turn: %s", detour.trigger)
                return None
            return turn.endpoint if turn is not None else None

        return Resumer(facts.body, facts.api, facts.prompt_tokens, routed.endpoint.id, route, send, others, wait_turn)

    def _fails_over(self, ctx: RequestContext, routed: Routed) -> bool:
        """Whether a stream cut mid-answer may continue on a fallback model (`failover.py`): its model
        opted in, and its pool is an engine's (a hosted provider's stream is relayed by its own client)."""
        return ctx.facts.stream and not routed.pool.config.hosted and failover.enabled(ctx, self.accounting)

    def _failover(
        self, ctx: RequestContext, routed: Routed, path: str, api: ApiKind, sent: dict[str, Any]
    ) -> failover.Failover | None:
        """The failover of a stream (`failover.py`), None where it cannot have one: `sent` is the chat
        or completions body the first leg's engine got (before its cut), continued on a fallback model."""
        if not self._fails_over(ctx, routed) or api not in ("chat", "completions"):
            return None
        if not can_fail_over(ctx.facts.body if isinstance(ctx.api, NativeApi) else sent, api):
            return None
        turns = self.turns

        def route(ctx: RequestContext, pools: Sequence[Pool], avoid: Collection[str]) -> Routed | None:
            return turns.route(ctx, [p for p in pools if not p.config.hosted], avoid)

        async def open_leg(ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any]) -> Response | None:
            leg = native_body(ctx.facts, endpoint, body)
            leg = self._shaped(ctx, endpoint, leg, self._engine_body(ctx, endpoint, leg, api), api)
            try:
                return await open_stream(self.upstream, self.target(ctx, endpoint, leg, path))
            except (RetryableUpstream, UpstreamRejected) as exc:
                log.warning("stream failover to %s failed: %s", endpoint.id, exc)
                return None

        return failover.Failover(ctx, self.accounting, self.fleet, route, open_leg, sent, api)

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
        adapter = self.fleet.adapter(ctx.model)
        if adapter is not None and "model" in shaped:  # the engine serves an adapter under its own name
            shaped = {**shaped, "model": adapter.name}
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

    def target(self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], path: str) -> UpstreamTarget:
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
            served_model=adapter.name
            if (adapter := self.fleet.adapter(ctx.model)) is not None
            else endpoint.served_model,
            public_model=ctx.model,
        )


def answer_headers(ctx: RequestContext, decision: RouteDecision) -> list[tuple[str, str]]:
    """The gateway's headers on the answer: the request's, the limits', where it ran, how long it
    waited, and to an operator who asked, the debug headers (`gateway/request/debug.py`)."""
    assert ctx.reservation is not None
    headers = [
        *ctx.headers,
        *ctx.reservation.ticket.headers,
        ("x-tokenway-model", ctx.model),
        ("x-tokenway-endpoint", decision.endpoint.id),
    ]
    if ctx.facts.debug:
        headers += debug_headers(ctx, decision)
    if ctx.gate_wait_s:
        headers.append(("x-tokenway-queued-ms", f"{ctx.gate_wait_s * 1000:.0f}"))
    return headers


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
