"""The simplest load-aware router: the ready endpoint with the fewest in-flight requests (ties rotate).

It is the "least-load" baseline the scoring pipeline is measured against and the router used when a
pool configures `router: least-inflight`.
"""

from __future__ import annotations

from collections.abc import Collection

from backends.fleet import Pool
from policies.routing.types import REASON_LOAD, REASON_ONLY, RouteDecision, RouteRequest


class LeastInflightRouter:
    def __init__(self) -> None:
        self._turn = 0

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = pool.servable(exclude)
        if not candidates:
            return None
        self._turn += 1
        n = len(candidates)
        best = min(range(n), key=lambda i: (candidates[i].inflight.requests, (i - self._turn) % n))
        return RouteDecision(
            endpoint=candidates[best], reason=REASON_LOAD if n > 1 else REASON_ONLY, decided_at_s=now_s
        )

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None
