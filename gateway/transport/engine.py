"""The engine transport: a routed request relayed to its engine over HTTP, the answer to the client.

    the API's request for the endpoint (`Api.upstream`: a translated API writes chat completions
    where the engine lacks its own) → the engine-control fields as policy allows → the adapter's cut
    → the PD prefill leg (below) → the relay (`gateway/upstream/relay.py`: streamed or whole,
    through the API's codec) → settled

It keeps the seam's contract (`gateway/request/context.py`): the `ended` hooks once per send, the
reservation settled once anything reached an engine, `NotSent` for a failure before the first
byte, classified here (a replica that stalled or missed its first-token deadline, a 5xx, no answer,
an engine that says the request is wrong or crashed on it: `gateway/upstream/engine_errors.py`).
A plain stream cut mid-way continues on another replica of its pool (`_resumer`), and for a model
with `stream_failover`, then on its fallback model (`_failover`, below).

The prefill leg and the failover to a fallback model live here too: both are legs of the engine
transport's send, called only from it, and each decides one thing its send needs (where the KV cache
comes from; where a cut stream goes when its pool has no replica left).

The PD prefill leg
------------------

A disaggregated request's prompt prefilled on the prefill endpoint the router
chose (`policies/routing/pd.py`), its KV cache handed to the decode endpoint through the transfer
parameters the prefill answer carries (the engine adapter writes both legs' bodies).

A failed leg (refused, 5xx, 4xx, no transfer parameters) is a KV-transfer failure: the record says
so and the request goes on as prefill + decode on the decode endpoint; a 5xx counts against the
prefill endpoint only if the decode endpoint then serves the request.

Failover inside a stream
------------------------

A stream cut mid-answer continues on the next model of its fallback chain.

A model with `stream_failover: true` (policies.yaml) lets a stream its engine cuts after the first
byte (a reset, a truncated stream, an error event) continue on a fallback model when no other replica
of its pool can take it (`gateway/upstream/replica_loss.py` moves it within the pool first). Why a leg of
its own: the fallback model has its own limits, budgets and price, so the new leg is a request to
admission like any (`Admission.admit` on the fallback model: a refusal ends the stream with the error
event, as a cut without failover does) and leaves its own record; the leg it ends is settled with what
it sent and recorded at once (`Accounting.close_leg`). Each leg is settled once and recorded once:
the records share the request's `x-request-id` stem (`<id>`, then `<id>.leg2`, ...), carry `leg` and
`continues` (the id of the leg before), and the stream's usage reports the first prompt and every
leg's output (docs/agents.md).

The continuation is the migration's (the prompt plus the text so far, `continue_final_message`, the
output budget less what was sent) sent to a replica of the fallback model, and spliced the same way:
the stream's id and created, the continuation's role chunk dropped, its usage rewritten; its chunks
name the fallback model, and a marker event in the client's grammar says where the switch happened.
The new leg is routed as a migration is (not queued by flow control: the client is mid-answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final, Protocol

import orjson
from aiohttp import web

from backends.config import EjectionSettings
from backends.fleet import Fleet, LoraAdapter, Pool, get_adapter
from backends.types import Endpoint, LoadTicket, PdError
from gateway.app.settings import ServerSettings
from gateway.errors import EngineRejected, GatewayError, Overloaded, UpstreamError
from gateway.request.accounting import Accounting, Reservation
from gateway.request.apis import NativeApi, Translation, native_body
from gateway.request.context import Hooks, NotSent, RequestContext, Routed
from gateway.request.director import Detour
from gateway.request.intake import debug_headers
from gateway.request.record import RequestRecord
from gateway.telemetry.metrics import GatewayMetrics
from gateway.transport.lora import AdapterKeeper, AdapterLoader, LoadFailed, fleet_budget
from gateway.upstream.client import CallWatch, Response, UpstreamClient
from gateway.upstream.engine_errors import engine_fault, request_status
from gateway.upstream.relay import (
    RelayOutcome,
    RetryableUpstream,
    UpstreamRejected,
    UpstreamTarget,
    call_json,
    engine_body,
    open_stream,
    relay_stream,
    relay_unary,
)
from gateway.upstream.replica_loss import (
    DEADLINE,
    Resume,
    Resumed,
    Resumer,
    StallWatch,
    can_fail_over,
    can_migrate,
    continuation_body,
)
from policies.policy import check_context, choose_fallback, context_tokens, price_usd
from policies.routing.types import RouteDecision
from policies.types import ApiKind, Rejection, Usage

# ---- The engine transport

log = logging.getLogger("tokenway.request")

# Pools whose usage is billed as reported, not bounded by the output limit they were sent
# (`RelayOutcome.bounded_usage`): Gemini's documentation and its answers disagree on whether
# `maxOutputTokens` covers thinking tokens, so a bound could bill less than the provider does.
# Every other pool's output limit is binding by its own documentation: vLLM's and TensorRT-LLM's
# `max_tokens`, Anthropic's `max_tokens` (thinking included), Bedrock Converse's `maxTokens`, Azure
# OpenAI's `max_completion_tokens` (reasoning included).
UNBOUNDED_OUTPUT: Final = frozenset({"gemini"})


class Turns(Protocol):
    """The walk's routing and gate (`gateway/request/director.py`'s `Dispatch`), for a cut stream."""

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
        # first-token deadlines and stalled replicas (gateway/upstream/replica_loss.py; the app runs its checks)
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
        if exc.exhausted:  # the gateway's own descriptors or buffers ran out: no endpoint failed
            if self.metrics is not None:
                self.metrics.observe_upstream_error(endpoint.id, "gateway_exhausted")
            log.warning("no connection to %s: the gateway is out of resources: %s", endpoint.id, exc.detail)
            busy = Overloaded(
                "The gateway cannot open a connection right now (it is out of file descriptors or socket "
                "buffers); retry shortly.",
                headers=[("retry-after", "1")],
            )
            return NotSent(exc.detail, fault="gateway", error=busy)
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
            if routed.pool.config.engine not in UNBOUNDED_OUTPUT and ctx.api.generates and ctx.reservation is not None:
                prompt_bound = self.accounting.prompt_bound(ctx.model, endpoint.max_model_len)
                outcome.bound_usage(ctx.reservation.ticket.output_tokens, prompt_bound)
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
                            resume=chain(
                                self._resumer(ctx, routed, path),
                                self._failover(ctx, routed, path, upstream_api, unshaped),
                            ),
                        )
                    else:
                        transform = api.unary_transform(ctx.model)
                        unary = await relay_unary(self.upstream, target, load, transform, price)
                        unary.bound_usage(outcome.output_cap, outcome.prompt_cap)
                        outcome = ctx.outcome = unary
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
        (`gateway/upstream/replica_loss.py` splices it); None where the pool or the request does not allow
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
        """Whether a stream cut mid-answer may continue on a fallback model (`Failover`, below): its model
        opted in, and its pool is an engine's (a hosted provider's stream is relayed by its own client)."""
        return ctx.facts.stream and not routed.pool.config.hosted and enabled(ctx, self.accounting)

    def _failover(
        self, ctx: RequestContext, routed: Routed, path: str, api: ApiKind, sent: dict[str, Any]
    ) -> Failover | None:
        """The failover of a stream (`Failover`), None where it cannot have one: `sent` is the chat
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

        return Failover(ctx, self.accounting, self.fleet, route, open_leg, sent, api)

    def upstream_body(
        self, ctx: RequestContext, endpoint: Endpoint, client_body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The body `endpoint` gets for this request (the endpoint picker's: Envoy sends it), or for
        `client_body`, a native stream's continuation of it (`gateway/upstream/replica_loss.py`)."""
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
        on this model, the cache salt the tenant's (gateway/upstream/relay.py)."""
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
    waited, and to an operator who asked, the debug headers (`gateway/request/intake.py`)."""
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


# ---- The PD prefill leg


async def prefill_leg(
    engine: EngineTransport, ctx: RequestContext, decision: RouteDecision, body: dict[str, Any], path: str
) -> dict[str, Any] | None:
    """Run the prefill leg; the decode leg's body, or None when the decode endpoint must prefill."""
    prefill = decision.prefill_endpoint
    assert prefill is not None
    adapter = get_adapter(decision.endpoint.engine)
    load = prefill.inflight.begin(decision.uncached_prefill_tokens(ctx.facts.prompt_tokens))
    try:
        leg = engine.target(ctx, prefill, adapter.prefill_leg_body(body), path)
        with ctx.trace.span("prefill", endpoint=prefill.id):
            answer = await call_json(engine.upstream, leg)
        decode_body = adapter.decode_leg_body(body, answer)
    except (RetryableUpstream, UpstreamRejected, PdError) as exc:
        if isinstance(exc, RetryableUpstream) and exc.status:
            ctx.answered_5xx.append(prefill)  # counted only if the decode endpoint then serves it
        elif isinstance(exc, RetryableUpstream) and not exc.exhausted:  # the gateway's own shortage blames none
            engine.report_failure(prefill, time.monotonic())
        ctx.record.kv_transfer_failed = True
        log.warning("PD prefill leg on %s failed, decoding endpoint prefills: %s", prefill.id, exc)
        return None
    finally:
        load.end()
    engine.report_success(prefill)
    if "kv_transfer_params" not in decode_body and "disaggregated_params" not in decode_body:
        ctx.record.kv_transfer_failed = True
        return None
    return decode_body


# ---- Failover inside a stream


TRIGGER = "upstream_error"  # the fallback chain's steps a cut stream may take


# (ctx, endpoint, continuation body of the chat or completions request) -> the stream opened there, or None
Open = Callable[[RequestContext, Endpoint, dict[str, Any]], Awaitable[Response | None]]
# (ctx, pools, endpoints to avoid) -> a ready endpoint of those pools (the walk's router, as for a
# migration), or None
Route = Callable[[RequestContext, Sequence[Pool], Collection[str]], Routed | None]


def enabled(ctx: RequestContext, accounting: Accounting) -> bool:
    """Whether the model `ctx` is on opted in (`models.<m>.stream_failover`) and the request allows
    fallbacks (the tenant's, `x-tokenway-no-fallback`)."""
    config = accounting.policies.current.model_config(ctx.model)
    return config is not None and config.stream_failover and ctx.facts.allow_fallback


@dataclass(slots=True)
class Failover:
    """The failover of one stream: called with the text sent so far and its output tokens when the
    stream's own pool could not continue it; the continuation on a fallback model, or None.

    `body` is the chat or completions request the first leg sent before the engine's cut (the client's
    own, or a translated API's chat translation) and `api` its kind."""

    ctx: RequestContext
    accounting: Accounting
    fleet: Fleet
    route: Route
    open: Open
    body: Mapping[str, Any]
    api: str
    tried: set[str] = field(default_factory=set)
    legs: int = 1
    billed_usd: float = 0.0  # what the legs that ended were charged (their records' cost)
    moved: bool = False  # a leg ran on a fallback model: the pool's migration no longer applies

    async def __call__(self, text: str, sent_tokens: int) -> Resumed | None:
        ctx = self.ctx
        if not enabled(ctx, self.accounting):
            return None
        facts, policy = ctx.facts, self.accounting.policies.current
        self.tried.update((facts.model, ctx.model))
        following = choose_fallback(
            policy,
            ctx.model,
            TRIGGER,
            facts.principal,
            tried=self.tried,
            min_context_tokens=context_tokens(facts.prompt_tokens, facts.max_tokens),
        )
        if following is None or not self.fleet.pools_for_model(following):
            log.warning("stream %s: no fallback model can continue it", facts.request_id)
            return None
        self.tried.add(following)
        admission = self.accounting.admission
        rejection = check_context(policy, following, facts.prompt_tokens, facts.max_tokens)
        try:
            admitted = await admission.admit(facts, following) if rejection is None else rejection
        except Exception:  # a store that fails mid-stream ends it as a refusal would, never as a 500
            log.exception("stream %s: admission on %s failed", facts.request_id, following)
            return None
        if isinstance(admitted, Rejection):  # its limits or budget say no: the stream ends as a cut does
            log.warning("stream %s: fallback %s refused (%s)", facts.request_id, following, admitted.reason)
            return None
        reservation = Reservation(admission, admitted, following)
        previous = (ctx.model, ctx.reservation)
        ctx.model, ctx.reservation = following, reservation  # the body and target are the new leg's
        try:
            opened = await self._open(following, text, sent_tokens, reservation)
        except BaseException:  # the client went away while it opened: the first leg is the one to settle
            ctx.model, ctx.reservation = previous
            reservation.release_soon()
            raise
        if opened is None:
            ctx.model, ctx.reservation = previous
            reservation.release_soon()  # the new leg never ran: nothing to charge on it
            return None
        (pool, endpoint), response = opened
        old_reservation = previous[1]
        assert old_reservation is not None
        self._next_leg(old_reservation, following, endpoint, pool)
        self.moved = True
        ticket = endpoint.inflight.begin(facts.prompt_tokens + sent_tokens)
        marker = {"from": previous[0], "to": following, "at_tokens": sent_tokens}
        log.info("stream %s failed over from %s to %s after %d tokens", facts.request_id, *marker.values())
        return Resumed(response, ticket, endpoint.id, facts.prompt_tokens, self.api, model=following, marker=marker)

    async def _open(
        self, model: str, text: str, sent_tokens: int, reservation: Reservation
    ) -> tuple[tuple[Pool, Endpoint], Response] | None:
        """The continuation opened on a replica of `model` (two tries), or None."""
        ctx = self.ctx
        body = continuation_body(self.body, self.api, text, sent_tokens)
        if body is None:
            return None
        if not any(name in body for name in ("max_tokens", "max_completion_tokens")):
            # no limit of the client's: what the new leg reserved, less what was sent, bounds the whole answer
            body["max_tokens"] = max(reservation.ticket.output_tokens - sent_tokens, 1)
        pools = self.fleet.pools_for_model(model)
        if ctx.routing is not None:  # a LoRA adapter routes (and hashes its prefix) as itself
            ctx.routing.use_adapter(self.fleet.adapter(model))
        avoid: set[str] = set()
        for _ in range(2):
            routed = self.route(ctx, pools, frozenset(avoid))
            if routed is None:
                return None
            avoid.add(routed.endpoint.id)
            response = await self.open(ctx, routed.endpoint, body)
            if response is not None:
                return (routed.pool, routed.endpoint), response
        return None

    def _next_leg(self, ended: Reservation, model: str, endpoint: Endpoint, pool: Pool) -> None:
        """The leg that ended is settled and recorded; `ctx` goes on with a record for the new leg."""
        ctx = self.ctx
        record = ctx.record
        if not record.leg:
            record.leg = 1
        self.accounting.close_leg(ctx, ended, record)
        self.billed_usd += record.cost_usd
        self._show_cost(model)
        self.legs += 1
        stem = ctx.facts.request_id
        ctx.record = RequestRecord(
            request_id=f"{stem}.leg{self.legs}",
            api=record.api,
            started_at_unix_s=record.started_at_unix_s,
            tenant=record.tenant,
            key_id=record.key_id,
            requested_model=record.requested_model,
            model=model,
            served_model=endpoint.served_model,
            fallback_from=record.requested_model or ctx.facts.model,
            fallback_reason=TRIGGER,
            pool=pool.name,
            endpoint=endpoint.id,
            engine=endpoint.engine,
            route_reason="stream_failover",
            stream=True,
            upstream_attempts=1,
            slo_class=record.slo_class,
            batch_id=record.batch_id,
            program=record.program,
            leg=self.legs,
            continues=record.request_id,
        )
        ctx.prediction = None  # the first leg's endpoint's: learning must not read the new leg against it

    def _show_cost(self, model: str) -> None:
        """For a caller shown its cost (`show_cost`), the final usage's `cost_usd` is every leg's: the
        legs that ended as charged, the new one at its own model's price for its share of the usage."""
        outcome = self.ctx.outcome
        if outcome is None or outcome.price is None:
            return
        before_usd, before_tokens = self.billed_usd, outcome.billed_tokens
        ctx = self.ctx
        policy, batch = self.accounting.policies.current, ctx.facts.batch_id is not None

        def price(usage: Usage) -> float:
            share = replace(usage, completion_tokens=max(usage.completion_tokens - before_tokens, 0))
            pool = ctx.reservation.pool if ctx.reservation is not None else None  # the new leg's serving pool
            return before_usd + price_usd(policy, model, share, batch=batch, pool=pool)

        outcome.price = price


def chain(first: Resume | None, failover: Failover | None) -> Resume | None:
    """The stream's `Resume`: another replica of its pool first (not after it moved to a fallback
    model, nor for a stream flow control preempted: that one waits its turn), then the fallback model."""
    if failover is None:
        return first

    async def resume(text: str, sent_tokens: int, preempted: bool = False) -> Resumed | None:
        if first is not None and not failover.moved:
            resumed = await first(text, sent_tokens, preempted)
            if resumed is not None or preempted:
                return resumed
        return await failover(text, sent_tokens)

    return resume
