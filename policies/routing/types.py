"""Routing vocabulary: the router contract the gateway calls, and the decision it gets back.

A router is synchronous and side-effect free in `route` (a pure function of request facts, the
pool's endpoints as they are now, and its own configuration); `on_dispatch` records what was sent
where (prefix-index insertions, session pins) once the gateway has committed to the decision.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from backends.fleet import Pool
from backends.types import Endpoint
from policies.types import RequestFacts


@dataclass(slots=True)
class RouteDecision:
    endpoint: Endpoint  # serves the request (the decode endpoint in a disaggregated pool)
    reason: str  # metrics label: prefix-hit | load | session | only | fallback | pd
    prefill_endpoint: Endpoint | None = None  # set when the request is disaggregated
    cached_tokens_estimate: int = 0  # prompt tokens expected to hit the prefix cache on `endpoint`
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # endpoint id -> scorer -> score

    def debug_header(self) -> str:
        """Compact `x-tokenway-route` value: reason and per-endpoint scores."""
        parts = [f"reason={self.reason}", f"endpoint={self.endpoint.id}"]
        if self.prefill_endpoint is not None:
            parts.append(f"prefill={self.prefill_endpoint.id}")
        for endpoint_id, by_scorer in self.scores.items():
            inner = ",".join(f"{k}:{v:.3f}" for k, v in by_scorer.items())
            parts.append(f"{endpoint_id}=[{inner}]")
        return "; ".join(parts)


class Router(Protocol):
    def route(
        self, facts: RequestFacts, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        """Choose an endpoint among the pool's ready ones not in `exclude`; None when there is none."""
        ...

    def on_dispatch(self, facts: RequestFacts, decision: RouteDecision) -> None:
        """The gateway sent the request as decided: update indexes and affinities."""
        ...
