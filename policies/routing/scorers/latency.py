"""`latency` scorer (predicted-latency routing, llm-d's `latency-scorer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext
from predictor.types import Prediction


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyScorer:
    """Predicted latency, SLO first: every endpoint predicted to meet the request's SLO outranks every
    one predicted to miss it, and the fastest predicted wins within each tier.

    Per candidate, targets T_ttft = facts.slo_ttft_ms and T_tpot = min(facts.slo_tpot_ms, the
    tightest TPOT SLO running on the endpoint), compared with the predicted p90 q. With t, u the
    predicted mean TTFT and TPOT and s = `smoothing_ms`, the relative latency

        rel = (w_ttft (t_min + s) / (t + s) + w_tpot (u_min + s) / (u + s)) / (w_ttft + w_tpot)

    (1 for the fastest fresh candidate) scores

        no target set (no SLO, nothing protected)   rel                                      in (0, 1]
        meets every target (q_k <= T_k)            0.5 + 0.5 rel                            in (0.5, 1]
        misses one                                 0.5 / (1 + sum_k w_k max(0, q_k / T_k - 1) / sum_k w_k)

    Why relative latency inside the tier and not headroom (T - q) / T, llm-d's "most headroom": at
    a loose SLO nearly every endpoint meets it, and headroom then barely tells a 100 ms endpoint from
    a 500 ms one (slack 0.9 vs 0.5 of a 1 s objective), while their relative latency is 1 vs 0.2. On
    the simulated fleet at 90 % load with the SLO gate (bench/results/predictor-tight.md,
    predictor-tight-ablation.md, predictor-scorer-tight.md; one run each): attainment 90.8 % with
    the headroom ranking, 92.1 % with the gate and no scorer, 94.6 % with this one (82.9 % with
    neither). Weights default to llm-d's TTFT 0.8 / TPOT 0.2. Range [0, 1]: saturated (stale) candidates score 0;
    with no predictions (predictor disabled) every candidate scores 1, leaving the decision to the
    other scorers.

    Reads: `ctx.predictions` (made by the router in one batched call for all candidates, see
    routing/predictions.py), `facts.slo_ttft_ms`/`slo_tpot_ms`, and `ctx.running_tpot_slo_ms`
    (kept by the gateway's SLO hook).

    Not in the default pipeline yet: alone (no SLO class) it lifted attainment at 90 % load from
    82.9 % to 88.0 % at the tight SLO and from 92.2 % to 96.8 % at the loose one (78.0 % to 87.2 %
    measured later in the window, where a queue builds; one run each), but
    the routing benchmark (bench/results/replay.md, prefix-heavy traffic, where work-cost and prefix
    scoring decide) has not been run with it. Add it with weight 2-3 where predicted latency, rather
    than least work, should pick the endpoint.
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
        predictions = ctx.predictions
        if not predictions:
            return [1.0] * len(candidates)
        floors = ctx.running_tpot_slo_ms
        found = [None if c.saturated else predictions.get(c.id) for c in candidates]
        relative = self._relative(found)
        targeted = facts.slo_ttft_ms is not None or facts.slo_tpot_ms is not None
        if not targeted and not any(c.id in floors for c in candidates):
            return relative
        return [
            0.0 if p is None else self._tiered(p, rel, facts.slo_ttft_ms, _min(facts.slo_tpot_ms, floors.get(c.id)))
            for c, p, rel in zip(candidates, found, relative, strict=True)
        ]

    def _tiered(self, p: Prediction, relative: float, ttft_ms: float | None, tpot_ms: float | None) -> float:
        weight = excess = 0.0
        if ttft_ms is not None:
            weight += self.ttft_weight
            excess += self.ttft_weight * max(0.0, p.ttft_p90_ms / ttft_ms - 1.0)
        if tpot_ms is not None:
            weight += self.tpot_weight
            excess += self.tpot_weight * max(0.0, p.tpot_p90_ms / tpot_ms - 1.0)
        if weight <= 0:  # the only target set has weight 0: latency alone
            return relative
        if excess > 0:
            return 0.5 / (1.0 + excess / weight)
        return 0.5 + 0.5 * relative

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
