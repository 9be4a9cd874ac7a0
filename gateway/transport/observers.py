"""Observers of the walk's attempts: hooks that watch where a request went, outside the walk, and
feed what they saw back to the metrics, the router and the predictor. None changes the request it
watches; each is plugged in by the app factory (the walk imports none of them).

`RouteMetrics` counts each committed attempt's route (its reason, its pool, the prefix-cache hit the
router expected) and each retry on another endpoint, for the engine transport and the endpoint
picker alike (the app factory plugs it in when metrics are on). Given the router, it also counts the
supply side of each dispatch (`ScoringRouter.supply`: prefill tokens, GPU-seconds and dollars the
cached prefix saved, KV bytes moved per link), and, once the answer's usage is in, the same saving
by the engine's own count of cached prompt tokens (`ScoringRouter.engine_supply`).

`ToolBoundary` tells the router when an agent program's answer ended in tool calls (the relay's
`RelayOutcome.tool_calls`), so that its return after the tool run is kept on that replica
(`policies/routing/tool_affinity.py`); the router learns the gap itself when the return is dispatched.

The predictor's learning
------------------------

`LearningHook`, the predictor's hook: it learns from what the gateway relays.

- dispatched: the serving endpoint's prediction, made before it runs (the router's when it made one,
  else one made now), for streams (the only requests whose TTFT and TPOT the gateway sees) and for
  any request the router predicted anyway;
- first_token: the predictor hears of each first token as it is relayed, not when the request ends,
  so the last second's TTFT errors correct its next predictions (`predictor/service.py`);
- finished: a served request becomes a training sample (features at routing time, the observed TTFT
  and TPOT) and an output-length sample (with the length flow control predicted for it, so that the
  prediction's drift is corrected). A request that waited in a gate (flow control) learns its TTFT
  from dispatch, not arrival: the wait is the gate's, not the engine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.request.context import Hook, RequestContext
from gateway.telemetry.metrics import GatewayMetrics
from policies.routing.pipeline import ScoringRouter
from predictor.features import RequestShape
from predictor.service import LatencyPredictor

# ---- Route metrics and tool boundaries


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

    def finished(self, ctx: RequestContext) -> None:
        """The saving by the engine's own count, once its usage is in the record."""
        record, routed = ctx.record, ctx.routed
        if self.router is None or routed is None or record.usage_source != "engine" or record.cached_tokens <= 0:
            return
        supply = self.router.engine_supply(routed.decision, record.cached_tokens)
        if supply is not None:
            self.metrics.observe_engine_supply(routed.pool.name, supply)


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
        usage = outcome.bounded_usage()
        # the next prompt starts with this one and the answer: that much is expected in the holder's cache
        prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens else facts.prompt_tokens
        output = usage.completion_tokens if usage is not None else outcome.counted_completion_tokens
        self.router.note_tool_call(facts, routed.decision, prompt + output, time.monotonic())


# ---- The predictor's learning


@dataclass(slots=True)
class LearningHook(Hook):
    predictor: LatencyPredictor

    def dispatched(self, ctx: RequestContext) -> None:
        routed = ctx.routed
        assert routed is not None
        decision = routed.decision
        if not ctx.facts.stream and decision.predictions is None:
            ctx.prediction = None  # nothing to learn from, nobody to show it to
            return
        prediction = decision.prediction
        if prediction is None:
            facts = ctx.facts
            shape = RequestShape(facts.prompt_tokens, facts.max_tokens, facts.principal.tenant, ctx.model)
            prediction = self.predictor.predict(
                routed.pool.name,
                shape,
                [decision.endpoint],
                [decision.cached_tokens_estimate],
                lower_cached_tokens=[decision.cached_lower_tokens],
            )[0]
        ctx.prediction = prediction

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        if ctx.prediction is not None and ctx.routed is not None:
            ttft_ms = (at_s - ctx.arrived_s - ctx.gate_wait_s) * 1000.0  # from dispatch
            self.predictor.observe_first_token(ctx.routed.pool.name, ctx.prediction, ttft_ms)

    def finished(self, ctx: RequestContext) -> None:
        record, prediction, outcome = ctx.record, ctx.prediction, ctx.outcome
        waited_ms = ctx.gate_wait_s * 1000.0
        if prediction is not None:
            record.predicted_ttft_ms = prediction.ttft_ms + waited_ms  # as the client sees it
            record.predicted_tpot_ms = prediction.tpot_ms
        if outcome is None or outcome.aborted or outcome.broken:
            return
        facts = ctx.facts
        if record.usage_source == "engine" and facts.api != "embeddings":
            self.predictor.observe_output(
                facts.principal.tenant, ctx.model, record.completion_tokens, ctx.output_prediction
            )
        if prediction is None or record.ttft_s is None:
            return
        tpot_ms = record.tpot_s * 1000 if record.tpot_s is not None else None
        ttft_ms = max(record.ttft_s * 1000 - waited_ms, 0.0)
        self.predictor.observe(record.pool, prediction.features, ttft_ms, tpot_ms, predicted=prediction)
