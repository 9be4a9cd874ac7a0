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


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAffinityFilter:
    """Sticky until saturated: keep only the cache-warm candidates, unless waiting behind their
    prefill backlog would cost more than `max_ttft_penalty_s` over the best cold candidate.

        warm     = {c : cached_tokens(c) >= threshold x prompt_tokens}
        keep all  if warm is empty, or every candidate is warm, or
                  (min_warm prefill_tokens - min_cold prefill_tokens) / peak_prefill_tokens_per_s
                      > max_ttft_penalty_s
        keep warm otherwise

    `prefill_tokens` is the gateway's count of uncached prompt tokens in flight on the endpoint
    (released at the first token), so the backlog gap over `peak_prefill_tokens_per_s` is the extra
    wait a warm endpoint imposes; the release fires at a gap of tau = peak x penalty tokens.

    Why it exists: llm-d's default for prefill-bound traffic (its `prefix-cache-affinity-filter`,
    with defaults 0.8, 18 s, 15,928 tok/s; followed by `token-load-scorer` and `max-score-picker`,
    which here is `work-cost` with `decode_weight: 0, request_tokens: 0` and `max-score`), kept so the
    replay benchmark can compare tokenway's default against it (bench/replay/NOTES.md). Unlike
    `load-gate`, the warm set is decided by prefix share alone and only a gap of seconds of prefill
    releases it. Reads: `Candidate.cached_tokens`, `InFlight.prefill_tokens`.
    """

    threshold: float = 0.8
    max_ttft_penalty_s: float = 18.0
    peak_prefill_tokens_per_s: float = 15_928.0
    consumes = ("prefix-index", "inflight.prefill_tokens")

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if self.max_ttft_penalty_s < 0 or self.peak_prefill_tokens_per_s <= 0:
            raise ValueError("max_ttft_penalty_s must be >= 0 and peak_prefill_tokens_per_s > 0")

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1 or ctx.prompt_tokens <= 0:
            return list(candidates)
        need = self.threshold * ctx.prompt_tokens
        warm = [c for c in candidates if c.cached_tokens >= need]
        cold = [c for c in candidates if c.cached_tokens < need]
        if not warm or not cold:
            return list(candidates)
        if self.max_ttft_penalty_s > 0:
            gap = min(c.endpoint.inflight.prefill_tokens for c in warm) - min(
                c.endpoint.inflight.prefill_tokens for c in cold
            )
            if gap / self.peak_prefill_tokens_per_s > self.max_ttft_penalty_s:
                return list(candidates)
        return warm
