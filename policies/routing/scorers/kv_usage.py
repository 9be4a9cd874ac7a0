"""`kv-usage` scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class KvUsageScorer:
    """Free KV-cache room: an endpoint near full preempts (recomputes) running requests.

        score = 1 - kv_usage_ratio

    Range [0, 1] (clamped); saturated (stale) candidates score 0. Reads: `EndpointStats.kv_usage_ratio`
    (vLLM counts evictable cached blocks as free, so a warm cache does not look full).
    """

    consumes = ("stats.kv_usage_ratio",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        return [0.0 if c.saturated else min(max(1.0 - c.endpoint.stats.kv_usage_ratio, 0.0), 1.0) for c in candidates]
