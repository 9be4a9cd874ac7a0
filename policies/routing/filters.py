"""Filters: each removes the candidates that must not serve a request, before any scorer runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from backends.types import Endpoint
from policies.routing.scorers import work_tokens
from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextLengthFilter:
    """Drops endpoints whose context window cannot hold the prompt plus the requested output.

        keep iff max_model_len is unknown or prompt_tokens + max_tokens <= max_model_len

    A pool of mixed windows (e.g. 32k and 128k replicas) sends long prompts only where they fit,
    instead of to an engine that answers 400. Reads: `Endpoint.max_model_len`, `RequestFacts.max_tokens`.
    """

    consumes = ("endpoint.max_model_len",)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        needed = ctx.prompt_tokens + (ctx.facts.max_tokens or 0)
        return [c for c in candidates if c.endpoint.max_model_len is None or needed <= c.endpoint.max_model_len]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadGateFilter:
    """Drops candidates far busier than the least busy one, whatever their prefix or session offers.

    With `load` = in-flight requests (`metric: requests`) or pending work tokens (`metric: tokens`,
    uncached prefill + `decode_weight` x decode context), a candidate is over the gate when

        load - load_min > abs_threshold   and   load > rel_threshold * load_min

    (SGLang's balance test, per candidate and in the gateway's exact counters). This is the hot-spot
    guard: requests sharing a prefix go to its holder until the holder crosses the gate, then spread;
    identical concurrent prompts cannot all land on one replica. Saturated candidates are judged on
    the same counters. Reads: `InFlight`.
    """

    metric: Literal["requests", "tokens"] = "requests"
    abs_threshold: float = 8.0
    rel_threshold: float = 1.5
    decode_weight: float = 0.1
    consumes = ("inflight",)

    def __post_init__(self) -> None:
        if self.abs_threshold < 0 or self.rel_threshold < 1.0:
            raise ValueError("abs_threshold must be >= 0 and rel_threshold >= 1")

    def load(self, endpoint: Endpoint) -> float:
        if self.metric == "requests":
            return float(endpoint.inflight.requests)
        return work_tokens(endpoint, self.decode_weight)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        loads = [self.load(c.endpoint) for c in candidates]
        low = min(loads)
        return [
            c
            for c, x in zip(candidates, loads, strict=True)
            if not (x - low > self.abs_threshold and x > self.rel_threshold * low)
        ]
