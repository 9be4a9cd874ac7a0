"""`latency` scorer (predicted-latency routing, llm-d's `latency-scorer`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.routing.predictions import PREDICTIONS_ATTR
from policies.routing.types import Candidate, RouteContext
from policies.slo import RUNNING_TPOT_SLO_ATTR
from predictor.types import Prediction


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyScorer:
    """Predicted headroom against the request's SLO, protecting the TPOT of requests already running.

    Per candidate, targets T_ttft = facts.slo_ttft_ms and T_tpot = min(facts.slo_tpot_ms, the
    tightest TPOT SLO running on the endpoint); q = the predicted p90 (the quantity the SLO gate
    compares, see policies/slo.py). For each target that is set:

        slack_k = (T_k - q_k) / T_k                     (<= 1; negative = predicted to miss)
        meets   -> score = 0.5 + 0.5 * sum_k w_k slack_k / sum_k w_k             in [0.5, 1]
        misses  -> score = 0.5 / (1 + sum_k w_k max(0, -slack_k) / sum_k w_k)     in (0, 0.5)

    so every endpoint that meets the SLO outranks every one that does not, and among them the one
    with the most headroom wins (spreading load keeps the next request's headroom too; llm-d's
    `most`). Without any target (no SLO, nothing protected) it ranks by predicted mean latency:

        score = (w_ttft (t_min + s) / (t + s) + w_tpot (u_min + s) / (u + s)) / (w_ttft + w_tpot)

    with t, u the predicted mean TTFT and TPOT and s = `smoothing_ms`. Weights default to llm-d's
    TTFT 0.8 / TPOT 0.2. Range [0, 1]; saturated (stale) candidates score 0; with no predictions
    (predictor disabled) every candidate scores 1, leaving the decision to the other scorers.

    Reads: `facts.attrs[PREDICTIONS_ATTR]` (made by the router in one batched call for all
    candidates, see routing/predictions.py), `facts.slo_ttft_ms`/`slo_tpot_ms`, and the gateway's
    `facts.attrs[RUNNING_TPOT_SLO_ATTR]`.

    Not in the default pipeline: on the simulated fleet (bench/results/predictor.md) the default
    work-cost pipeline already ranks endpoints by the same backlog the predictor sees, and the gain
    comes from the SLO gate, which uses the predictions whether or not this scorer is configured.
    Add it with weight 2-3 where SLO headroom, rather than least work, should pick the endpoint.
    """

    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    smoothing_ms: float = 5.0
    consumes = ("predictions", "slo", "running-tpot-slo")

    def __post_init__(self) -> None:
        if self.ttft_weight < 0 or self.tpot_weight < 0 or self.ttft_weight + self.tpot_weight <= 0:
            raise ValueError("ttft_weight and tpot_weight must be >= 0, not both 0")
        if self.smoothing_ms <= 0:
            raise ValueError("smoothing_ms must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        facts = ctx.facts
        predictions: Mapping[str, Prediction] | None = facts.attrs.get(PREDICTIONS_ATTR)
        if not predictions:
            return [1.0] * len(candidates)
        floors: Mapping[str, float] = facts.attrs.get(RUNNING_TPOT_SLO_ATTR) or {}
        found = [None if c.saturated else predictions.get(c.id) for c in candidates]
        targeted = facts.slo_ttft_ms is not None or facts.slo_tpot_ms is not None
        if targeted or any(c.id in floors for c in candidates):
            return [
                0.0 if p is None else self._headroom(p, facts.slo_ttft_ms, _min(facts.slo_tpot_ms, floors.get(c.id)))
                for c, p in zip(candidates, found, strict=True)
            ]
        return self._relative(found)

    def _headroom(self, p: Prediction, ttft_ms: float | None, tpot_ms: float | None) -> float:
        weight = slack = excess = 0.0
        if ttft_ms is not None:
            s = (ttft_ms - p.ttft_p90_ms) / ttft_ms
            weight += self.ttft_weight
            slack += self.ttft_weight * s
            excess += self.ttft_weight * max(0.0, -s)
        if tpot_ms is not None:
            s = (tpot_ms - p.tpot_p90_ms) / tpot_ms
            weight += self.tpot_weight
            slack += self.tpot_weight * s
            excess += self.tpot_weight * max(0.0, -s)
        if weight <= 0:  # the only target set has weight 0: no opinion
            return 1.0
        if excess > 0:
            return 0.5 / (1.0 + excess / weight)
        return 0.5 + 0.5 * slack / weight

    def _relative(self, found: Sequence[Prediction | None]) -> list[float]:
        fresh = [p for p in found if p is not None]
        if not fresh:
            return [0.0] * len(found)
        s = self.smoothing_ms
        best_ttft = min(p.ttft_ms for p in fresh) + s
        best_tpot = min(p.tpot_ms for p in fresh) + s
        total = self.ttft_weight + self.tpot_weight
        return [
            0.0
            if p is None
            else (self.ttft_weight * best_ttft / (p.ttft_ms + s) + self.tpot_weight * best_tpot / (p.tpot_ms + s))
            / total
            for p in found
        ]


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
