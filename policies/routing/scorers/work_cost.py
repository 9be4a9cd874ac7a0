"""`work-cost` scorer (Dynamo-style cost in units of work)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.load import work_tokens
from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkCostScorer:
    """How much work stands between this request and its first token on the endpoint.

        cost  = inflight.prefill_tokens                 (uncached prefill queued ahead of it)
              + (prompt_tokens - cached_tokens)          (its own uncached prefill)
              + decode_weight  * inflight.decode_tokens  (decode context sharing every step)
              + request_tokens * inflight.requests       (requests whose decode is not counted yet)
        score = (cost_min + base_tokens) / (cost + base_tokens)

    Range (0, 1]: the cheapest candidate scores 1, one with twice the work about 1/2. This is the
    trade-off the router exists for: a prefix hit saves `cached_tokens` of work, a busy endpoint
    costs its backlog, and the cheaper sum wins. `base_tokens` keeps an idle fleet from turning
    small differences into large ratios. Saturated (stale) candidates score 0.
    Reads: `InFlight` (gateway accounting), `Candidate.cached_tokens`, `RouteContext.prompt_tokens`.
    """

    decode_weight: float = 0.1
    request_tokens: float = 128.0
    base_tokens: float = 512.0
    consumes = ("inflight", "prefix-index")

    def __post_init__(self) -> None:
        if self.base_tokens <= 0:
            raise ValueError("base_tokens must be > 0")
        if self.decode_weight < 0 or self.request_tokens < 0:
            raise ValueError("decode_weight and request_tokens must be >= 0")

    def costs(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        return [
            work_tokens(c.endpoint, self.decode_weight, self.request_tokens) + ctx.uncached_tokens(c)
            for c in candidates
        ]

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        costs = self.costs(ctx, candidates)
        fresh = [x for x, c in zip(costs, candidates, strict=True) if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + self.base_tokens
        return [0.0 if c.saturated else best / (x + self.base_tokens) for x, c in zip(costs, candidates, strict=True)]
