"""Observers of the walk's attempts: hooks that watch where a request went, outside the walk.

`RouteMetrics` counts each committed attempt's route (its reason, its pool, the prefix-cache hit the
router expected) and each retry on another endpoint, for the engine transport and the endpoint
picker alike (the app factory plugs it in when metrics are on). Given the router, it also counts the
supply side of each dispatch (`ScoringRouter.supply`: prefill tokens, GPU-seconds and dollars the
cached prefix saved, KV bytes moved per link).

`ToolBoundary` tells the router when an agent program's answer ended in tool calls (the relay's
`RelayOutcome.tool_calls`), so that its return after the tool run is kept on that replica
(`policies/routing/tool_affinity.py`); the router learns the gap itself when the return is dispatched.
"""

from __future__ import annotations

import time

from gateway.request.context import RequestContext
from gateway.request.hooks import Hook
from gateway.telemetry.metrics import GatewayMetrics
from policies.routing.pipeline import ScoringRouter


class RouteMetrics(Hook):
    def __init__(self, metrics: GatewayMetrics, router: ScoringRouter | None = None) -> None:
        self.metrics = metrics
        self.router = router

    def dispatched(self, ctx: RequestContext) -> None:
        routed = ctx.routed
        assert routed is not None
        decision, pool = routed.decision, routed.pool.name
        self.metrics.observe_route(
            decision.reason,
            pool,
            prompt_tokens=ctx.facts.prompt_tokens,
            estimated_hit_tokens=decision.cached_tokens_estimate,
            tier_tokens=decision.cached_tiers.as_tuple() if decision.cached_tiers is not None else (),
        )
        prompt_tokens = ctx.facts.prompt_tokens
        if self.router is not None and prompt_tokens:
            supply = self.router.supply(decision, prompt_tokens)
            if supply is not None:
                self.metrics.observe_supply(pool, supply)
        if ctx.record.upstream_attempts > 1:  # commit counted this one: it follows a failed one
            self.metrics.observe_retry(pool)


class ToolBoundary(Hook):
    """An answer that ended in tool calls (whole, not aborted or cut) notes its program's return."""

    def __init__(self, router: ScoringRouter) -> None:
        self.router = router

    def ended(self, ctx: RequestContext) -> None:
        outcome, routed = ctx.outcome, ctx.routed
        if outcome is None or routed is None or not outcome.tool_calls or outcome.aborted or outcome.broken:
            return
        facts = ctx.facts
        if facts.subjects.program is None:
            return
        usage = outcome.usage
        # the next prompt starts with this one and the answer: that much is expected in the holder's cache
        prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens else facts.prompt_tokens
        output = usage.completion_tokens if usage is not None else outcome.counted_completion_tokens
        self.router.note_tool_call(facts, routed.decision, prompt + output, time.monotonic())
