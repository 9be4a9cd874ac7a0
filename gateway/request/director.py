"""The director: the walk of one request, top to bottom.

    arrive → intake (frozen facts) → for each model of the fallback chain:
        context fits? → admit → prepare hooks → dispatch (route → gate → commit → send)
        a Detour releases the model's reservation and moves to the chain's next model
    → the answer, or the error of the last Detour → accounting (every record, exactly once)

It names each stage and owns none of the features (those are hooks, `gateway/request/hooks.py`)
and none of the ways a request arrives or is answered: the same walk serves a client over HTTP
(`handle`, the app's engine transport), the endpoint picker's requests (`gateway/epp/decide.py`)
and batch lines (`gateway/batch/walk.py`), each with its own reader and `Transport`
(`gateway/request/transport.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from backends.fleet import Fleet
from gateway.errors import GatewayError, InternalError, Rejected
from gateway.request.accounting import Accounting
from gateway.request.apis import APIS, Api
from gateway.request.context import RequestContext
from gateway.request.detour import Detour
from gateway.request.dispatch import Dispatch
from gateway.request.hooks import Hooks
from gateway.request.intake import Intake
from gateway.request.intake import request_id as request_id_of
from gateway.request.record import RequestRecord
from gateway.request.transport import Transport
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace
from policies.fallback import check_context, choose_fallback, context_tokens
from policies.holder import PolicyHolder
from policies.routing.types import RouteRequest
from policies.types import Rejection, RequestFacts

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
