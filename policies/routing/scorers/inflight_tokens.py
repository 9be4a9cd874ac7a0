"""`inflight-tokens` scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightTokensScorer:
    """Tokens the gateway has in flight on the endpoint, relative to the least loaded candidate.

        x = inflight.prefill_tokens + inflight.decode_tokens
        score = (x_min + r) / (x + r)        r = ref_tokens

    Range (0, 1]: the least loaded scores 1; `ref_tokens` keeps small absolute differences (an
    idle fleet) from looking large. Saturated (stale) candidates score 0. Reads: `InFlight` (uncached
    prefill pending + decode context), the gateway's exact, instant accounting.
    """

    ref_tokens: float = 2048.0
    consumes = ("inflight.prefill_tokens", "inflight.decode_tokens")

    def __post_init__(self) -> None:
        if self.ref_tokens <= 0:
            raise ValueError("ref_tokens must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        loads = [c.endpoint.inflight.prefill_tokens + c.endpoint.inflight.decode_tokens for c in candidates]
        fresh = [x for x, c in zip(loads, candidates, strict=True) if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + self.ref_tokens
        return [0.0 if c.saturated else best / (x + self.ref_tokens) for x, c in zip(loads, candidates, strict=True)]
