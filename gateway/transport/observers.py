"""Observers of the walk's attempts: hooks that watch where a request went, outside the walk.

`RouteMetrics` counts each committed attempt's route (its reason, its pool, the prefix-cache hit the
router expected) and each retry on another endpoint, for the engine transport and the endpoint
picker alike (the app factory plugs it in when metrics are on).
"""

from __future__ import annotations

from gateway.request.context import RequestContext
from gateway.request.hooks import Hook
from gateway.telemetry.metrics import GatewayMetrics


class RouteMetrics(Hook):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def dispatched(self, ctx: RequestContext) -> None:
        routed = ctx.routed
        assert routed is not None
        decision, pool = routed.decision, routed.pool.name
        self.metrics.observe_route(
            decision.reason,
            pool,
            prompt_tokens=ctx.facts.prompt_tokens,
            estimated_hit_tokens=decision.cached_tokens_estimate,
        )
        if ctx.record.upstream_attempts > 1:  # commit counted this one: it follows a failed one
            self.metrics.observe_retry(pool)
