"""The one call that makes a request's latency predictions while it is routed.

When the router has a predictor and the request needs predictions (its pool's pipeline has the
`latency` scorer, or the request carries an SLO for the gateway's SLO gate), `ScoringRouter.route`
predicts every candidate in one batched call before the pipeline runs: the latency scorer reads them
in `RouteContext.predictions`, the decision carries them (`RouteDecision.predictions`) to the SLO
gate, and the gateway reuses the serving endpoint's prediction as the training sample's features
instead of predicting twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.types import Candidate, RouteContext
from predictor.service import LatencyPredictor
from predictor.types import Prediction, RequestShape


def predict_candidates(
    predictor: LatencyPredictor, pool: str, model: str, ctx: RouteContext, candidates: Sequence[Candidate]
) -> dict[str, Prediction]:
    """Every candidate's prediction (one batched `predict`), by endpoint id."""
    facts = ctx.facts
    shape = RequestShape(ctx.prompt_tokens, facts.max_tokens, facts.principal.tenant, model)
    endpoints = [c.endpoint for c in candidates]
    made = predictor.predict(pool, shape, endpoints, [c.cached_tokens for c in candidates], ctx.now_s)
    return {p.endpoint_id: p for p in made}
