"""The baseline routers a pool may use instead of the scoring pipeline (`router:` in its config), and
that every cache-aware router is measured against.

`round-robin` keeps one rotating cursor per pool and ignores load and prefixes entirely, which is what
`vllm-router --policy round_robin` and most L4 load balancers do. `least-inflight`, the simplest
load-aware router, takes the ready endpoint with the fewest in-flight requests (ties rotate): the
"least-load" baseline."""

from __future__ import annotations

from collections.abc import Collection

from backends.fleet import Pool
from policies.routing.types import REASON_LOAD, REASON_ONLY, RouteDecision, RouteRequest


class RoundRobinRouter:
    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = pool.servable(exclude)
        if not candidates:
            return None
        turn = self._turn.get(pool.name, 0)
        self._turn[pool.name] = turn + 1
        chosen = candidates[turn % len(candidates)]
        return RouteDecision(
            endpoint=chosen, reason=REASON_LOAD if len(candidates) > 1 else REASON_ONLY, decided_at_s=now_s
        )

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None


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
