"""The director: the walk of one request, top to bottom.

    arrive → intake (frozen facts) → for each model of the fallback chain:
        context fits? → admit → prepare hooks → dispatch (route → gate → relay)
        a Detour releases the model's reservation and moves to the chain's next model
    → the answer, or the error of the last Detour → accounting (every record, exactly once)

It names each stage and owns none of the features (those are hooks, `gateway/request/hooks.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

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
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace
from policies.fallback import check_context, choose_fallback, context_tokens
from policies.holder import PolicyHolder
from policies.routing.types import RouteRequest
from policies.types import Principal, Rejection, RequestFacts

log = logging.getLogger("tokenway.request")

StartTrace = Callable[[str, Any], RequestTrace]


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
        start_trace: StartTrace | None = None,
    ) -> None:
        self.intake = intake
        self.dispatch = dispatch
        self.accounting = accounting
        self.hooks = hooks
        self.policies = policies
        self.fleet = fleet
        self.start_trace = start_trace

    async def handle(self, request: web.Request, api: Api | str) -> web.StreamResponse:
        """Serve one request of `api`: a native kind's name (`APIS`), or the object of an API the
        gateway translates, built for this request (`gateway/apis/`)."""
        ctx = self._arrive(request, APIS[api] if isinstance(api, str) else api)
        return await self._walk(ctx, lambda: self.intake.read(ctx))

    async def serve_line(
        self, api: Api | str, body: object, principal: Principal, *, request_id: str, batch_id: str
    ) -> web.StreamResponse:
        """Serve a request made inside the gateway — a batch line — on the same walk as any other:
        admission, routing, hooks, fallbacks, accounting and its one record. There is no HTTP
        request: the body is already parsed, the caller known, and the answer is returned, not sent."""
        spec = APIS[api] if isinstance(api, str) else api
        record = RequestRecord(request_id=request_id, api=spec.kind, started_at_unix_s=time.time())
        trace = self.start_trace(request_id, {}) if self.start_trace else NOOP_TRACE
        ctx = RequestContext(None, spec, record, trace, time.perf_counter(), [("x-request-id", request_id)])
        return await self._walk(ctx, lambda: self.intake.line(ctx, body, principal, batch_id))

    async def _walk(self, ctx: RequestContext, intake: Callable[[], Awaitable[RequestFacts]]) -> web.StreamResponse:
        try:
            ctx._facts = await intake()
            return await self._chain(ctx)
        except GatewayError as error:
            self.accounting.failed(ctx, error)
            # no model served it: an error never claims a fallback (x-tokenway-fallback)
            return ctx.render_error(error, [h for h in ctx.headers if h[0] != "x-tokenway-fallback"])
        except asyncio.CancelledError:  # the client went away, at whatever await the walk was
            self.accounting.aborted(ctx)
            raise
        except Exception as exc:  # a bug still answers in the API's error shape and leaves its record
            log.exception("request %s failed unexpectedly", ctx.record.request_id)
            internal = InternalError(f"internal error: {type(exc).__name__}")
            self.accounting.failed(ctx, internal)
            await self.accounting.close_open(ctx)
            return ctx.render_error(internal, ctx.headers)
        finally:
            self.accounting.finish(ctx)

    def _arrive(self, request: web.Request, api: Api) -> RequestContext:
        arrived_s = time.perf_counter()
        request_id = request_id_of(request.headers)  # kept when it is safe to echo
        record = RequestRecord(request_id=request_id, api=api.kind, started_at_unix_s=time.time())
        trace = self.start_trace(request_id, request.headers) if self.start_trace else NOOP_TRACE
        return RequestContext(request, api, record, trace, arrived_s, [("x-request-id", request_id)])

    async def _chain(self, ctx: RequestContext) -> web.StreamResponse:
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
                return await self.dispatch.serve(ctx)
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
