"""The SLO hook: the gateway's side of the SLO gate (policies/slo.py decides, this module waits and answers).

`SloHook` follows every request with an SLO through the walk:

- prepare: lets routing see the running TPOT SLOs (`RouteRequest.running_tpot_slo_ms`), so the
  latency scorer protects requests already running, and names the SLO class in the record;
- gate: decides over the routing decision's predictions (`policies.slo.decide`; it predicts the
  chosen endpoint itself when the router made none), re-routes among the endpoints that meet the
  SLO, waits in `SloQueue` when the class says `queue`, and answers a miss with a `Detour`: a 503
  `slo_unattainable` with an honest retry-after, or the model's fallback chain for `on_miss:
  fallback`;
- dispatched / ended: keeps `RunningTpotSlos` and wakes the pool's queue whenever a request there
  ends (whatever its SLO: capacity freed is capacity freed).

- `RunningTpotSlos`: per endpoint, the tightest TPOT SLO of the requests in flight there (updated
  at dispatch and end; O(distinct SLO values) per end). The decision and the latency scorer read its
  `floors` mapping, live, so a new request never slows those requests past their SLO.
- `SloQueue`: a bounded wait for capacity, head of line by priority then arrival: when a request on
  the pool ends, the first waiter re-routes and decides again, and passes the turn on if served.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from backends.types import Endpoint
from gateway.errors import Rejected
from gateway.request import Detour, Hook, RequestContext, Reroute, Routed
from policies.slo import Meet, Miss, Slo, decide
from policies.types import Rejection
from predictor.types import Prediction, RequestShape

# record.reject_reason values (the metrics count shed, queue_full and queue_timeout as shed outcomes)
REASON_UNATTAINABLE: Final = "slo_unattainable"
REASON_SHED: Final = "shed"
REASON_QUEUED: Final = "queued"  # served after waiting in the queue (status ok)
REASON_QUEUE_FULL: Final = "queue_full"
REASON_QUEUE_TIMEOUT: Final = "queue_timeout"

_RECHECK_S: Final = 0.05

T = TypeVar("T")


class PredictsLatency(Protocol):
    """`predictor.service.LatencyPredictor.predict`, all the gate needs of the predictor."""

    def predict(
        self,
        pool: str,
        request: RequestShape,
        endpoints: Sequence[Endpoint],
        cached_tokens: Sequence[int],
        now_s: float | None = None,
    ) -> list[Prediction]: ...


@dataclass(frozen=True, slots=True)
class RunningSlo:
    """One dispatched request's entry in `RunningTpotSlos` (equal values end equal entries)."""

    endpoint_id: str
    tpot_ms: float


class RunningTpotSlos:
    """Tightest TPOT SLO among the requests in flight on each endpoint (`floors`, read live)."""

    def __init__(self) -> None:
        self.floors: dict[str, float] = {}
        self._counts: dict[str, dict[float, int]] = {}

    def begin(self, endpoint_id: str, tpot_ms: float | None) -> RunningSlo | None:
        if tpot_ms is None:
            return None
        counts = self._counts.setdefault(endpoint_id, {})
        counts[tpot_ms] = counts.get(tpot_ms, 0) + 1
        floor = self.floors.get(endpoint_id)
        if floor is None or tpot_ms < floor:
            self.floors[endpoint_id] = tpot_ms
        return RunningSlo(endpoint_id, tpot_ms)

    def end(self, running: RunningSlo | None) -> None:
        if running is None:
            return
        counts = self._counts.get(running.endpoint_id)
        if not counts or running.tpot_ms not in counts:
            return
        left = counts[running.tpot_ms] - 1
        if left:
            counts[running.tpot_ms] = left
            return
        del counts[running.tpot_ms]
        if counts:
            self.floors[running.endpoint_id] = min(counts)
        else:
            del self._counts[running.endpoint_id]
            self.floors.pop(running.endpoint_id, None)


@dataclass(order=True, slots=True)
class _Waiter:
    rank: tuple[int, int]  # (-priority, arrival sequence): the order of wake-ups
    wake: asyncio.Future[None] = field(compare=False)


class SloQueue:
    """Requests waiting for an endpoint that meets their SLO, per pool, in priority order.

    Head of line: each event (a request on the pool ended) wakes only the first waiter (highest
    priority, then earliest); when it is served it passes the wake-up on, when it still misses the
    others keep waiting. So an event costs one prediction, not one per waiter, and nobody overtakes
    a higher-priority request. Only the head also rechecks every `recheck_s` (predictions move with
    time and scraped load too); the others wait for an event or their own deadline.
    """

    def __init__(self, recheck_s: float = _RECHECK_S) -> None:
        self.recheck_s = recheck_s
        self._waiters: dict[str, list[_Waiter]] = {}  # sorted by rank
        self._queued: dict[str, int] = {}  # SLO class -> requests waiting
        self._sequence = itertools.count()

    def queued(self, slo_class: str) -> int:
        return self._queued.get(slo_class, 0)

    def waiting(self, pool: str) -> int:
        """Requests waiting for an endpoint of `pool` now (batch work backs off while any do)."""
        return len(self._waiters.get(pool, ()))

    def notify(self, pool: str) -> None:
        """Capacity may have freed on `pool`: wake its first waiter."""
        waiters = self._waiters.get(pool)
        while waiters:
            waiter = waiters.pop(0)
            if not waiter.wake.done():
                waiter.wake.set_result(None)
                break
        if not waiters:
            self._waiters.pop(pool, None)

    async def wait_for(
        self,
        pool: str,
        slo: Slo,
        priority: int,
        deadline_s: float,
        attempt: Callable[[], T | None],
    ) -> T | None:
        """Call `attempt` after each wake-up until it returns a value or `deadline_s` (perf_counter)
        passes; None on timeout. The caller checks `queued(...) < slo.max_queued` first."""
        rank = (-priority, next(self._sequence))
        self._queued[slo.class_name] = self._queued.get(slo.class_name, 0) + 1
        loop = asyncio.get_running_loop()
        try:
            while True:
                remaining = deadline_s - time.perf_counter()
                if remaining <= 0:
                    self.notify(pool)  # leaving the head: the next one takes over the rechecks
                    return None
                waiter = _Waiter(rank, loop.create_future())
                waiters = self._waiters.setdefault(pool, [])
                bisect.insort(waiters, waiter)
                timeout_s = min(remaining, self.recheck_s) if waiters[0] is waiter else remaining
                try:
                    with contextlib.suppress(TimeoutError):  # a timeout is a recheck, like a wake-up
                        await asyncio.wait_for(asyncio.shield(waiter.wake), timeout_s)
                finally:  # woken, timed out or cancelled: no longer waiting on this pool
                    self._forget(pool, waiter)
                found = attempt()
                if found is not None:
                    self.notify(pool)  # capacity may be left for the next one
                    return found
        finally:
            self._queued[slo.class_name] -= 1

    def _forget(self, pool: str, waiter: _Waiter) -> None:
        waiters = self._waiters.get(pool)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[pool]


def slo_miss(miss: Miss, slo: Slo, model: str, reason: str, *, waited_ms: float | None = None) -> Detour:
    """The 503 of a miss (`reason` is the record's reject_reason), with an honest retry-after; a
    Detour so the walk releases the reservation and, for `on_miss: fallback`, tries the chain."""
    retry_s = miss.retry_after_s()
    targets = ", ".join(
        f"{name} <= {value:g} ms" for name, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms)) if value
    )
    closest = miss.closest
    over = []
    if closest.ttft_excess_ms > 0:
        over.append(f"TTFT {closest.ttft_excess_ms:.0f} ms")
    if closest.tpot_excess_ms > 0:
        over.append(f"TPOT {closest.tpot_excess_ms:.1f} ms")
    parts = [f"{closest.probability:.0%} likely to meet it"] if slo.compare == "probability" else []
    if over:
        parts.append(f"{' and '.join(over)} over")
    detail = f" (closest endpoint: {'; '.join(parts)})" if parts else ""
    prefix = {
        REASON_SHED: "Shed: sheddable traffic is dropped first. ",
        REASON_QUEUE_FULL: "The SLO queue is full. ",
        REASON_QUEUE_TIMEOUT: f"Waited {waited_ms or 0:.0f} ms in the SLO queue. ",
    }.get(reason, "")
    message = (
        f"{prefix}No endpoint of '{model}' is predicted to meet the latency SLO ({targets}){detail}. "
        f"Retry in {retry_s} s."
    )
    rejection = Rejection(
        status=503,
        message=message,
        type="server_error",
        code="slo_unattainable",
        headers=(("retry-after", str(retry_s)), ("retry-after-ms", str(retry_s * 1000))),
        reason=reason,
    )
    return Detour(reason, Rejected(rejection), fallback=miss.action == "fallback")


@dataclass(slots=True)
class SloHook(Hook):
    """The SLO gate as a hook of the walk (see the module docstring)."""

    predictor: PredictsLatency | None = None  # predicts the chosen endpoint when the router made none
    running: RunningTpotSlos = field(default_factory=RunningTpotSlos)
    queue: SloQueue = field(default_factory=SloQueue)

    async def prepare(self, ctx: RequestContext) -> None:
        slo = ctx.facts.slo
        if slo is None:
            return
        assert ctx.routing is not None
        ctx.routing.running_tpot_slo_ms = self.running.floors
        if slo.class_name:
            ctx.record.slo_class = slo.class_name

    async def gate(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed:
        slo = ctx.facts.slo
        if slo is None:
            return routed
        verdict = self._verdict(ctx, slo, routed)
        routed = self._restrict(routed, verdict, reroute)
        if isinstance(verdict, Meet) and verdict.idle_only:
            ctx.record.slo_idle_admit = True  # none meets it; an idle endpoint always admits
        if not isinstance(verdict, Miss) or verdict.action == "proceed":
            return routed
        if verdict.action != "queue":
            raise slo_miss(verdict, slo, ctx.model, REASON_SHED if verdict.action == "shed" else REASON_UNATTAINABLE)
        if self.queue.queued(slo.class_name) >= slo.max_queued:
            raise slo_miss(verdict, slo, ctx.model, REASON_QUEUE_FULL)
        return await self._wait(ctx, slo, routed, verdict, reroute)

    def dispatched(self, ctx: RequestContext) -> None:
        slo = ctx.facts.slo
        if slo is not None and ctx.routed is not None:
            self.running.begin(ctx.routed.endpoint.id, slo.tpot_ms)

    def ended(self, ctx: RequestContext) -> None:
        """A request on the pool finished (or failed): drop its TPOT SLO, wake the pool's queue."""
        routed = ctx.routed
        if routed is None:
            return
        slo = ctx.facts.slo
        if slo is not None and slo.tpot_ms is not None:
            self.running.end(RunningSlo(routed.endpoint.id, slo.tpot_ms))
        self.queue.notify(routed.pool.name)

    async def _wait(self, ctx: RequestContext, slo: Slo, routed: Routed, verdict: Miss, reroute: Reroute) -> Routed:
        started_s = time.perf_counter()
        deadline_s = started_s + slo.max_queue_ms / 1000.0
        if slo.ttft_ms is not None:  # past the TTFT objective, waiting cannot help any more
            deadline_s = min(deadline_s, ctx.arrived_s + slo.ttft_ms / 1000.0)
        last: list[Miss] = [verdict]

        def attempt() -> Routed | None:
            found = reroute(())
            if found is None:
                return None
            again = self._verdict(ctx, slo, found)
            if isinstance(again, Miss):
                last[0] = again
                return None
            return self._restrict(found, again, reroute)

        with ctx.trace.span("slo_queue", model=ctx.model):
            try:
                found = await self.queue.wait_for(
                    routed.pool.name, slo, ctx.facts.principal.priority, deadline_s, attempt
                )
            finally:
                waited_s = time.perf_counter() - started_s
                ctx.gate_wait_s += waited_s
                ctx.record.slo_queue_ms = round(waited_s * 1000.0, 3)
        if found is None:
            raise slo_miss(last[0], slo, ctx.model, REASON_QUEUE_TIMEOUT, waited_ms=waited_s * 1000.0)
        ctx.record.reject_reason = REASON_QUEUED
        return found

    def _verdict(self, ctx: RequestContext, slo: Slo, routed: Routed) -> Meet | Miss | None:
        """Decide over the router's predictions (or the chosen endpoint's alone, for routers that
        make none); None when nothing can be predicted (predictor disabled): proceed."""
        decision = routed.decision
        made = decision.predictions
        if made is None or decision.endpoint.id not in made:
            if self.predictor is None:
                return None
            facts = ctx.facts
            shape = RequestShape(facts.prompt_tokens, facts.max_tokens, facts.principal.tenant, ctx.model)
            prediction = self.predictor.predict(
                routed.pool.name, shape, [decision.endpoint], [decision.cached_tokens_estimate]
            )[0]
            made = decision.predictions = {decision.endpoint.id: prediction}
        return decide(
            slo,
            made.values(),
            priority=ctx.facts.principal.priority,
            running_tpot_slo_ms=self.running.floors,
            elapsed_ms=(time.perf_counter() - ctx.arrived_s) * 1000.0,
        )

    @staticmethod
    def _restrict(routed: Routed, verdict: Meet | Miss | None, reroute: Reroute) -> Routed:
        """When the router's choice misses the SLO but others meet it, route again among those."""
        if not isinstance(verdict, Meet) or routed.endpoint.id in verdict.endpoint_ids:
            return routed
        made = routed.decision.predictions or {}
        missing = [endpoint_id for endpoint_id in made if endpoint_id not in verdict.endpoint_ids]
        return reroute(missing) or routed
