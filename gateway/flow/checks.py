"""Flow control's own checks at the gate (`Check`, `gateway/flow/gate.py`): saturation and the slot
reserves, spill-over to overflow pools, and the SLO. Each answers the one question the gate asks,
"may this request go now, on this route?", from one side of it: is there a free slot for it (and
is it its tenant's and program's to take), should it leave its owned pools for an overflow one,
can the route meet its latency objective. They are kept together as the gate's built-in checks;
the order the gate asks them in is the app factory's (spill first, docs/architecture.md, "The
gate"), and checks that belong to another feature live with it (`gateway/autoscale/hold.py`,
`gateway/batch/capacity.py`).

Saturation and the slot reserve
-------------------------------

Its verdict on a route, each time the room asks:

- a slot flow control cut for another tenant's request is still freeing: `Wait(TENANT)`;
- the chosen endpoint can start a request now: GO; another can: `Avoid` the ones that cannot (the
  room routes again among the rest); none can: `Wait(POOL)` (nobody waiting there goes), and with
  `preempt` a stream of a tenant over its share is cut so that a slot frees (`policies.flow.saturation`);
- with a slot reserve (`reserve_slots`, or sized from recent demand up to `reserve_max_slots`), a
  tenant over its share may not take the pool's last free slots (`Wait(TENANT)`: another tenant's
  request may go), and (`reserve_avoid_prefills`) one the reserve is kept for goes to an open
  endpoint with no prefill pending when there is one, while (`reserve_clear_lane`) one over its share
  starts only where no prefill is pending and another endpoint with a free slot stays clear
  (`Wait(TENANT)` until a first token, else), and so does one within its share by slots but over its
  weighted share of the band's recent tokens beside a tenant under it;
- with a program slot reserve (`program_reserve_slots`, a tenant with program fairness), a program over
  its share of its tenant's requests in flight starts only on an endpoint that keeps that many free
  slots after it while another program of the tenant is light (`Avoid` the others; none:
  `Wait(PROGRAM)`: another program's request may go), so the engines serving a small program's calls
  are not filled with a wide program's (`policies.flow.saturation`).

As a hook it keeps the streams in flight that flow control may cut: per pool, the contexts of the
streams dispatched on a pool that preempts (`ctx.flow_running_since_s` says since when), each
removed as its attempt ends.

Spill-over: a model's owned pools first, its overflow pools only for what the owned ones cannot take
----------------------------------------------------------------------------------------------------

A model's overflow pools (`overflow: true`, typically a hosted API billed per token) take only what
its owned pools cannot, and requests go back as soon as the owned ones can.

A check at the gate (`gateway/flow/gate.py`), asked first. The walk routes the model's pools in
order, overflow pools last (`backends/fleet.py`), so a request reaches an overflow pool only when no
owned endpoint is left to it. This check's verdict on a route:

- on an owned pool of a model that has an overflow pool: GO, unless the request has waited in the
  owned pool's room longer than `spill.max_wait_ms`, or that room holds `spill.max_waiting` requests
  already, or (with `spill.usd_per_wait_second`) its predicted further wait there is worth more than
  what the dearest overflow pool costs it more (`policies/policy.py`); then `Avoid` every owned
  endpoint of the model (the room routes again, to the overflow pool), otherwise GO (no overflow
  endpoint is ready: it stays);
- on an overflow pool: GO when the tenant may spill (`tenants.<t>.spill.allowed`, and its spill
  spend this UTC day under `spill.usd_per_day`, this replica's share of it with `admission.replicas`
  replicas), else `Avoid` it and wait (`Wait(REQUEST)`) for owned capacity. Batch lines never spill.

So the three reasons a request spills are one mechanism: its owned pool's room is over budget (this
check), the SLO check avoided every owned endpoint (it cannot meet the request's SLO there), or the
owned pools are down (no route to them). Each ask routes the owned pools again first, so the moment
capacity returns, requests stay home. Spilled requests are counted on their pool like any other
(`tokenway_tokens_total{pool}`, `tokenway_cost_usd_total{pool}`, the ledger's `pool`); the ledger's
`extra.spill` says why one spilled.

The SLO check: the gateway's side of the SLO gate (policies/slo.py decides, this part answers)
------------------------------------------------------------------------------------------------

The SLO gate says *whether* a request may go now; flow control (`gateway/flow/`) says *who goes
next* and owns every wait. `SloHook` follows every request with an SLO through the walk:

- prepare: lets routing see the running TPOT SLOs (`RouteRequest.running_tpot_slo_ms`), so the
  latency scorer protects requests already running, and names the SLO class in the record;
- check (a `Check` of the gate, `gateway/flow/gate.py`, asked each time the request might go):
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final, Protocol

from backends.fleet import Fleet, Pool
from backends.types import Endpoint
from gateway.errors import Rejected
from gateway.flow.gate import GO, Avoid, Check, Refuse, Turn, Verdict, Wait
from gateway.flow.queue import Blocked, FlowQueue, FlowRequest
from gateway.request import Detour, Hook, RequestContext, Routed
from policies.flow import saturation as slots
from policies.flow.order import NO_PROGRAM, band_rank
from policies.flow.saturation import (
    FlowSettings,
    ReserveSize,
    SaturationLimits,
    endpoint_saturation,
    open_endpoints,
)
from policies.holder import PolicyHolder
from policies.policy import extra_usd, worth_spilling
from policies.schema import TenantSpillConfig
from policies.slo import Meet, Miss, Slo, decide
from policies.types import Rejection
from predictor.features import Prediction, RequestShape

_LIMITS_KEPT: Final = 256
_PREEMPT_EVERY_S: Final = 0.25  # a waiting request asks for one preemption at most this often (a cut slot the
# engine frees late, or another takes, is asked for again)
_POOL_FULL: Final = Wait(Blocked.POOL, "saturated")
_RESERVED: Final = Wait(Blocked.TENANT, "reserve")
_CLAIMED: Final = Wait(Blocked.TENANT, "claimed")
_LANE: Final = Wait(Blocked.TENANT, "clear_lane")
_PROGRAM_RESERVED: Final = Wait(Blocked.PROGRAM, "program_reserve")


@dataclass(slots=True)
class Saturation(Check, Hook):
    queue: FlowQueue
    settings: FlowSettings
    now: Callable[[], float] = field(default=time.monotonic)
    # (pool, max_num_seqs) -> its limits under `_limits_of` and the slot reserve they keep (None: none):
    # merging them is a pydantic dump, not per-request work
    _limits: dict[tuple[str, int | None], tuple[SaturationLimits, ReserveSize | None]] = field(default_factory=dict)
    _limits_of: FlowSettings | None = None
    # pool -> the streams in flight there that flow control may cut (at most the requests in flight)
    _running: dict[str, list[RequestContext]] = field(default_factory=dict)

    def enter(self, turn: Turn, routed: Routed | None) -> None:
        if routed is not None and self._running.get(routed.pool.name) and self.queue.depth(routed.pool.name):
            # others wait: the room offers the turn in flow order and stops at the first the full pool
            # refuses, so this request may never be asked; a cut for it is asked for now
            self._cut_for(turn, routed, self._open(routed, turn.request))

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        request = turn.request
        if self.queue.activity.claimed_by_other(routed.pool.name, request.tenant):
            return _CLAIMED  # a slot cut for another tenant's request is freeing
        verdict = self._open(routed, request)
        self._cut_for(turn, routed, verdict)
        return verdict

    # --- the hook: streams flow control may cut ---------------------------------------------------

    def dispatched(self, ctx: RequestContext) -> None:
        """A stream of a pool that may preempt is one flow control may cut (`_preempt`)."""
        routed = ctx.routed
        if routed is None or not ctx.facts.stream or ctx.flow_lease is None:
            return
        pool = routed.pool
        if self._pool_limits(pool.name, pool.config.max_num_seqs).preempt:
            if ctx.flow_running_since_s is None:
                self._running.setdefault(pool.name, []).append(ctx)
            ctx.flow_running_since_s = self.now()

    def ended(self, ctx: RequestContext) -> None:
        if ctx.flow_running_since_s is None or ctx.routed is None:
            return
        ctx.flow_running_since_s = None
        pool = ctx.routed.pool.name
        running = self._running.get(pool)
        if running is not None:
            for i, other in enumerate(running):
                if other is ctx:
                    del running[i]
                    break
            if not running:
                del self._running[pool]

    # --- parts --------------------------------------------------------------------------------------

    def _cut_for(self, turn: Turn, routed: Routed, verdict: Verdict) -> None:
        if verdict is _POOL_FULL:
            now = self.now()
            if now - turn.preempt_asked_s >= _PREEMPT_EVERY_S and self._preempt(routed, turn.request):
                turn.preempt_asked_s = now

    def _preempt(self, routed: Routed, request: FlowRequest) -> bool:
        """The pool is full and `request` waits: with `preempt`, cut a stream of a tenant over its
        share (`policies.flow.saturation`) so that its slot frees; whether one was cut."""
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
        for key, ctx in enumerate(running):
            outcome = ctx.outcome
            if outcome is not None and outcome.preemptible() and ctx.flow_running_since_s is not None:
                band = band_rank(ctx.facts.principal.priority)
                streams.append(slots.Running(key, ctx.facts.principal.tenant, band, ctx.flow_running_since_s))
        while streams:
            chosen = slots.victim(request.tenant, request.band, request.weight, streams, active, ratios)
            if chosen is None:
                return False
            ctx = running[chosen.key]
            if ctx.outcome is not None and ctx.outcome.preempt():
                self.queue.count_preemption(pool.name)
                # the cut slot goes to the tenant it was cut for, on every replica, not to whoever is
                # first in order (the flood, as often as not)
                self.queue.activity.claim(pool.name, request.tenant, request.band, request.weight)
                return True
            streams.remove(chosen)
        return False

    def _open(self, routed: Routed, request: FlowRequest) -> Verdict:
        """GO when the routed endpoint can start a request now, `Avoid` the others when one of them
        can, else a wait: POOL when none can, TENANT when the slots left are the reserve and this
        tenant is over its share (or the clear lane keeps it back)."""
        pool = routed.pool
        limits, size = self._pool_entry(pool.name, pool.config.max_num_seqs)
        now = self.now()
        avoid_prefills = lane = False
        if size is not None and limits.max_num_seqs:
            free = slots.free_slots(pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            active = self.queue.activity.active(pool.name)
            kept = slots.reserve_for(request.tenant, request.band, active, size)
            if not slots.may_take(request.tenant, request.band, request.weight, active, free, kept):
                return _RESERVED
            if limits.reserve_avoid_prefills or limits.reserve_clear_lane:
                within = slots.within_share(request.tenant, request.band, request.weight, active)
                avoid_prefills = limits.reserve_avoid_prefills and within
                lane = limits.reserve_clear_lane and (not within or self._heavier(pool.name, request, active))
        program_held = bool(limits.program_reserve_slots) and self._program_held(pool.name, request, limits)
        # the predictions matter only to a TTFT bound: without one, no dict of them per request
        predicted = self._predicted_ttft(routed) if limits.max_predicted_ttft_ms is not None else None
        if (
            not avoid_prefills
            and not lane
            and not program_held
            and endpoint_saturation(
                routed.endpoint, limits, now, predicted.get(routed.endpoint.id) if predicted else None
            )
            is None
        ):
            return GO
        opened = open_endpoints(pool.servable(), limits, now, predicted)
        if not opened:
            return _POOL_FULL
        if avoid_prefills:
            opened = slots.clear_of_prefill(opened) or opened
        if lane and limits.max_num_seqs:
            opened = slots.clear_lane(opened, pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            if not opened:
                return _LANE  # until a pending prefill has its first token (the room is told)
        if program_held and limits.max_num_seqs:
            k, seqs, age = limits.program_reserve_slots, limits.max_num_seqs, limits.max_stats_age_s
            opened = [e for e in opened if slots.keeps_reserve(slots.free_on(e, seqs, now, age), k)]
            if not opened:
                return _PROGRAM_RESERVED  # another program of the tenant may go; this one waits for a slot
        can = {e.id for e in opened}
        if routed.endpoint.id in can:
            return GO
        return Avoid([e.id for e in pool.servable() if e.id not in can], _POOL_FULL)

    def _program_held(self, pool: str, request: FlowRequest, limits: SaturationLimits) -> bool:
        """Whether the program slot reserve holds the request's program back from an endpoint's last
        `program_reserve_slots` free slots (`policies.flow.saturation`): its tenant has program
        fairness, the program is over its share of the tenant's requests in flight, another is light."""
        if not limits.program_reserve_slots or not limits.max_num_seqs:
            return False
        if self.queue.program_half_life(request.tenant) is None:
            return False
        program = request.program or NO_PROGRAM
        return slots.held(self.queue.program_activity.standing(pool, request.tenant, program))

    def _heavier(self, pool: str, request: FlowRequest, active: Mapping[str, slots.Active]) -> bool:
        """Whether the request's tenant is over its token share of the band beside a tenant under it."""
        band = {tenant for tenant, seen in active.items() if seen.band == request.band} | {request.tenant}
        return len(band) > 1 and slots.heavier_than_another(request.tenant, self.queue.fair_share_ratios(pool, band))

    def _pool_limits(self, pool: str, max_num_seqs: int | None) -> SaturationLimits:
        """The pool's limits, merged once per settings object (a replaced `settings` starts afresh)."""
        return self._pool_entry(pool, max_num_seqs)[0]

    def _pool_entry(self, pool: str, max_num_seqs: int | None) -> tuple[SaturationLimits, ReserveSize | None]:
        """`_pool_limits` and the slot reserve they keep (None: no reserve, or no batch size to keep it
        in), both worked out once per settings object rather than per request."""
        if self._limits_of is not self.settings:
            self._limits.clear()
            self._limits_of = self.settings
        key = (pool, max_num_seqs)
        found = self._limits.get(key)
        if found is None:
            if len(self._limits) >= _LIMITS_KEPT:
                self._limits.clear()  # pools and settings come from config: this is only a bound
            limits = self.settings.limits(pool, max_num_seqs)
            size = limits.reserve
            found = self._limits[key] = (limits, size if size.enabled and limits.max_num_seqs else None)
        return found

    @staticmethod
    def _predicted_ttft(routed: Routed) -> dict[str, float]:
        made = routed.decision.predictions
        return {endpoint_id: p.ttft_ms for endpoint_id, p in made.items()} if made else {}


_REFUSED: Final = Wait(Blocked.REQUEST, "spill_refused")
_DEFAULT: Final = TenantSpillConfig()
_MAX_TENANTS: Final = 100_000  # spend counters kept (tenants may be made at run time): the oldest day goes first
REASON_WAITED: Final = "waited"  # over spill.max_wait_ms in the owned pool's room
REASON_CROWDED: Final = "crowded"  # the owned pool's room held spill.max_waiting
REASON_NO_ROUTE: Final = "owned_unavailable"  # no owned endpoint left to it (down, or the SLO check avoided them)
REASON_PRICED: Final = "wait_costlier"  # its predicted wait x spill.usd_per_wait_second > the overflow's extra $


def is_overflow(pool: Pool) -> bool:
    return pool.config.overflow


@dataclass(slots=True)
class Spill(Check, Hook):
    queue: FlowQueue
    policies: PolicyHolder
    fleet: Fleet
    now: Callable[[], float] = field(default=time.monotonic)
    wall: Callable[[], float] = field(default=time.time)
    _spent: dict[str, tuple[int, float]] = field(default_factory=dict)  # tenant -> (UTC day number, USD)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        ctx = turn.ctx
        pools = self.fleet.pools_for_model(ctx.model)
        if not pools or not pools[-1].config.overflow:  # overflow pools sort last: none for this model
            return GO
        if is_overflow(routed.pool):
            if self.may_spill(ctx):
                if ctx.record.spill is None:
                    ctx.record.spill = REASON_NO_ROUTE
                return GO
            return Avoid([e.id for e in routed.pool.endpoints], _REFUSED)
        reason = self._over_budget(turn, routed.pool, pools)
        if reason is None or not self.may_spill(ctx):
            return GO
        ctx.record.spill = reason
        owned = [e.id for pool in pools if not is_overflow(pool) for e in pool.endpoints]
        return Avoid(owned, GO)

    def went(self, turn: Turn, routed: Routed) -> None:
        if not is_overflow(routed.pool):
            turn.ctx.record.spill = None  # it stays home after all (no overflow endpoint was ready)

    def finished(self, ctx: RequestContext) -> None:
        """A request served on an overflow pool counts against its tenant's spill cap."""
        record = ctx.record
        if record.spill is None or not record.cost_usd:
            return
        day = int(self.wall() // 86_400)
        tenant = record.tenant
        held = self._spent.get(tenant)
        spent = held[1] if held is not None and held[0] == day else 0.0
        if held is None and len(self._spent) >= _MAX_TENANTS:
            self._spent.pop(min(self._spent, key=lambda t: self._spent[t][0]))
        self._spent[tenant] = (day, spent + record.cost_usd)

    def may_spill(self, ctx: RequestContext) -> bool:
        if ctx.facts.batch_id is not None:
            return False
        config = self.policies.current.config
        found = config.tenants.get(ctx.facts.principal.tenant)
        spill = found.spill if found is not None else _DEFAULT
        if not spill.allowed:
            return False
        if spill.usd_per_day is None:
            return True
        return self.spent_today(ctx.facts.principal.tenant) < spill.usd_per_day / config.admission.replicas

    def spent_today(self, tenant: str) -> float:
        """USD this replica sent to overflow pools for `tenant` this UTC day."""
        held = self._spent.get(tenant)
        return held[1] if held is not None and held[0] == int(self.wall() // 86_400) else 0.0

    def _over_budget(self, turn: Turn, pool: Pool, pools: Sequence[Pool]) -> str | None:
        policy = self.policies.current.config.spill
        if (self.now() - turn.began_s) * 1000.0 > policy.max_wait_ms:
            return REASON_WAITED
        if policy.max_waiting is not None and self.queue.depth(pool.name) >= policy.max_waiting:
            return REASON_CROWDED
        if policy.usd_per_wait_second is not None and self._wait_costlier(
            turn, pool, pools, policy.usd_per_wait_second
        ):
            return REASON_PRICED
        return None

    def _wait_costlier(self, turn: Turn, pool: Pool, pools: Sequence[Pool], usd_per_s: float) -> bool:
        """The priced bound: the room's predicted wait against the overflow's extra dollars for this
        request (its prompt and predicted output), at the dearest overflow pool it may be sent to."""
        wait_s = self.queue.predicted_wait_s(pool.name, turn.request.band, held=turn.last_wait is not None)
        if not wait_s:  # nobody ahead, or no rate to predict by: only the fixed bounds decide
            return False
        ctx = turn.ctx
        policy = self.policies.current
        facts = ctx.facts
        output = round(ctx.output_prediction.tokens) if ctx.output_prediction is not None else facts.output_reservation
        owned = policy.price(ctx.model, pool.name)
        extra = max(
            extra_usd(owned, policy.price(ctx.model, p.name), facts.prompt_tokens, output)
            for p in pools
            if is_overflow(p)
        )
        return worth_spilling(wait_s, usd_per_s, extra)


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
