"""The simplest router: the ready endpoint with the fewest in-flight requests (ties rotate).

It is the baseline the scoring pipeline is measured against and the router used when a pool
configures `routing: least-inflight`.
"""

from __future__ import annotations

from collections.abc import Collection

from backends.fleet import Pool
from backends.types import EndpointState
from policies.routing.types import RouteDecision
from policies.types import RequestFacts


class LeastInflightRouter:
    def __init__(self) -> None:
        self._turn = 0

    def route(
        self, facts: RequestFacts, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = [e for e in pool.endpoints if e.state is EndpointState.READY and e.id not in exclude]
        if not candidates:
            return None
        self._turn += 1
        n = len(candidates)
        best = min(range(n), key=lambda i: (candidates[i].inflight.requests, (i - self._turn) % n))
        return RouteDecision(endpoint=candidates[best], reason="load" if n > 1 else "only")

    def on_dispatch(self, facts: RequestFacts, decision: RouteDecision) -> None:
        return None
