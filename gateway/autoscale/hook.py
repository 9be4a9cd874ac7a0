"""Elastic pools in the walk of a request: counted on arrival, learnt from.

- `prepare` (each model of the chain): the request counts towards its pool's token rates (the
  planner's demand, also while the pool is at zero). It never waits: a request for a pool at zero
  is held by the gate's cold-start check (`gateway/autoscale/hold.py`), in the one waiting room.
- `ended`: a stream its replica cut is counted as migrated (it continued on another replica) or
  failed (`tokenway_stream_migrations_total`).
- `finished`: the request's real prompt, cache hits and output teach the pool's mix, its TPOT beside
  the batch it ran in calibrates the capacity model, and the record carries the hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.fleet import Fleet
from gateway.autoscale.hold import ColdStart
from gateway.autoscale.loop import Autoscaler
from gateway.request import Hook, RequestContext
from gateway.telemetry.pools import PoolMetrics


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
