"""Accounting: every reservation ended exactly once, every record filled and handed over once.

`Reservation` is admission's ticket for one model, spent by one of `settle` (the request reached an
engine: charge what it used) or `release` (it never did: undo it all); a second call is a no-op, so
no path can end it twice, and the director's one `finally` ends any reservation a path left open.
Either hands the ticket to admission without waiting for the store (`settle_soon`): the store's work
is begun before it returns (for Redis, the script queued on the connection) and finished off the
response's path, tracked by admission, so neither a slow store nor a cancelled request (the client
went away) can delay the answer or cut the settlement short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from gateway.errors import EngineRejected, GatewayError, Rejected
from gateway.request.context import AdmissionPort, Hooks, RecordSink, RequestContext
from gateway.request.record import RequestRecord
from gateway.upstream.relay import RelayOutcome
from policies.holder import PolicyHolder
from policies.limits.admission import Admitted
from policies.policy import cache_saving_usd, price_usd
from policies.types import Usage

log = logging.getLogger("tokenway.request")


class Reservation:
    """One admitted reservation on one model; `settle` or `release` ends it, once. Made before
    routing (it reserves at the dearest pool's price); `pool` is the pool that serves it, set when the
    walk commits to a route (`Dispatch.commit`), and the settlement charges that pool's price."""

    __slots__ = ("_admission", "ended", "model", "pool", "ticket")

    def __init__(self, admission: AdmissionPort, ticket: Admitted, model: str):
        self._admission = admission
        self.ticket = ticket
        self.model = model
        self.ended = False
        self.pool: str | None = None

    async def settle(self, usage: Usage | None, counted_output_tokens: int) -> None:
        """Charge what was used (see `settle_soon`: the store is not waited for)."""
        self.settle_soon(usage, counted_output_tokens)
        await asyncio.sleep(0)  # one turn of the loop for what the settlement set off

    async def release(self) -> None:
        """Undo it all (nothing reached an engine)."""
        self.release_soon()
        await asyncio.sleep(0)

    def settle_soon(self, usage: Usage | None, counted_output_tokens: int) -> None:
        if not self.ended:
            self.ended = True
            self._admission.settle_soon(
                self.ticket, usage, model=self.model, charged_output_tokens=counted_output_tokens, pool=self.pool
            )

    def release_soon(self) -> None:
        if not self.ended:
            self.ended = True
            self._admission.release_soon(self.ticket)

    def settle_reserved(self) -> Usage:
        """Charge the whole reservation (prompt + output reservation): for an answer the gateway
        never sees (an endpoint picker whose data plane sends no response body), what was reserved
        is the only count there is. Returns the usage charged."""
        usage = Usage(prompt_tokens=self.ticket.prompt_tokens, completion_tokens=self.ticket.output_tokens)
        if not self.ended:
            self.ended = True
            self._admission.settle_soon(self.ticket, None, model=self.model, pool=self.pool)
        return usage


class Accounting:
    def __init__(
        self,
        admission: AdmissionPort,
        policies: PolicyHolder,
        sinks: Sequence[RecordSink],
        hooks: Hooks,
        audit: Callable[[str, int, int, str], None] | None = None,  # counted vs engine prompt tokens
    ):
        self.audit = audit
        self.admission = admission
        self.policies = policies
        self.sinks = tuple(sinks)
        self.hooks = hooks

    def prompt_bound(self, model: str, max_model_len: int | None) -> int | None:
        """The most prompt tokens an answer may be billed (`RelayOutcome.bounded_usage`): the engine's
        own `max_model_len` where known (it reads no more), else twice the model's `context_length`
        in policy (the gateway admits prompts by its own estimate, which a provider's count may
        exceed near the limit, and the configured length may understate the model's), else none."""
        if max_model_len:
            return max_model_len
        config = self.policies.current.model_config(model)
        return 2 * config.context_length if config is not None and config.context_length else None

    def price(self, ctx: RequestContext) -> Callable[[Usage], float] | None:
        """What the answer's usage costs its caller, for a caller whose policy shows it (`show_cost`):
        the figure `fill` records and settlement charges, so the body, the header and the ledger agree.
        None for everyone else (their bodies stay exactly the API's own)."""
        if not ctx.facts.principal.show_cost:
            return None
        policy, model, batch = self.policies.current, ctx.model, ctx.facts.batch_id is not None

        def price(usage: Usage) -> float:  # the serving pool is read when the usage comes (a stream may move)
            return price_usd(policy, model, usage, batch=batch, pool=_pool(ctx))

        return price

    def reserve(self, ctx: RequestContext, ticket: Admitted) -> Reservation:
        ctx.reservation = Reservation(self.admission, ticket, ctx.model)
        return ctx.reservation

    async def release(self, ctx: RequestContext) -> None:
        if ctx.reservation is not None:
            await ctx.reservation.release()
        ctx.reservation = None

    async def settle(self, ctx: RequestContext) -> None:
        """The request was served (or its stream broke or its client left mid-stream): charge what it used."""
        self.settle_soon(ctx)
        await asyncio.sleep(0)  # one turn of the loop for what the settlement set off

    def settle_soon(self, ctx: RequestContext) -> None:
        """`settle` without waiting: the one rule for an answer that reached the gateway whole, for the
        HTTP walk and the endpoint picker alike (gateway/epp/decide.py), so neither bills it otherwise."""
        outcome = ctx.outcome
        assert outcome is not None and ctx.reservation is not None
        with ctx.trace.span("accounting"):
            self.fill(ctx, outcome)
            if outcome.usage is None and not ctx.facts.stream and ctx.api.generates and not outcome.leg_tokens():
                # A whole answer whose usage could not be read (an engine's answer without one, or
                # with one that is no object): as for an answer cut mid-way (`aborted`), the whole
                # reservation, the most the engine may have produced under the limit it was sent.
                self.unobserved(ctx, ctx.reservation.settle_reserved())
                return
            ctx.reservation.settle_soon(outcome.leg_usage(), outcome.leg_tokens())

    async def settle_unused(self, ctx: RequestContext, error: GatewayError) -> None:
        """The engine refused the request (its own 4xx): it ran nothing, charge nothing but the request."""
        self.failed(ctx, error)
        assert ctx.reservation is not None
        with ctx.trace.span("accounting"):
            await ctx.reservation.settle(Usage(), 0)

    def failed(self, ctx: RequestContext, error: GatewayError) -> None:
        """The answer is `error`: the record says so (a policy's no, a client's mistake, a failure)."""
        record = ctx.record
        record.http_status = error.status
        if isinstance(error, EngineRejected):  # the engine refused what it was sent
            record.status, record.error_code = "error", error.reason
            return
        record.status = "rejected" if error.status < 500 or isinstance(error, Rejected) else "error"
        record.error_code = error.code or error.type
        if isinstance(error, Rejected):
            record.reject_reason = error.reason

    def aborted(self, ctx: RequestContext) -> None:
        """The client went away (the walk was cancelled): end what is open without awaiting. A stream
        whose [DONE] had gone out was served: its client has the whole answer, whoever closed first."""
        record = ctx.record
        outcome = ctx.outcome
        delivered = outcome is not None and outcome.done_sent
        if not delivered:
            record.status, record.http_status = "aborted", 499
        reservation = ctx.reservation
        if reservation is None or reservation.ended:
            return
        if outcome is None:  # nothing reached an engine
            reservation.release_soon()
            return
        outcome.aborted = not delivered
        self.fill(ctx, outcome)
        if outcome.usage is None and not ctx.facts.stream:
            # An answer the engine was still writing: what it produced so far is nowhere the gateway
            # can read it (the engines' counters are not per request, and the body comes whole or not
            # at all), so the whole reservation is charged: the most the engine may have produced,
            # since it is also the output limit the engine was given (gateway/upstream/relay.py).
            self.unobserved(ctx, reservation.settle_reserved())
            return
        reservation.settle_soon(outcome.leg_usage(), outcome.leg_tokens())

    async def close_open(self, ctx: RequestContext) -> None:
        """A path that ended without settling (a bug's exception) releases what it held."""
        if ctx.reservation is not None and not ctx.reservation.ended:
            if ctx.outcome is not None:
                await ctx.reservation.settle(ctx.outcome.leg_usage(), ctx.outcome.leg_tokens())
            else:
                await ctx.reservation.release()

    def fill(self, ctx: RequestContext, outcome: RelayOutcome) -> None:
        facts, record = ctx.facts, ctx.record
        record.stream = facts.stream
        usage = outcome.leg_usage()  # a stream that failed over: this leg's (its earlier legs have their own records)
        if usage is not None:
            record.usage_source = "engine"
            if self.audit is not None and ctx.model == facts.model:  # a fallback counts with another tokenizer
                self.audit(facts.model, facts.prompt_tokens, usage.prompt_tokens, facts.prompt_tokens_source)
        elif outcome.leg_tokens() or outcome.aborted or outcome.broken:
            usage = Usage(prompt_tokens=facts.prompt_tokens, completion_tokens=outcome.leg_tokens())
            record.usage_source = "counted"
        if usage is not None:
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            record.cached_tokens = usage.cached_tokens
            record.cache_write_tokens = usage.cache_write_tokens
            record.cache_write_1h_tokens = usage.cache_write_1h_tokens
            record.reasoning_tokens = usage.reasoning_tokens
            batch = facts.batch_id is not None
            pool = _pool(ctx)
            record.cost_usd = price_usd(self.policies.current, ctx.model, usage, batch=batch, pool=pool)
            if usage.cached_tokens or usage.cache_write_tokens or usage.cache_write_1h_tokens:
                record.cache_saved_usd = cache_saving_usd(
                    self.policies.current, ctx.model, usage, record.cost_usd, batch, pool
                )
        if outcome.first_token_at_s is not None and facts.stream:
            record.ttft_s = outcome.first_token_at_s - ctx.arrived_s
            if outcome.last_token_at_s is not None and record.completion_tokens > 1:
                record.tpot_s = (outcome.last_token_at_s - outcome.first_token_at_s) / (record.completion_tokens - 1)
        if outcome.engine_metrics:
            record.engine_metrics = outcome.engine_metrics
        if outcome.aborted:
            record.status = "aborted"
            record.http_status = 499
        elif outcome.broken:
            record.status = "error"
            record.error_code = "upstream_error"

    def close_leg(self, ctx: RequestContext, reservation: Reservation, record: RequestRecord) -> None:
        """A stream's leg ended where a fallback model took over (gateway/transport/engine.py): the
        leg is settled with what it sent (the original prompt and the output tokens counted since the
        leg began, priced at the leg's model: the engine's usage never came) and its record handed to
        every sink now; the stream goes on with the next leg's reservation and record."""
        outcome = ctx.outcome
        assert outcome is not None
        tokens = outcome.leg_tokens()
        usage = Usage(prompt_tokens=ctx.facts.prompt_tokens, completion_tokens=tokens)
        record.stream = True
        record.usage_source = "counted"
        record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        record.cost_usd = price_usd(
            self.policies.current,
            reservation.model,
            usage,
            batch=ctx.facts.batch_id is not None,
            pool=reservation.pool,
        )
        if outcome.first_token_at_s is not None and record.leg <= 1:
            record.ttft_s = outcome.first_token_at_s - ctx.arrived_s
        record.duration_s = time.perf_counter() - ctx.arrived_s
        outcome.billed_tokens += tokens
        reservation.settle_soon(usage, tokens)
        self.emit(record)

    def emit(self, record: RequestRecord) -> None:
        """Hand `record` to every sink, once (a broken sink costs neither the others nor the answer)."""
        for sink in self.sinks:
            try:
                sink.observe(record)
            except Exception:  # a broken sink must not break the others or the response
                log.exception("record sink %s failed", type(sink).__name__)

    def unobserved(self, ctx: RequestContext, usage: Usage) -> None:
        """The answer went to the client without passing here: the record carries what was charged
        for it (`usage_source: reserved`), not what the engine reported."""
        record = ctx.record
        record.stream = ctx.facts.stream
        record.usage_source = "reserved"
        record.prompt_tokens = usage.prompt_tokens
        record.completion_tokens = usage.completion_tokens
        record.cost_usd = price_usd(
            self.policies.current, ctx.model, usage, batch=ctx.facts.batch_id is not None, pool=_pool(ctx)
        )

    def finish(self, ctx: RequestContext) -> None:
        """The request is over: hooks see its record, then every sink, once."""
        record = ctx.record
        record.duration_s = time.perf_counter() - ctx.arrived_s
        self.hooks.finished(ctx)
        self.emit(record)
        ctx.trace.end(record)


def _pool(ctx: RequestContext) -> str | None:
    """The pool whose price the request's current leg pays: its reservation's (the one settlement
    charges), so the ledger's `cost_usd` and the budget's charge are the same figure."""
    reservation = ctx.reservation
    return reservation.pool if reservation is not None else None
