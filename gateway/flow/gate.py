"""The gate: the one place a request waits, and the one place its route changes before it goes; and
the one interface it asks, `Check`. One module because the two are one decision ("may this request
go now, on this route?"): the gate builds a request's `Turn`, asks every `Check` for a verdict on
it and acts on that verdict; a newcomer reads the question and its answers side by side.

The gate
--------

`Gate.admit(ctx, routed, reroute)` is what the walk asks once per attempt (`gateway.request.context.Gate`).
It builds the request's turn (`Turn`, below), lets every check `enter` it, and asks the
pool's waiting room (`gateway/flow/queue.py`) to hold it until every check says GO, in flow order.
Its `ready()`, each time the room offers the request the turn:

1. takes the route (the walk's own on the first ask, routing again on the next ones; none at all:
   the pool is full for everyone, or, for a request a check holds with no route, that check's wait);
2. asks every check in order; `Avoid` routes again without the endpoints named and starts the checks
   over on the new route (`_MAX_ROUTES` routes per ask); the first `Wait` or `Refuse` is the answer.

A request that waited out its deadline gets the answer of the last `Wait` it got, when that wait
carries one (the SLO's 503, a cold start's 503), else its band's (`max_queue_ms`, `on_timeout`: 429,
503 or the model's fallback chain, trigger `queue_timeout`). With no route and no check holding it,
`admit` answers None at once (the walk's "no healthy endpoint").

As a hook the gate keeps the fairness accounts: each dispatch charges its tenant's virtual counter
with the predicted cost (uncached prompt + predicted output tokens, the latter corrected for drift;
the lease lives on the context, `ctx.flow_lease`), each attempt's end corrects it with the real cost
and tells the room that capacity may have freed, as does each first token.

The gate's one interface: a `Check` answers "may this request go now, on this route?"
-------------------------------------------------------------------------------------

The waiting room's front door (`Gate`) asks every check, in the order the app
factory lists them, each time the request might go: on arrival, then on every wake of its pool's
room (`docs/architecture.md`, "The gate: one room, many checks"). Each answers one verdict:

- `GO`: nothing against it here; the next check is asked (the last one's GO dispatches);
- `Wait(scope, reason, answer)`: not now; the request waits in its pool's room, in flow order.
  `scope` says who else that holds back (`Blocked.POOL`: nobody waiting there goes;
  `Blocked.TENANT`: nobody of this tenant; `Blocked.PROGRAM`: nobody of this request's program;
  `Blocked.REQUEST`: only this one). `answer`, when set, is
  what the request is told if it waits this out until its deadline (else its band's answer);
- `Avoid(endpoints, otherwise)`: not on these endpoints: the room routes again without them (and
  without any an earlier check avoided) and asks every check again on the new route; when no route
  is left, `otherwise` is the verdict;
- `Refuse(detour)`: not here at all: the request leaves the room with that `Detour` (the director
  answers it or walks the model's fallback chain).

A check never waits, sleeps or routes itself: waiting and routing again are the room's job, in one
place. Besides `check`, a check may shape the turn before the first ask (`enter`: bound or stretch
its deadline, hold a request that has no route yet, refuse at once) and hear that the request goes
(`went`). Per-request state a check needs while the request waits lives on the `Turn` (this wait)
or on the request context (`gateway/request/context.py`), never in a table keyed by request.
Flow control's own checks are in `gateway/flow/checks.py`; others live with their feature.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from gateway.errors import Rejected
from gateway.flow.queue import Blocked, FlowQueue, FlowRequest, QueueRejected
from gateway.request import Detour, Hook, RequestContext, Reroute, Routed
from policies.flow import order
from policies.flow.order import band_name, band_rank
from policies.flow.room import REASON_QUEUE_TIMEOUT, BandPolicy, queue_rejection
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.policy import Policy
from predictor.prior import OutputPrediction

REASON_QUEUED: Final = "queued"  # record.reject_reason of a request served after waiting (status ok)
_MAX_ROUTES: Final = 8  # routes one ask may try (each `Avoid` takes at least one endpoint out)


class PredictsOutput(Protocol):
    def output_tokens_prediction(self, tenant: str, model: str, max_tokens: int | None = None) -> OutputPrediction: ...


@dataclass(slots=True)
class Gate(Hook):
    """The waiting room's front door and the checks it asks (in this order)."""

    queue: FlowQueue
    settings: FlowSettings
    policies: PolicyHolder
    predictor: PredictsOutput | None = None
    checks: Sequence[Check] = ()
    now: Callable[[], float] = field(default=time.monotonic)
    # the checks whose `enter` / `went` do something (the others inherit `Check`'s no-op): asked per request
    _enters: Sequence[Check] = field(default=(), init=False, repr=False)
    _wents: Sequence[Check] = field(default=(), init=False, repr=False)
    # priority -> (band, its policy), for `_bands_of` (priorities are few: the named ones and a clamp)
    _bands_of: Policy | None = field(default=None, init=False, repr=False)
    _bands: dict[int, tuple[int, BandPolicy]] = field(default_factory=dict, init=False, repr=False)
    _reserved_output: OutputPrediction | None = field(default=None, init=False, repr=False)  # `_output`'s last

    def __post_init__(self) -> None:
        self._enters, self._wents = _overriding(self.checks, "enter"), _overriding(self.checks, "went")

    async def admit(self, ctx: RequestContext, routed: Routed | None, reroute: Reroute) -> Routed | None:
        """The route to dispatch on, once every check says GO; None when there is no route and no
        check holds the request; raises `Detour` when a check refuses or the wait ends unserved."""
        facts = ctx.facts
        policy = self.policies.current
        band, band_policy = self._band(policy, facts.principal.priority)
        output = self._output(ctx)
        ctx.output_prediction = output
        cached = routed.decision.cached_tokens_estimate if routed is not None else 0
        now = self.now()
        slo = facts.slo
        request = FlowRequest(
            facts.request_id,
            facts.principal.tenant,
            band,
            order.request_cost(facts.prompt_tokens, cached, output.tokens),
            policy.tenant_weight(facts.principal.tenant),
            now + band_policy.max_queue_ms / 1000.0,
            (ctx.http.content_length or 0) if ctx.http is not None else 0,  # the endpoint picker holds no body
            slo.class_name if slo is not None else "",
            # at the gate from inside an attempt: a stream flow control cut, waiting to continue
            resumed=ctx.outcome is not None and ctx.outcome.preempted > 0,
            batch=facts.batch_id is not None,
            program=ctx.record.program,
        )
        turn = Turn(ctx, request, routed.pool.name if routed is not None else "", now, request.deadline_s)
        if routed is not None:
            turn.routed_s = now
        for check in self._enters:
            check.enter(turn, routed)
        if routed is None and turn.unrouted is None:
            return None  # nothing to route to, nothing to wait for
        if turn.deadline_s != request.deadline_s:  # a check stretched it (a cold start's hold)
            request.deadline_s = turn.deadline_s
        pending: list[Routed] = [routed] if routed is not None else []

        def ready() -> Routed | Blocked:
            candidate = pending.pop() if pending else reroute(())
            return self._ask(turn, candidate, reroute)

        # the common case (nobody waits, every check says GO) without the waiting room's coroutine
        held = self.queue.hold_now(turn.pool, request, ready)
        if held is None or isinstance(held, Blocked):
            try:
                held = await self.queue.hold_waiting(turn.pool, request, ready, held)
            except QueueRejected as rejected:
                self._waited(ctx, rejected.waited_s)
                if rejected.waited_s:  # the error answer says how long it waited, too
                    ctx.headers.append(("x-tokenway-queued-ms", f"{rejected.waited_s * 1000:.0f}"))
                raise self._detour(turn, rejected, band_policy.on_timeout) from None
        found, lease = held
        if ctx.flow_lease is not None:
            self._end(ctx, 0.0)  # a lease of an earlier attempt that no `ended` closed
        ctx.flow_lease = lease
        self.queue.activity.take_claim(turn.pool, request.tenant)
        if lease.queued_s:
            self._waited(ctx, lease.queued_s)
            ctx.record.reject_reason = REASON_QUEUED
        for check in self._wents:
            check.went(turn, found)
        if facts.debug:
            ctx.headers.append(("x-tokenway-flow", self._debug(turn.pool, request, output)))
        return found

    def _ask(self, turn: Turn, candidate: Routed | None, reroute: Reroute) -> Routed | Blocked:
        """Every check's verdict on `candidate`, routing again where one says `Avoid`."""
        if candidate is None:
            # no endpoint at all right now (a replica may come back, a cold pool may start)
            turn.last_wait = turn.unrouted
            return Blocked.POOL
        if turn.routed_s is None:
            turn.routed_s = self.now()
        avoided: set[str] = set()
        routes = 1
        while True:
            for check in self.checks:
                verdict = check.check(turn, candidate)
                if verdict is GO:  # the common answer, before any isinstance
                    continue
                if isinstance(verdict, Avoid):
                    avoided.update(verdict.endpoints)
                    again = reroute(avoided) if routes < _MAX_ROUTES else None
                    if again is not None:
                        candidate, routes = again, routes + 1
                        break  # every check again, on the new route
                    verdict = verdict.otherwise
                if isinstance(verdict, Go):
                    continue
                if isinstance(verdict, Wait):
                    turn.last_wait = verdict
                    return verdict.scope
                raise verdict.detour  # Refuse: the room takes the request out with it
            else:
                return candidate  # every check said GO

    # --- the hook: fairness accounts ----------------------------------------------------------------

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        if ctx.routed is not None:
            self.queue.notify(ctx.routed.pool.name)

    def ended(self, ctx: RequestContext) -> None:
        """An attempt ended: correct its tenant's counter with the real cost; capacity freed."""
        if ctx.flow_lease is None:
            return
        outcome = ctx.outcome
        actual: float | None = 0.0  # nothing served: the charge is refunded
        if outcome is not None and outcome.preempted:
            ctx.record.preempted = outcome.preempted
        if outcome is not None:
            usage = outcome.bounded_usage()
            if usage is not None:
                actual = order.request_cost(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
            elif outcome.counted_completion_tokens:
                actual = order.request_cost(ctx.facts.prompt_tokens, 0, outcome.counted_completion_tokens)
            elif not outcome.aborted and not outcome.broken:
                actual = None  # served, usage unknown: the prediction stands
        self._end(ctx, actual)

    def finished(self, ctx: RequestContext) -> None:
        """A lease no attempt ended (cancelled between the grant and dispatch): nothing was served."""
        if ctx.flow_lease is not None:  # as a rule `ended` closed it
            self._end(ctx, 0.0)

    @staticmethod
    def _end(ctx: RequestContext, actual_cost_tokens: float | None) -> None:
        lease, ctx.flow_lease = ctx.flow_lease, None
        if lease is not None:
            lease.finished(actual_cost_tokens)

    # --- parts --------------------------------------------------------------------------------------

    def _band(self, policy: Policy, priority: int) -> tuple[int, BandPolicy]:
        """The band of `priority` and its policy, worked out once per policy (a reload starts afresh)."""
        if self._bands_of is not policy:
            self._bands_of, self._bands = policy, {}
        found = self._bands.get(priority)
        if found is None:
            band = band_rank(priority)
            found = self._bands[priority] = (band, policy.config.flow_control.band(band_name(band)))
        return found

    def _output(self, ctx: RequestContext) -> OutputPrediction:
        facts = ctx.facts
        if self.predictor is not None and facts.api != "embeddings":
            return self.predictor.output_tokens_prediction(facts.principal.tenant, ctx.model, facts.max_tokens)
        reserved = float(facts.output_reservation)
        last = self._reserved_output
        if last is not None and last.tokens == reserved and last.max_tokens == facts.max_tokens:
            return last  # frozen: the same reservation's prediction serves every request that has it
        last = self._reserved_output = OutputPrediction(reserved, reserved, reserved, facts.max_tokens)
        return last

    @staticmethod
    def _waited(ctx: RequestContext, waited_s: float) -> None:
        """The wait in the context (the walk's `x-tokenway-queued-ms`, the predictor's dispatch time)
        and in the record (the ledger's `queue_ms`)."""
        if not waited_s:
            return
        ctx.gate_wait_s += waited_s
        ctx.record.queue_ms = round((ctx.record.queue_ms or 0.0) + waited_s * 1000.0, 3)

    def _detour(self, turn: Turn, rejected: QueueRejected, on_timeout: int | str) -> Detour:
        ctx = turn.ctx
        last = turn.last_wait
        if rejected.reason == REASON_QUEUE_TIMEOUT and last is not None and last.answer is not None:
            return last.answer(rejected.waited_s)
        status = on_timeout if isinstance(on_timeout, int) else 503
        rejection = queue_rejection(
            rejected.reason,
            model=ctx.model,
            band=band_name(turn.request.band),
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


@dataclass(frozen=True, slots=True)
class Go:
    """Nothing against the request going on this route."""


GO: Final = Go()


@dataclass(frozen=True, slots=True)
class Wait:
    """Not now: wait in the room. `answer(waited_s)`: the reply to a request that waits this out."""

    scope: Blocked
    reason: str
    answer: Callable[[float], Detour] | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Not on this model: leave the room with `detour`."""

    detour: Detour


@dataclass(frozen=True, slots=True)
class Avoid:
    """Not on these endpoints: route again without them; `otherwise` when no route is left."""

    endpoints: Collection[str]
    otherwise: Go | Wait | Refuse


Verdict = Go | Wait | Avoid | Refuse


@dataclass(slots=True)
class Turn:
    """One request's turn at the gate (one `Gate.admit`): what the checks read and may note.

    `pool`: the room it waits in (its route's pool; set by a check's `enter` when it has no route);
    `deadline_s`: monotonic, the band's bound until every `enter` had its say; `unrouted`: the wait
    that holds a request with no route (a cold start), None when such a request is not held;
    `routed_s`: when it first had a route; `last_wait`: the latest `Wait` it got (its answer applies
    at the deadline); `preempt_asked_s`: when a stream was last cut for it (flow control)."""

    ctx: RequestContext
    request: FlowRequest
    pool: str
    began_s: float
    deadline_s: float
    unrouted: Wait | None = None
    routed_s: float | None = None
    last_wait: Wait | None = None
    preempt_asked_s: float = field(default=float("-inf"))


class Check(Protocol):
    """One reason a request may not go now (see the module docstring). Subclass it and override
    `check`, and `enter` / `went` where the check needs them."""

    def enter(self, turn: Turn, routed: Routed | None) -> None:
        """Once per turn, before the first ask; may change `turn.deadline_s`, set `turn.pool` and
        `turn.unrouted` (hold a request that has no route), or raise a `Detour` (refuse at once)."""
        return None

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        """The verdict on `routed` now."""
        ...

    def went(self, turn: Turn, routed: Routed) -> None:
        """The request goes on `routed` (after every check said GO)."""
        return None


def _overriding(checks: Sequence[Check], phase: str) -> tuple[Check, ...]:
    """The checks whose `phase` ("enter", "went") is their own, not `Check`'s no-op: the gate asks
    only these per request."""
    inherited = getattr(Check, phase)
    return tuple(check for check in checks if getattr(type(check), phase, None) is not inherited)
