"""Flow control as the walk's gate: the one place a request waits (gateway/flow/queue.py holds it).

`FlowHook.gate` asks the pool's waiting room to hold the request until it may go, in flow order. Its
`ready()` answers, each time it is asked:

1. route again (the first time: the walk's own decision);
2. saturation: if the chosen endpoint cannot start a request now, route among those that can; none
   can → the pool is saturated (`Blocked.POOL`: nobody waiting there goes); with a slot reserve
   (`reserve_slots`, or sized from recent demand up to `reserve_max_slots`), a tenant over its
   share may not take the pool's last free slots (`Blocked.TENANT`: another tenant's request may),
   and (`reserve_avoid_prefills`) one the reserve is kept for goes to an open endpoint with no
   prefill pending when there is one, while (`reserve_clear_lane`) one over its share starts only
   where no prefill is pending and another endpoint with a free slot stays clear (`Blocked.TENANT`
   until a first token, else), and so does one within its share by slots but over its weighted
   share of the band's recent tokens beside a tenant under it;
3. the checks plugged in after it, in order (the SLO gate: `Blocked.REQUEST` when this request's own
   objective is not met yet, a `Detour` when its class says reject or fall back).

A request that waited out its band's `max_queue_ms` gets what the band says (429, 503 or the
model's fallback chain, trigger `queue_timeout`); one held by its own SLO gets the SLO's answer.

The hook also keeps the fairness accounts: each dispatch charges its tenant's virtual counter with
the predicted cost (uncached prompt + predicted output tokens, the latter corrected for drift), each
attempt's end corrects it with the real cost and tells the room that capacity may have freed, as
does each first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import Rejected
from gateway.flow.queue import FlowQueue, Lease
from gateway.flow.types import Blocked, FlowRequest, QueueRejected
from gateway.request import Detour, Hook, RequestContext, Reroute, Routed
from policies.flow import preempt, reserve, vtc
from policies.flow.bands import band_name, band_rank
from policies.flow.config import FlowSettings
from policies.flow.rejections import REASON_QUEUE_TIMEOUT, queue_rejection
from policies.flow.saturation import SaturationLimits, endpoint_saturation, open_endpoints
from policies.holder import PolicyHolder
from predictor.length import OutputPrediction

_LIMITS_KEPT = 256
_PREEMPT_EVERY_S = 0.25  # a waiting request asks for one preemption at most this often (a cut slot the engine
# frees late, or another takes, is asked for again)
REASON_QUEUED = "queued"  # record.reject_reason of a request served after waiting (status ok)


class GateCheck(Protocol):
    """A gate the waiting room asks before a request goes (the SLO gate): the routing decision to
    use, `Blocked.REQUEST` while this request must wait, or raise a `Detour`. `deadline_s` may
    shorten the request's wait; `last_wait_error` answers a request it kept waiting until the
    deadline (None: the band's answer applies)."""

    def check(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed | Blocked: ...

    def deadline_s(self, ctx: RequestContext, deadline_s: float) -> float: ...

    def last_wait_error(self, ctx: RequestContext, waited_s: float) -> Detour | None: ...


class PredictsOutput(Protocol):
    def output_tokens_prediction(self, tenant: str, model: str, max_tokens: int | None = None) -> OutputPrediction: ...


@dataclass(slots=True)
class FlowHook(Hook):
    queue: FlowQueue
    settings: FlowSettings
    policies: PolicyHolder
    predictor: PredictsOutput | None = None
    checks: Sequence[GateCheck] = ()
    now: Callable[[], float] = field(default=time.monotonic)
    _leases: dict[int, Lease] = field(default_factory=dict)  # id(ctx) -> the dispatch it is charged for
    # (pool, max_num_seqs) -> its limits under `_limits_of`: merging them is a pydantic dump, not per-request work
    _limits: dict[tuple[str, int | None], SaturationLimits] = field(default_factory=dict)
    _limits_of: FlowSettings | None = None
    # pool -> id(ctx) -> a stream in flight there that flow control may cut (`preempt`): at most
    # the requests in flight, each removed as its attempt ends
    _running: dict[str, dict[int, tuple[RequestContext, float]]] = field(default_factory=dict)

    async def gate(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed:
        facts = ctx.facts
        policy = self.policies.current
        band = band_rank(facts.principal.priority)
        band_policy = policy.config.flow_control.band(band_name(band))
        output = self._output(ctx)
        ctx.output_prediction = output
        cost = vtc.request_cost(facts.prompt_tokens, routed.decision.cached_tokens_estimate, output.tokens)
        deadline_s = self.now() + band_policy.max_queue_ms / 1000.0
        for check in self.checks:
            deadline_s = check.deadline_s(ctx, deadline_s)
        slo = facts.slo
        request = FlowRequest(
            facts.request_id,
            facts.principal.tenant,
            band,
            cost,
            policy.tenant_weight(facts.principal.tenant),
            deadline_s,
            (ctx.http.content_length or 0) if ctx.http is not None else 0,  # the endpoint picker holds no body
            slo.class_name if slo is not None else "",
            # at the gate from inside an attempt: a stream flow control cut, waiting to continue
            resumed=ctx.outcome is not None and ctx.outcome.preempted > 0,
        )
        pending: list[Routed] = [routed]
        asked = [float("-inf")]  # when this request last had a stream cut for it

        def cut_for(candidate: Routed, opened: Routed | Blocked) -> None:
            if opened is Blocked.POOL:
                now = self.now()
                if now - asked[0] >= _PREEMPT_EVERY_S and self._preempt(candidate, request):
                    asked[0] = now

        def ready() -> Routed | Blocked:
            candidate = pending.pop() if pending else reroute(())
            if candidate is None:
                return Blocked.POOL  # no endpoint at all right now (a replica may come back)
            if self.queue.activity.claimed_by_other(candidate.pool.name, request.tenant):
                return Blocked.TENANT  # a slot cut for another tenant's request is freeing
            opened = self._open(candidate, reroute, request)
            cut_for(candidate, opened)
            if isinstance(opened, Blocked):
                return opened
            for check in self.checks:
                verdict = check.check(ctx, opened, reroute)
                if isinstance(verdict, Blocked):
                    return verdict
                opened = verdict
            return opened

        pool = routed.pool.name
        if self._running.get(pool) and self.queue.depth(pool):
            # others wait: the room offers the turn in flow order and stops at the first the full pool
            # refuses, so this request may never be asked; a cut for it is asked for now
            cut_for(routed, self._open(routed, reroute, request))
        try:
            found, lease = await self.queue.hold(pool, request, ready)
        except QueueRejected as rejected:
            self._waited(ctx, rejected.waited_s)
            if rejected.waited_s:  # the error answer says how long it waited, too
                ctx.headers.append(("x-tokenway-queued-ms", f"{rejected.waited_s * 1000:.0f}"))
            raise self._detour(ctx, rejected, band_policy.on_timeout) from None
        self._end(ctx, 0.0)  # a lease of an earlier attempt that no `ended` closed
        self._leases[id(ctx)] = lease
        self.queue.activity.take_claim(pool, request.tenant)
        if lease.queued_s:
            self._waited(ctx, lease.queued_s)
            ctx.record.reject_reason = REASON_QUEUED
        if facts.debug:
            ctx.headers.append(("x-tokenway-flow", self._debug(pool, request, output)))
        return found

    def dispatched(self, ctx: RequestContext) -> None:
        """A stream of a pool that may preempt is one flow control may cut (`_preempt`)."""
        routed = ctx.routed
        if routed is None or not ctx.facts.stream or id(ctx) not in self._leases:
            return
        pool = routed.pool
        if self._pool_limits(pool.name, pool.config.max_num_seqs).preempt:
            self._running.setdefault(pool.name, {})[id(ctx)] = (ctx, self.now())

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        if ctx.routed is not None:
            self.queue.notify(ctx.routed.pool.name)

    def ended(self, ctx: RequestContext) -> None:
        """An attempt ended: correct its tenant's counter with the real cost; capacity freed."""
        if ctx.routed is not None:
            running = self._running.get(ctx.routed.pool.name)
            if running is not None and running.pop(id(ctx), None) is not None and not running:
                del self._running[ctx.routed.pool.name]
        if id(ctx) not in self._leases:
            return
        outcome = ctx.outcome
        actual: float | None = 0.0  # nothing served: the charge is refunded
        if outcome is not None and outcome.preempted:
            ctx.record.preempted = outcome.preempted
        if outcome is not None:
            usage = outcome.usage
            if usage is not None:
                actual = vtc.request_cost(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
            elif outcome.counted_completion_tokens:
                actual = vtc.request_cost(ctx.facts.prompt_tokens, 0, outcome.counted_completion_tokens)
            elif not outcome.aborted and not outcome.broken:
                actual = None  # served, usage unknown: the prediction stands
        self._end(ctx, actual)

    def finished(self, ctx: RequestContext) -> None:
        """A lease no attempt ended (cancelled between the grant and dispatch): nothing was served."""
        self._end(ctx, 0.0)

    def _end(self, ctx: RequestContext, actual_cost_tokens: float | None) -> None:
        lease = self._leases.pop(id(ctx), None)
        if lease is not None:
            lease.finished(actual_cost_tokens)

    # --- parts --------------------------------------------------------------------------------------

    def _preempt(self, routed: Routed, request: FlowRequest) -> bool:
        """The pool is full and `request` waits: with `preempt`, cut a stream of a tenant over its
        share (`policies.flow.preempt`) so that its slot frees; whether one was cut."""
        pool = routed.pool
        running = self._running.get(pool.name)
        if not running or not self._pool_limits(pool.name, pool.config.max_num_seqs).preempt:
            return False
        if request.resumed:
            return False  # a cut stream waiting again never cuts another (no swap back)
        active = self.queue.activity.active(pool.name)
        own = active.get(request.tenant)
        if own is not None and own.waiting > 1:
            # a backlogged tenant is served by flow order as slots free, not by cuts (letting a light
            # tenant's burst, several of its requests waiting, cut too was measured worse: each
            # waiting request cut a stream, and a stream cut once cannot be cut again, so the pool
            # filled with streams no later burst could take a slot from)
            return False
        same_band = {t for t, seen in active.items() if seen.band == request.band} | {request.tenant}
        ratios = self.queue.fair_share_ratios(pool.name, same_band)
        streams = []
        for key, (ctx, dispatched_s) in running.items():
            outcome = ctx.outcome
            if outcome is not None and outcome.preemptible():
                band = band_rank(ctx.facts.principal.priority)
                streams.append(preempt.Running(key, ctx.facts.principal.tenant, band, dispatched_s))
        while streams:
            chosen = preempt.victim(request.tenant, request.band, request.weight, streams, active, ratios)
            if chosen is None:
                return False
            ctx = running[chosen.key][0]
            if ctx.outcome is not None and ctx.outcome.preempt():
                self.queue.count_preemption(pool.name)
                # the cut slot goes to the tenant it was cut for, on every replica, not to whoever is
                # first in order (the flood, as often as not)
                self.queue.activity.claim(pool.name, request.tenant, request.band, request.weight)
                return True
            streams.remove(chosen)
        return False

    def _output(self, ctx: RequestContext) -> OutputPrediction:
        facts = ctx.facts
        if self.predictor is not None and facts.api != "embeddings":
            return self.predictor.output_tokens_prediction(facts.principal.tenant, ctx.model, facts.max_tokens)
        reserved = float(facts.output_reservation)
        return OutputPrediction(reserved, reserved, reserved, facts.max_tokens)

    def _open(self, routed: Routed, reroute: Reroute, request: FlowRequest) -> Routed | Blocked:
        """The routed endpoint if it can start a request now, else one that can, else Blocked.POOL;
        Blocked.TENANT when the slots left are the reserve and this tenant is over its share."""
        pool = routed.pool
        limits = self._pool_limits(pool.name, pool.config.max_num_seqs)
        now = self.now()
        size = limits.reserve
        avoid_prefills = lane = False
        if size.enabled and limits.max_num_seqs:
            free = reserve.free_slots(pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            active = self.queue.activity.active(pool.name)
            kept = reserve.reserve_for(request.tenant, request.band, active, size)
            if not reserve.may_take(request.tenant, request.band, request.weight, active, free, kept):
                return Blocked.TENANT
            if limits.reserve_avoid_prefills or limits.reserve_clear_lane:
                within = reserve.within_share(request.tenant, request.band, request.weight, active)
                avoid_prefills = limits.reserve_avoid_prefills and within
                lane = limits.reserve_clear_lane and (not within or self._heavier(pool.name, request, active))
        predicted = self._predicted_ttft(routed)
        if (
            not avoid_prefills
            and not lane
            and endpoint_saturation(routed.endpoint, limits, now, predicted.get(routed.endpoint.id)) is None
        ):
            return routed
        opened = open_endpoints(pool.servable(), limits, now, predicted)
        if not opened:
            return Blocked.POOL
        if avoid_prefills:
            opened = reserve.clear_of_prefill(opened) or opened
        if lane and limits.max_num_seqs:
            opened = reserve.clear_lane(opened, pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            if not opened:
                return Blocked.TENANT  # until a pending prefill has its first token (the room is told)
        can = {e.id for e in opened}
        if routed.endpoint.id in can:
            return routed
        again = reroute([e.id for e in pool.servable() if e.id not in can])
        if again is None or again.endpoint.id not in can:
            return Blocked.POOL
        return again

    def _heavier(self, pool: str, request: FlowRequest, active: Mapping[str, reserve.Active]) -> bool:
        """Whether the request's tenant is over its token share of the band beside a tenant under it."""
        band = {tenant for tenant, seen in active.items() if seen.band == request.band} | {request.tenant}
        return len(band) > 1 and reserve.heavier_than_another(request.tenant, self.queue.fair_share_ratios(pool, band))

    def _pool_limits(self, pool: str, max_num_seqs: int | None) -> SaturationLimits:
        """The pool's limits, merged once per settings object (a replaced `settings` starts afresh)."""
        if self._limits_of is not self.settings:
            self._limits.clear()
            self._limits_of = self.settings
        key = (pool, max_num_seqs)
        found = self._limits.get(key)
        if found is None:
            if len(self._limits) >= _LIMITS_KEPT:
                self._limits.clear()  # pools and settings come from config: this is only a bound
            found = self._limits[key] = self.settings.limits(pool, max_num_seqs)
        return found

    @staticmethod
    def _predicted_ttft(routed: Routed) -> dict[str, float]:
        made = routed.decision.predictions
        return {endpoint_id: p.ttft_ms for endpoint_id, p in made.items()} if made else {}

    @staticmethod
    def _waited(ctx: RequestContext, waited_s: float) -> None:
        """The wait in the context (the walk's `x-tokenway-queued-ms`, the predictor's dispatch time)
        and in the record (the ledger's `queue_ms`)."""
        if not waited_s:
            return
        ctx.gate_wait_s += waited_s
        ctx.record.queue_ms = round((ctx.record.queue_ms or 0.0) + waited_s * 1000.0, 3)

    def _detour(self, ctx: RequestContext, rejected: QueueRejected, on_timeout: int | str) -> Detour:
        if rejected.reason == REASON_QUEUE_TIMEOUT and rejected.blocked is Blocked.REQUEST:
            for check in self.checks:
                answer = check.last_wait_error(ctx, rejected.waited_s)
                if answer is not None:
                    return answer
        status = on_timeout if isinstance(on_timeout, int) else 503
        rejection = queue_rejection(
            rejected.reason,
            model=ctx.model,
            band=band_name(band_rank(ctx.facts.principal.priority)),
            waited_ms=rejected.waited_s * 1000.0,
            retry_after_s=rejected.retry_after_s,
            status=status if rejected.reason == REASON_QUEUE_TIMEOUT else 503,
        )
        fallback = on_timeout == "fallback" and rejected.reason == REASON_QUEUE_TIMEOUT
        return Detour(rejected.reason, Rejected(rejection), fallback=fallback)

    def _debug(self, pool: str, request: FlowRequest, output: OutputPrediction) -> str:
        counter = self.queue.counters.value(pool, request.band, request.tenant)
        return (
            f"band={band_name(request.band)};cost={request.cost_tokens:.0f};output={output.tokens:.1f};"
            f"raw={output.raw_tokens:.1f};counter={counter:.0f}"
        )
