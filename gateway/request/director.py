"""The walk of one request, top to bottom: the director runs the model's fallback chain, dispatch is
one model's attempt on it, and a `Detour` is how any stage says "not here, instead". One module
because they are one loop: the director calls dispatch for each model, dispatch raises the `Detour`
the director catches, and a newcomer reads the walk here in the order it runs.

The director
------------

    arrive → intake (frozen facts) → for each model of the fallback chain:
        context fits? → admit → prepare hooks → dispatch (route → gate → commit → send)
        a Detour releases the model's reservation and moves to the chain's next model
    → the answer, or the error of the last Detour → accounting (every record, exactly once)

It names each stage and owns none of the features (those are hooks, `gateway/request/context.py`)
and none of the ways a request arrives or is answered: the same walk serves a client over HTTP
(`handle`, the app's engine transport), the endpoint picker's requests (`gateway/epp/decide.py`)
and batch lines (`gateway/batch/lines.py`), each with its own reader and `Transport`
(`gateway/request/context.py`).

Detours: one way to say "not here, instead"
-------------------------------------------

A context too long for the model, an admission rejection, every endpoint of the model failing before
the first byte, an SLO the model cannot meet: each is a `Detour` raised by the stage (or hook) that
found it. The director catches it in one place, releases the model's reservation, and walks the
model's fallback chain with `trigger`; when no fallback applies, `error` is the answer.

Dispatch: one model's attempt at serving the request
----------------------------------------------------

    route → gate → commit → send → on a failure before the first byte, again on another endpoint

`turn` routes and asks the gate (its one call site: every path that may send, a preempted stream's
new turn included, comes through it); `commit` tells the record, the router (prefix index, session)
and the dispatched hooks where the request goes; the `Transport` (`context.py`) sends it and
answers whoever asked. A send that fails before anything reached the client is tried again on
another endpoint of the model (`server.upstream_retries` times; on the same one too when it only lacked
the request's LoRA adapter, which the retry loads again: `adapter_lost`); when none could serve, a
`Detour("upstream_error")` hands the request back to the director's fallback chain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web

from backends.fleet import Fleet, LoraAdapter, Pool, budget_bytes, too_large
from backends.types import Endpoint
from gateway.app.settings import ServerSettings
from gateway.errors import GatewayError, InternalError, InvalidRequest, NoHealthyBackend, Rejected, UpstreamError
from gateway.request.accounting import Accounting
from gateway.request.apis import APIS, Api
from gateway.request.context import OPEN_GATE, Gate, Hooks, NotSent, RequestContext, Routed, Transport
from gateway.request.intake import Intake
from gateway.request.intake import request_id as request_id_of
from gateway.request.record import RequestRecord
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace
from policies.holder import PolicyHolder
from policies.policy import check_context, choose_fallback, context_tokens
from policies.routing.types import Router, RouteRequest
from policies.types import Rejection, RequestFacts


class Detour(Exception):
    """The current model cannot serve the request: try the chain's next model for `trigger`, else
    answer `error`. `fallback=False` answers at once (a policy that says "reject", not "fall back")."""

    def __init__(self, trigger: str, error: GatewayError, *, fallback: bool = True) -> None:
        super().__init__(error.message)
        self.trigger = trigger
        self.error = error
        self.fallback = fallback


log = logging.getLogger("tokenway.request")

StartTrace = Callable[[str, Any], RequestTrace]
A = TypeVar("A")


class Director:
    def __init__(
        self,
        *,
        intake: Intake,
        dispatch: Dispatch,
        accounting: Accounting,
        hooks: Hooks,
        policies: PolicyHolder,
        fleet: Fleet,
        transport: Transport[web.StreamResponse],
        start_trace: StartTrace | None = None,
    ) -> None:
        self.intake = intake
        self.dispatch = dispatch
        self.transport = transport  # a client's answer over HTTP: relayed from an engine
        self.accounting = accounting
        self.hooks = hooks
        self.policies = policies
        self.fleet = fleet
        self.start_trace = start_trace

    async def handle(self, request: web.Request, api: Api | str) -> web.StreamResponse:
        """Serve one request of `api`: a native kind's name (`APIS`), or the object of an API the
        gateway translates, built for this request (`gateway/apis/`)."""
        spec = APIS[api] if isinstance(api, str) else api
        # the request id kept when it is safe to echo
        ctx = self.arrive(spec, request_id_of(request.headers), request.headers, request)
        return await self.walk(ctx, lambda: self.intake.read(ctx), self.transport)

    def arrive(
        self, api: Api, request_id: str, headers: Mapping[str, str] | None = None, http: web.Request | None = None
    ) -> RequestContext:
        """A request's context as it arrives: its record and trace begun (`headers` may carry the
        caller's trace context). `http` is None where no client connection is the gateway's: the
        endpoint picker's requests (Envoy holds it) and batch lines."""
        arrived_s = time.perf_counter()
        record = RequestRecord(request_id=request_id, api=api.kind, started_at_unix_s=time.time())
        trace = self.start_trace(request_id, headers or {}) if self.start_trace else NOOP_TRACE
        return RequestContext(http, api, record, trace, arrived_s, [("x-request-id", request_id)])

    async def walk(
        self, ctx: RequestContext, read: Callable[[], Awaitable[RequestFacts]], transport: Transport[A]
    ) -> A:
        """The walk of `ctx`: `read` gives its facts (intake), the chain serves it through `transport`,
        and every way out ends in the one record. An answer that outlives the walk (`transport.follows`)
        leaves the record to the transport."""
        open_after = False
        try:
            ctx.facts = await read()
            answer = await self._chain(ctx, transport)
            open_after = transport.follows
            return answer
        except GatewayError as error:
            self.accounting.failed(ctx, error)
            # no model served it: an error never claims a fallback (x-tokenway-fallback)
            return transport.refuse(ctx, error, [h for h in ctx.headers if h[0] != "x-tokenway-fallback"])
        except asyncio.CancelledError:  # the client went away, at whatever await the walk was
            self.accounting.aborted(ctx)
            raise
        except Exception as exc:  # a bug still answers in the API's error shape and leaves its record
            log.exception("request %s failed unexpectedly", ctx.record.request_id)
            internal = InternalError(f"internal error: {type(exc).__name__}")
            self.accounting.failed(ctx, internal)
            await self.accounting.close_open(ctx)
            return transport.refuse(ctx, internal, ctx.headers)
        finally:
            if not open_after:
                self.accounting.finish(ctx)

    async def _chain(self, ctx: RequestContext, transport: Transport[A]) -> A:
        """Serve on the requested model, or on the models its fallback chain offers instead."""
        facts = ctx.facts
        ctx.model = facts.model
        ctx.routing = RouteRequest(facts)
        tried = {facts.model}
        first: Detour | None = None  # the requested model's own "no"
        while True:
            try:
                await self.admit(ctx)
                await self.hooks.prepare(ctx)
                return await self.dispatch.serve(ctx, transport)
            except Detour as detour:
                await self.accounting.release(ctx)
                first = first or detour
                following = self._fallback(ctx, detour, tried)
                if following is None:
                    raise _answer(first, detour, facts.model, ctx.model) from None
                self._fall_back(ctx, following, detour.trigger)

    async def admit(self, ctx: RequestContext) -> None:
        """Reserve on `ctx.model` (the context must fit), or raise the Detour that says why not."""
        facts, model = ctx.facts, ctx.model
        policy = self.policies.current
        rejection: Rejection | None = check_context(policy, model, facts.prompt_tokens, facts.max_tokens)
        if rejection is None:
            with ctx.trace.span("admission", model=model):
                admitted = await self.accounting.admission.admit(facts, model)
            if not isinstance(admitted, Rejection):
                self.accounting.reserve(ctx, admitted)
                return
            rejection = admitted
        raise Detour(rejection.reason, Rejected(rejection))

    def _fallback(self, ctx: RequestContext, detour: Detour, tried: set[str]) -> str | None:
        facts = ctx.facts
        if not detour.fallback or not facts.allow_fallback or not detour.trigger:
            return None
        error = detour.error
        own = error.rejection.fallback_model if isinstance(error, Rejected) else None
        if (
            own is not None  # the refusing rule names its own cheaper model: it goes first
            and own not in tried
            and own != ctx.model
            and facts.principal.may_use(own)
            and self.fleet.pools_for_model(own)
        ):
            tried.add(own)
            return own
        following = choose_fallback(
            self.policies.current,
            ctx.model,
            detour.trigger,
            facts.principal,
            tried=tried,
            min_context_tokens=context_tokens(facts.prompt_tokens, facts.max_tokens),
        )
        if following is None or not self.fleet.pools_for_model(following):
            return None
        tried.add(following)
        return following

    @staticmethod
    def _fall_back(ctx: RequestContext, following: str, trigger: str) -> None:
        record = ctx.record
        if record.fallback_from is None:
            record.fallback_from = ctx.facts.model
        record.fallback_reason = trigger
        record.model = ctx.model = following
        ctx.headers = [h for h in ctx.headers if h[0] != "x-tokenway-fallback"]
        ctx.headers.append(("x-tokenway-fallback", f"{record.fallback_from}->{following};reason={trigger}"))


def _answer(first: Detour, last: Detour, requested: str, final: str) -> GatewayError:
    """The error of a chain that ran out. When the requested model and its last fallback were both
    refused by limits (429), the answer is the requested model's own refusal: it names the model the
    client asked for, its limit and when it frees up, and says the fallbacks were refused too."""
    if last is first:
        return last.error
    if (
        isinstance(first.error, Rejected)
        and isinstance(last.error, Rejected)
        and first.error.status == 429 == last.error.status
    ):
        rejection = first.error.rejection
        note = f" The fallback to {final} was refused too ({last.error.rejection.reason})."
        return Rejected(dataclasses.replace(rejection, message=rejection.message + note))
    return last.error


class Dispatch:
    def __init__(
        self, *, server: ServerSettings, fleet: Fleet, router: Router, hooks: Hooks, gate: Gate = OPEN_GATE
    ) -> None:
        self.server = server
        self.fleet = fleet
        self.router = router
        self.hooks = hooks
        self.gate = gate  # the waiting room and its checks (gateway/flow/gate.py): asked in `turn` only

    async def serve(self, ctx: RequestContext, transport: Transport[A]) -> A:
        """Serve on `ctx.model` (its reservation held) through `transport`, or raise `Detour("upstream_error")`."""
        pools = self.fleet.pools_for_model(ctx.model)
        adapter = self.fleet.adapter(ctx.model)
        if adapter is not None:  # only the pools whose LoRA memory budget can hold it (else a 400)
            pools = fitting_pools(adapter, pools)
        if ctx.routing is not None:  # a LoRA adapter routes (and hashes its prefix) as itself
            ctx.routing.use_adapter(adapter)
        exclude = transport.unreachable(pools)
        scoped = bool(exclude)
        retries = self.server.upstream_retries
        attempts, detail = 0, ""
        crashes, crash_detail = 0, ""  # engines that failed on this request's content
        for _ in range(1 + retries):
            routed = await self.turn(ctx, pools, exclude)
            if routed is None:
                break
            attempts += 1
            self.commit(ctx, routed)
            # the last try waits for the engine: no other endpoint would take it
            last = attempts > retries or not _others(pools, exclude, routed.endpoint)
            try:
                return await transport.send(ctx, routed, last=last)
            except NotSent as failed:
                if failed.fault != "adapter_lost":  # else the retry may go there again: it reloads the adapter
                    exclude.add(routed.endpoint.id)
                detail = failed.detail
                ctx.outcome = None  # nothing reached the client: this attempt is not charged
                if failed.fault in ("request", "gateway") and failed.error is not None:  # so it is everywhere
                    raise Detour("upstream_error", failed.error, fallback=False) from None
                if failed.fault == "crash":
                    crashes, crash_detail = crashes + 1, detail
                    if crashes >= 2:  # the request made two engines fail: it is the request
                        raise Detour("upstream_error", _crashed(ctx.model, crashes, detail), fallback=False) from None
        if attempts == 0:
            where = " among those the data plane allows." if scoped else "."
            error: NoHealthyBackend | UpstreamError = NoHealthyBackend(
                f"No healthy endpoint can serve '{ctx.model}' right now{where}",
                headers=[("retry-after", str(self.server.retry_after_s))],
            )
        elif crashes:  # an engine failed on it: never walked down the fallback chain
            raise Detour("upstream_error", _crashed(ctx.model, crashes, crash_detail), fallback=False)
        else:
            error = UpstreamError(f"The upstream failed for '{ctx.model}': {detail}")
        raise Detour("upstream_error", error)

    async def turn(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None:
        """Route on `pools` avoiding `exclude`, then ask the gate: the attempt to commit, or None
        when no endpoint can take it (the gate may hold it first, or raise `Detour`)."""
        with ctx.trace.span("routing", model=ctx.model):
            routed = self.route(ctx, pools, exclude)

        def reroute(more: Collection[str]) -> Routed | None:
            return self.route(ctx, pools, {*exclude, *more})

        return await self.gate.admit(ctx, routed, reroute)

    def route(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None:
        assert ctx.routing is not None
        now = time.monotonic()
        for pool in pools:
            decision = self.router.route(ctx.routing, pool, now, exclude)
            if decision is not None:
                return Routed(pool, decision)
        return None

    def commit(self, ctx: RequestContext, routed: Routed) -> None:
        """The walk goes with `routed`: the record, the router (prefix index, session) and the
        dispatched hooks (route metrics among them) hear of it."""
        ctx.routed = routed
        record, decision = ctx.record, routed.decision
        endpoint = decision.endpoint
        record.pool, record.endpoint, record.route_reason = routed.pool.name, endpoint.id, decision.reason
        if ctx.reservation is not None:  # settled at the serving pool's price (policies.yaml `pool_prices`)
            ctx.reservation.pool = routed.pool.name
        record.engine = endpoint.engine
        adapter = self.fleet.adapter(ctx.model)  # a LoRA adapter is served under its own name
        record.served_model = adapter.name if adapter is not None else endpoint.served_model
        record.pd_reason = decision.pd_reason
        record.prefill_endpoint = decision.prefill_endpoint.id if decision.prefill_endpoint is not None else ""
        record.upstream_attempts += 1
        assert ctx.routing is not None
        self.router.on_dispatch(ctx.routing, decision)
        self.hooks.dispatched(ctx)


def fitting_pools(adapter: LoraAdapter, pools: Sequence[Pool]) -> list[Pool]:
    """The pools whose replicas' LoRA memory budget (`lora_memory_budget_mb`) can hold `adapter`; an
    adapter larger than every one is the request's dead end (400 naming it, no fallback: the policy
    serves it where it cannot fit, which no other replica changes)."""
    budgets = [(pool.name, budget_bytes(pool.config.lora_memory_budget_mb)) for pool in pools]
    refusal = too_large(adapter, budgets)
    if refusal is not None:
        raise Detour("upstream_error", InvalidRequest(refusal, param="model", code="adapter_too_large"), fallback=False)
    size = adapter.size_bytes
    return [
        pool
        for pool, (_name, budget) in zip(pools, budgets, strict=True)
        if budget is None or not size or size <= budget
    ]


def _others(pools: Sequence[Pool], exclude: Collection[str], endpoint: Endpoint) -> bool:
    """Whether an endpoint besides `endpoint` (and those tried) could take the request (asked on
    every send: no `servable()` list built per pool)."""
    return any(pool.serves_besides(endpoint, exclude) for pool in pools)


def _crashed(model: str, crashes: int, detail: str) -> UpstreamError:
    """The answer to a request that made engines fail (a 5xx with an error body): not retried further,
    not sent to a fallback model, and the client's SDK is told not to send it again."""
    where = "two replicas" if crashes > 1 else "its replica"
    return UpstreamError(
        f"The engine serving '{model}' failed on this request on {where}; it was not retried further: {detail}",
        headers=[("x-should-retry", "false")],
    )
