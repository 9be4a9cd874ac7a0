"""Saturation and the slot reserve: flow control's own check at the gate (`gateway/flow/check.py`).

Its verdict on a route, each time the room asks:

- a slot flow control cut for another tenant's request is still freeing: `Wait(TENANT)`;
- the chosen endpoint can start a request now: GO; another can: `Avoid` the ones that cannot (the
  room routes again among the rest); none can: `Wait(POOL)` (nobody waiting there goes), and with
  `preempt` a stream of a tenant over its share is cut so that a slot frees (`policies.flow.preempt`);
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
  are not filled with a wide program's (`policies.flow.program_reserve`).

As a hook it keeps the streams in flight that flow control may cut: per pool, the contexts of the
streams dispatched on a pool that preempts (`ctx.flow_running_since_s` says since when), each
removed as its attempt ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from gateway.flow.check import GO, Avoid, Check, Turn, Verdict, Wait
from gateway.flow.queue import FlowQueue
from gateway.flow.types import Blocked, FlowRequest
from gateway.request import Hook, RequestContext, Routed
from policies.flow import preempt, program_reserve, reserve
from policies.flow.bands import band_rank
from policies.flow.config import FlowSettings
from policies.flow.programs import NO_PROGRAM
from policies.flow.saturation import SaturationLimits, endpoint_saturation, open_endpoints

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
    # (pool, max_num_seqs) -> its limits under `_limits_of`: merging them is a pydantic dump, not per-request work
    _limits: dict[tuple[str, int | None], SaturationLimits] = field(default_factory=dict)
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
        for key, ctx in enumerate(running):
            outcome = ctx.outcome
            if outcome is not None and outcome.preemptible() and ctx.flow_running_since_s is not None:
                band = band_rank(ctx.facts.principal.priority)
                streams.append(preempt.Running(key, ctx.facts.principal.tenant, band, ctx.flow_running_since_s))
        while streams:
            chosen = preempt.victim(request.tenant, request.band, request.weight, streams, active, ratios)
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
        limits = self._pool_limits(pool.name, pool.config.max_num_seqs)
        now = self.now()
        size = limits.reserve
        avoid_prefills = lane = False
        if size.enabled and limits.max_num_seqs:
            free = reserve.free_slots(pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            active = self.queue.activity.active(pool.name)
            kept = reserve.reserve_for(request.tenant, request.band, active, size)
            if not reserve.may_take(request.tenant, request.band, request.weight, active, free, kept):
                return _RESERVED
            if limits.reserve_avoid_prefills or limits.reserve_clear_lane:
                within = reserve.within_share(request.tenant, request.band, request.weight, active)
                avoid_prefills = limits.reserve_avoid_prefills and within
                lane = limits.reserve_clear_lane and (not within or self._heavier(pool.name, request, active))
        program_held = self._program_held(pool.name, request, limits)
        predicted = self._predicted_ttft(routed)
        if (
            not avoid_prefills
            and not lane
            and not program_held
            and endpoint_saturation(routed.endpoint, limits, now, predicted.get(routed.endpoint.id)) is None
        ):
            return GO
        opened = open_endpoints(pool.servable(), limits, now, predicted)
        if not opened:
            return _POOL_FULL
        if avoid_prefills:
            opened = reserve.clear_of_prefill(opened) or opened
        if lane and limits.max_num_seqs:
            opened = reserve.clear_lane(opened, pool.servable(), limits.max_num_seqs, now, limits.max_stats_age_s)
            if not opened:
                return _LANE  # until a pending prefill has its first token (the room is told)
        if program_held and limits.max_num_seqs:
            k, seqs, age = limits.program_reserve_slots, limits.max_num_seqs, limits.max_stats_age_s
            opened = [e for e in opened if program_reserve.keeps_reserve(reserve.free_on(e, seqs, now, age), k)]
            if not opened:
                return _PROGRAM_RESERVED  # another program of the tenant may go; this one waits for a slot
        can = {e.id for e in opened}
        if routed.endpoint.id in can:
            return GO
        return Avoid([e.id for e in pool.servable() if e.id not in can], _POOL_FULL)

    def _program_held(self, pool: str, request: FlowRequest, limits: SaturationLimits) -> bool:
        """Whether the program slot reserve holds the request's program back from an endpoint's last
        `program_reserve_slots` free slots (`policies.flow.program_reserve`): its tenant has program
        fairness, the program is over its share of the tenant's requests in flight, another is light."""
        if not limits.program_reserve_slots or not limits.max_num_seqs:
            return False
        if self.queue.program_half_life(request.tenant) is None:
            return False
        program = request.program or NO_PROGRAM
        return program_reserve.held(self.queue.program_activity.standing(pool, request.tenant, program))

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
