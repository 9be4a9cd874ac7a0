"""The predictor's hook: it learns from what the gateway relays.

- dispatched: the serving endpoint's prediction, made before it runs (the router's when it made one,
  else one made now), for streams (the only requests whose TTFT and TPOT the gateway sees) and for
  any request the router predicted anyway;
- first_token: the predictor hears of each first token as it is relayed, not when the request ends,
  so the last second's TTFT errors correct its next predictions (`predictor/recent.py`);
- finished: a served request becomes a training sample (features at routing time, the observed TTFT
  and TPOT) and an output-length sample (with the length flow control predicted for it, so that the
  prediction's drift is corrected). A request that waited in a gate (flow control) learns its TTFT
  from dispatch, not arrival: the wait is the gate's, not the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.request import Hook, RequestContext
from predictor.service import LatencyPredictor
from predictor.types import RequestShape


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
