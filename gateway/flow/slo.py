"""The SLO hook: the gateway's side of the SLO gate (policies/slo.py decides, this module answers).

The SLO gate says *whether* a request may go now; flow control (`gateway/flow/`) says *who goes
next* and owns every wait. `SloHook` follows every request with an SLO through the walk:

- prepare: lets routing see the running TPOT SLOs (`RouteRequest.running_tpot_slo_ms`), so the
  latency scorer protects requests already running, and names the SLO class in the record;
- check (a `Check` of the gate, `gateway/flow/check.py`, asked each time the request might go):
  decides over the routing decision's predictions (`policies.slo.decide`; it predicts the chosen
  endpoint itself when the router made none), `Avoid`s the endpoints that miss when others meet
  the SLO (the room routes again among those), answers `Wait(REQUEST)` while a class that says
  `queue` is not met (the request keeps waiting in flow order, without holding up the requests
  behind it), and `Refuse`s any other miss: a 503 `slo_unattainable` with an honest retry-after, or
  the model's fallback chain for `on_miss: fallback`; a queued request's deadline is bounded by its
  class's `max_queue_ms` and its TTFT objective (`enter`), and one that waits that out gets the
  SLO's 503 (the wait's answer);
- dispatched / ended: keeps `RunningTpotSlos`.

`RunningTpotSlos`: per endpoint, the tightest TPOT SLO of the requests in flight there (updated at
dispatch and end; O(distinct SLO values) per end). The decision and the latency scorer read its
`floors` mapping, live, so a new request never slows those requests past their SLO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final, Protocol

from backends.types import Endpoint
from gateway.errors import Rejected
from gateway.flow.check import GO, Avoid, Check, Refuse, Turn, Verdict, Wait
from gateway.flow.types import Blocked
from gateway.request import Detour, Hook, RequestContext, Routed
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
        lower_cached_tokens: Sequence[int] | None = None,
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
class SloHook(Check, Hook):
    """The SLO gate as a hook of the walk and a check of the gate (see the module docstring).

    `waiting(pool, slo_class)` counts the class's requests waiting in the pool (the flow queue's
    `waiting_with`), for `max_queued`. A request's last miss while it waits is `ctx.slo_miss`."""

    predictor: PredictsLatency | None = None  # predicts the chosen endpoint when the router made none
    running: RunningTpotSlos = field(default_factory=RunningTpotSlos)
    waiting: Callable[[str, str], int] = lambda pool, slo_class: 0
    now: Callable[[], float] = time.monotonic

    async def prepare(self, ctx: RequestContext) -> None:
        slo = ctx.facts.slo
        if slo is None:
            return
        assert ctx.routing is not None
        ctx.routing.running_tpot_slo_ms = self.running.floors
        if slo.class_name:
            ctx.record.slo_class = slo.class_name

    def enter(self, turn: Turn, routed: Routed | None) -> None:
        """A `queue` class waits at most its `max_queue_ms`, and never past its TTFT objective."""
        ctx = turn.ctx
        ctx.slo_miss = None  # a turn begins with no miss (an earlier model's or attempt's is over)
        slo = ctx.facts.slo
        if slo is None or slo.on_miss != "queue":
            return
        now = self.now()
        deadline_s = min(turn.deadline_s, now + slo.max_queue_ms / 1000.0)
        if slo.ttft_ms is not None:  # past the TTFT objective, waiting cannot help any more
            elapsed_s = time.perf_counter() - ctx.arrived_s
            deadline_s = min(deadline_s, now - elapsed_s + slo.ttft_ms / 1000.0)
        turn.deadline_s = deadline_s

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        """GO, `Avoid` the endpoints that miss when others meet it, `Wait(REQUEST)` while a `queue`
        class is not met, or `Refuse` any other miss."""
        ctx = turn.ctx
        slo = ctx.facts.slo
        if slo is None:
            return GO
        verdict = self._verdict(ctx, slo, routed)
        if isinstance(verdict, Meet):
            if verdict.idle_only:
                ctx.record.slo_idle_admit = True  # none meets it; an idle endpoint always admits
            if routed.endpoint.id not in verdict.endpoint_ids:
                made = routed.decision.predictions or {}
                missing = [endpoint_id for endpoint_id in made if endpoint_id not in verdict.endpoint_ids]
                if missing:
                    return Avoid(missing, GO)  # none left to route to: it goes where the router chose
        if not isinstance(verdict, Miss) or verdict.action == "proceed":
            ctx.slo_miss = None
            return GO
        if verdict.action != "queue":
            reason = REASON_SHED if verdict.action == "shed" else REASON_UNATTAINABLE
            return Refuse(slo_miss(verdict, slo, ctx.model, reason))
        if ctx.slo_miss is None and self.waiting(routed.pool.name, slo.class_name) >= slo.max_queued:
            return Refuse(slo_miss(verdict, slo, ctx.model, REASON_QUEUE_FULL))
        ctx.slo_miss = verdict
        return Wait(Blocked.REQUEST, "slo", partial(self._waited_out, ctx))

    @staticmethod
    def _waited_out(ctx: RequestContext, waited_s: float) -> Detour:
        """The answer to a request this gate kept waiting until its deadline."""
        miss, ctx.slo_miss = ctx.slo_miss, None
        slo = ctx.facts.slo
        assert miss is not None and slo is not None
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
                routed.pool.name,
                shape,
                [decision.endpoint],
                [decision.cached_tokens_estimate],
                lower_cached_tokens=[decision.cached_lower_tokens],
            )[0]
            made = decision.predictions = {decision.endpoint.id: prediction}
        return decide(
            slo,
            made.values(),
            priority=ctx.facts.principal.priority,
            running_tpot_slo_ms=self.running.floors,
            elapsed_ms=(time.perf_counter() - ctx.arrived_s) * 1000.0,
        )
