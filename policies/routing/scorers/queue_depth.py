"""`queue-depth` scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueDepthScorer:
    """Engine-reported waiting requests, relative to the shortest queue among the candidates.

        score = (q_min + s) / (q + s)       q = EndpointStats.waiting, s = smoothing_requests

    Range (0, 1]: the shortest queue scores 1, twice the work scores about 1/2; all equal -> 1.
    A ratio rather than llm-d's min-max: queues of 0 and 1 are not "best" and "worst". Saturated
    (stale) candidates score 0. Reads: `EndpointStats.waiting`. It sees load from every client of the
    engine (other gateway replicas included), which the gateway's own counters cannot.
    """

    smoothing_requests: float = 1.0
    consumes = ("stats.waiting",)

    def __post_init__(self) -> None:
        if self.smoothing_requests <= 0:
            raise ValueError("smoothing_requests must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        s = self.smoothing_requests
        fresh = [c.endpoint.stats.waiting for c in candidates if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + s
        return [0.0 if c.saturated else best / (c.endpoint.stats.waiting + s) for c in candidates]
