"""The SLO hook: the gateway's side of the SLO gate (policies/slo.py decides, this module answers).

The SLO gate says *whether* a request may go now; flow control (`gateway/flow/`) says *who goes
next* and owns every wait. `SloHook` follows every request with an SLO through the walk:

- prepare: lets routing see the running TPOT SLOs (`RouteRequest.running_tpot_slo_ms`), so the
  latency scorer protects requests already running, and names the SLO class in the record;
- check (asked by the flow hook's waiting room each time the request might go): decides over the
  routing decision's predictions (`policies.slo.decide`; it predicts the chosen endpoint itself when
  the router made none), re-routes among the endpoints that meet the SLO, answers `Blocked.REQUEST`
  while a class that says `queue` is not met (the request keeps waiting in flow order, without
  holding up the requests behind it), and answers any other miss with a `Detour`: a 503
  `slo_unattainable` with an honest retry-after, or the model's fallback chain for `on_miss:
  fallback`; a queued request's deadline is bounded by its class's `max_queue_ms` and its TTFT
  objective, and one that waits that out gets the SLO's 503;
- dispatched / ended: keeps `RunningTpotSlos`.

`RunningTpotSlos`: per endpoint, the tightest TPOT SLO of the requests in flight there (updated at
dispatch and end; O(distinct SLO values) per end). The decision and the latency scorer read its
`floors` mapping, live, so a new request never slows those requests past their SLO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from backends.types import Endpoint
from gateway.errors import Rejected
from gateway.flow.types import Blocked
from gateway.request import Detour, Hook, RequestContext, Reroute, Routed
from policies.slo import Meet, Miss, Slo, decide
from policies.types import Rejection
from predictor.types import Prediction, RequestShape

# record.reject_reason values (the metrics count shed, queue_full and queue_timeout as shed outcomes)
REASON_UNATTAINABLE: Final = "slo_unattainable"
REASON_SHED: Final = "shed"
REASON_QUEUE_FULL: Final = "queue_full"
REASON_QUEUE_TIMEOUT: Final = "queue_timeout"


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
        REASON_QUEUE_FULL: "Too many requests of this SLO class are waiting. ",
        REASON_QUEUE_TIMEOUT: f"Waited {waited_ms or 0:.0f} ms for an endpoint that meets it. ",
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
    """The SLO gate as a hook of the walk and a check of the flow hook (see the module docstring).

    `waiting(pool, slo_class)` counts the class's requests waiting in the pool (the flow queue's
    `waiting_with`), for `max_queued`."""

    predictor: PredictsLatency | None = None  # predicts the chosen endpoint when the router made none
    running: RunningTpotSlos = field(default_factory=RunningTpotSlos)
    waiting: Callable[[str, str], int] = lambda pool, slo_class: 0
    now: Callable[[], float] = time.monotonic
    _misses: dict[int, Miss] = field(default_factory=dict)  # id(ctx) -> its last miss while it waits

    async def prepare(self, ctx: RequestContext) -> None:
        slo = ctx.facts.slo
        if slo is None:
            return
        assert ctx.routing is not None
        ctx.routing.running_tpot_slo_ms = self.running.floors
        if slo.class_name:
            ctx.record.slo_class = slo.class_name

    def check(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed | Blocked:
        """The routing decision to go with, Blocked.REQUEST while a `queue` class is not met, or a
        Detour for any other miss."""
        slo = ctx.facts.slo
        if slo is None:
            return routed
        verdict = self._verdict(ctx, slo, routed)
        routed = self._restrict(routed, verdict, reroute)
        if isinstance(verdict, Meet) and verdict.idle_only:
            ctx.record.slo_idle_admit = True  # none meets it; an idle endpoint always admits
        if not isinstance(verdict, Miss) or verdict.action == "proceed":
            self._misses.pop(id(ctx), None)
            return routed
        if verdict.action != "queue":
            raise slo_miss(verdict, slo, ctx.model, REASON_SHED if verdict.action == "shed" else REASON_UNATTAINABLE)
        if id(ctx) not in self._misses and self.waiting(routed.pool.name, slo.class_name) >= slo.max_queued:
            raise slo_miss(verdict, slo, ctx.model, REASON_QUEUE_FULL)
        self._misses[id(ctx)] = verdict
        return Blocked.REQUEST

    def deadline_s(self, ctx: RequestContext, deadline_s: float) -> float:
        """A `queue` class waits at most its `max_queue_ms`, and never past its TTFT objective."""
        slo = ctx.facts.slo
        if slo is None or slo.on_miss != "queue":
            return deadline_s
        now = self.now()
        deadline_s = min(deadline_s, now + slo.max_queue_ms / 1000.0)
        if slo.ttft_ms is not None:  # past the TTFT objective, waiting cannot help any more
            elapsed_s = time.perf_counter() - ctx.arrived_s
            deadline_s = min(deadline_s, now - elapsed_s + slo.ttft_ms / 1000.0)
        return deadline_s

    def last_wait_error(self, ctx: RequestContext, waited_s: float) -> Detour | None:
        """The answer to a request this gate kept waiting until its deadline."""
        miss, slo = self._misses.pop(id(ctx), None), ctx.facts.slo
        if miss is None or slo is None:
            return None
        return slo_miss(miss, slo, ctx.model, REASON_QUEUE_TIMEOUT, waited_ms=waited_s * 1000.0)

    def dispatched(self, ctx: RequestContext) -> None:
        slo = ctx.facts.slo
        if slo is not None and ctx.routed is not None:
            self.running.begin(ctx.routed.endpoint.id, slo.tpot_ms)

    def ended(self, ctx: RequestContext) -> None:
        """A request on the pool finished (or failed): drop its TPOT SLO."""
        routed = ctx.routed
        slo = ctx.facts.slo
        if routed is not None and slo is not None and slo.tpot_ms is not None:
            self.running.end(RunningSlo(routed.endpoint.id, slo.tpot_ms))

    def finished(self, ctx: RequestContext) -> None:
        self._misses.pop(id(ctx), None)

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
