"""Failover inside a stream: a stream cut mid-answer continues on the next model of its fallback chain.

A model with `stream_failover: true` (policies.yaml) lets a stream its engine cuts after the first
byte (a reset, a truncated stream, an error event) continue on a fallback model when no other replica
of its pool can take it (`gateway/upstream/migrate.py` moves it within the pool first). Why a leg of
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

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends.fleet import Fleet, Pool
from backends.types import Endpoint
from gateway.request.accounting import Accounting, Reservation
from gateway.request.context import RequestContext, Routed
from gateway.request.record import RequestRecord
from gateway.upstream.client import Response
from gateway.upstream.migrate import Resume, Resumed, continuation_body
from policies.fallback import check_context, choose_fallback, context_tokens
from policies.policy import price_usd
from policies.types import Rejection, Usage

log = logging.getLogger("tokenway.request")

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
