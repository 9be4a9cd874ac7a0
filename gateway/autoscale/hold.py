"""Elastic pools in the walk of a request: the cold-start check at the gate, and the hook that counts
demand on arrival and learns from each request's end. One module because they are the autoscaler's
two places in the walk and work on the same requests: the hook counts a request for a pool at zero
(the planner's demand), the check holds it in the waiting room while a replica starts (and notes the
hold in its record), and the hook learns from its end.

The cold start: the gate's check that holds a request for a pool with nothing serving
-------------------------------------------------------------------------------------

When routing finds no endpoint for the request's model, no pool of the model serves and an
autoscaled one can start or wake, `enter` holds the request in that pool's waiting room
(`gateway/flow/`, the one room every wait happens in): in flow order (priority band, then tenant
fairness), until a replica of the pool is ready (routing then finds it; the executor's ready event,
`notify`, and the room's own recheck wake it), for at most the pool's `max_hold_s` (its deadline is
stretched to that), and at most `max_held` requests at a time (more are refused at once). The
planner runs at once (`on_hold`). Past either bound the request is answered 503 with `retry-after`
from the expected start time, unless the model's fallback chain takes it (trigger `cold_start`).
The wait is part of its TTFT, is reported in `x-tokenway-cold-start-ms` and the record's
`cold_start_ms` (`went`), and counts in the room's own wait too (`x-tokenway-queued-ms`).

The hook: counted on arrival, learnt from
-----------------------------------------

- `prepare` (each model of the chain): the request counts towards its pool's token rates (the
  planner's demand, also while the pool is at zero). It never waits: a request for a pool at zero
  is held by the gate's cold-start check (above), in the one waiting room.
- `ended`: a stream its replica cut is counted as migrated (it continued on another replica) or
  failed (`tokenway_stream_migrations_total`).
- `finished`: the request's real prompt, cache hits and output teach the pool's mix, its TPOT beside
  the batch it ran in calibrates the capacity model, and the record carries the hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from backends.fleet import Fleet, Pool
from gateway.autoscale.loop import Autoscaler
from gateway.errors import NoHealthyBackend
from gateway.flow.gate import GO, Check, Turn, Verdict, Wait
from gateway.flow.queue import Blocked, FlowQueue
from gateway.request import Detour, Hook, RequestContext, Routed
from gateway.telemetry.metrics import PoolMetrics

COLD_START_HEADER: Final = "x-tokenway-cold-start-ms"
TRIGGER: Final = "cold_start"


class ColdStartRejected(NoHealthyBackend):
    code = "cold_start"


class ColdStart(Check):
    def __init__(
        self,
        fleet: Fleet,
        expected_ready_in_s: Callable[[str], float | None],
        startup_s: Callable[[str], float],
        *,
        on_hold: Callable[[str], None] | None = None,
        on_wait: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.expected_ready_in_s = expected_ready_in_s
        self.startup_s = startup_s
        self.on_hold = on_hold  # a request began waiting: plan now
        self.on_wait = on_wait  # (pool, seconds held) once per held request
        self.clock = clock
        self.room: FlowQueue | None = None  # the gate's waiting room (the app factory sets it)

    def pool_to_hold(self, model: str) -> Pool | None:
        """The autoscaled pool a request for `model` should wait for, or None when it need not wait
        (a pool of the model serves now) or cannot (no pool of the model scales)."""
        pools = self.fleet.pools_for_model(model)
        if any(p.has_ready for p in pools):
            return None
        return next((p for p in pools if p.config.autoscale is not None), None)

    def held(self, pool: str) -> int:
        """Requests waiting for `pool` to start: everyone in its room while nothing of it is ready."""
        found = self.fleet.pools.get(pool)
        if self.room is None or found is None or found.has_ready:
            return 0
        return self.room.depth(pool)

    def notify(self, pool: str) -> None:
        """A replica of `pool` is ready: the requests held for it may go."""
        if self.room is not None:
            self.room.notify(pool)

    # --- the check ----------------------------------------------------------------------------------

    def enter(self, turn: Turn, routed: Routed | None) -> None:
        """No route, and an autoscaled pool of the model can start: hold the request for it."""
        if routed is not None:
            return
        pool = self.pool_to_hold(turn.ctx.model)
        if pool is None or pool.config.autoscale is None:
            return
        policy = pool.config.autoscale
        if self.held(pool.name) >= policy.max_held:
            self._observe(pool.name, 0.0)
            raise Detour(TRIGGER, self._rejection(pool, "queue_full", 0.0))
        turn.pool = pool.name
        turn.deadline_s = max(turn.deadline_s, turn.began_s + policy.max_hold_s)
        turn.unrouted = Wait(Blocked.POOL, TRIGGER, partial(self._waited_out, pool))
        if self.on_hold is not None:
            self.on_hold(pool.name)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        return GO  # a route exists: a replica is serving

    def went(self, turn: Turn, routed: Routed) -> None:
        """A request held for a start goes: how long it was held, in its answer and its record."""
        if turn.unrouted is None:
            return
        waited_s = (turn.routed_s if turn.routed_s is not None else self.clock()) - turn.began_s
        self._observe(turn.pool, waited_s)
        ctx = turn.ctx
        ctx.record.cold_start_ms = round(waited_s * 1000.0, 1)
        ctx.headers.append((COLD_START_HEADER, f"{waited_s * 1000.0:.0f}"))

    def _waited_out(self, pool: Pool, waited_s: float) -> Detour:
        self._observe(pool.name, waited_s)
        return Detour(TRIGGER, self._rejection(pool, "queue_timeout", waited_s))

    def _observe(self, pool: str, seconds: float) -> None:
        if self.on_wait is not None:
            self.on_wait(pool, seconds)

    def _rejection(self, pool: Pool, reason: str, waited_s: float) -> ColdStartRejected:
        expected = self.expected_ready_in_s(pool.name)
        retry = max(1, math.ceil(expected if expected is not None else self.startup_s(pool.name)))
        why = "too many requests are waiting" if reason == "queue_full" else f"it did not start within {waited_s:.0f} s"
        return ColdStartRejected(
            f"No replica of '{pool.config.model}' is serving yet (pool {pool.name!r} is starting); {why}.",
            headers=[("retry-after", str(retry))],
        )


@dataclass(slots=True)
class ElasticHook(Hook):
    fleet: Fleet
    autoscaler: Autoscaler
    cold: ColdStart  # the gate's cold-start check (the app factory puts it among the gate's checks)
    metrics: PoolMetrics | None = None
    _elastic: frozenset[str] = field(init=False)  # models served by an autoscaled pool

    def __post_init__(self) -> None:
        self._elastic = frozenset(p.config.model for p in self.fleet.pools.values() if p.config.elastic)

    async def prepare(self, ctx: RequestContext) -> None:
        if ctx.model not in self._elastic:
            return
        facts = ctx.facts
        pools = [p for p in self.fleet.pools_for_model(ctx.model) if p.config.elastic]
        self.autoscaler.arrived(pools[0].name, facts.prompt_tokens, facts.max_tokens)

    def ended(self, ctx: RequestContext) -> None:
        outcome, routed = ctx.outcome, ctx.routed
        if outcome is None or routed is None or (not routed.pool.config.elastic and not outcome.migrations):
            return
        moved = outcome.migrations - outcome.preempted  # a preemption's continuation is flow control's
        ctx.record.migrations = moved
        if self.metrics is not None:
            for _ in range(moved):
                self.metrics.observe_migration(routed.pool.name, "migrated")
            if outcome.broken:
                self.metrics.observe_migration(routed.pool.name, "failed")

    def finished(self, ctx: RequestContext) -> None:
        record, routed = ctx.record, ctx.routed
        if routed is None or not routed.pool.config.elastic or record.status != "ok":
            return
        tpot_ms = record.tpot_s * 1000.0 if record.tpot_s else None
        batch = max(routed.endpoint.stats.running, 1)
        self.autoscaler.finished(
            routed.pool.name, record.prompt_tokens, record.cached_tokens, record.completion_tokens, tpot_ms, batch
        )
