"""Recent prefill load per endpoint, from the engine's own cumulative prefix-cache counters.

Why: a request's TPOT is set less by the batch it joins than by the prompts that arrive while it
decodes (every step that carries a prefill chunk is longer, and pays the prefill overhead). The
instantaneous state (running, waiting, in-flight tokens) lags that; the recent rate of uncached
prompt tokens an engine admitted does not. vLLM counts every admitted prompt in
`vllm:prefix_cache_queries` and its cached part in `vllm:prefix_cache_hits` (tokens, cumulative), so
queries - hits is the uncached prompt work, counted by the engine itself: it includes traffic from
other gateway replicas, which gateway-side accounting would miss.

The rate is an exponentially weighted average over scrapes with time constant `time_constant_s`,
updated lazily when `rate_tps` sees a newer scrape; a counter that goes down (engine restart)
restarts the estimate. Endpoints that report no counters (remote APIs) read 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.types import Endpoint


@dataclass(slots=True)
class _EndpointRate:
    scraped_at_s: float
    uncached_tokens: float
    rate_tps: float = 0.0
    warm: bool = False  # at least one interval seen


class PrefillRateTracker:
    """Uncached prompt tokens per second each endpoint admitted recently (module docstring)."""

    def __init__(self, time_constant_s: float = 5.0, max_endpoints: int = 10_000) -> None:
        self.time_constant_s = time_constant_s
        self.max_endpoints = max_endpoints
        self._by_endpoint: dict[str, _EndpointRate] = {}

    def rate_tps(self, endpoint: Endpoint) -> float:
        stats = endpoint.stats
        scraped_at_s = stats.scraped_at_s
        if not scraped_at_s:
            return 0.0
        uncached = stats.prefix_cache_queries_tokens - stats.prefix_cache_hits_tokens
        state = self._by_endpoint.get(endpoint.id)
        if state is None:
            if len(self._by_endpoint) >= self.max_endpoints:
                self._by_endpoint.clear()  # endpoints churned far beyond any fleet: start over
            self._by_endpoint[endpoint.id] = _EndpointRate(scraped_at_s, uncached)
            return 0.0
        elapsed_s = scraped_at_s - state.scraped_at_s
        if elapsed_s <= 0:
            return state.rate_tps
        delta = uncached - state.uncached_tokens
        state.scraped_at_s = scraped_at_s
        state.uncached_tokens = uncached
        if delta < 0:  # counters reset: the engine restarted
            state.rate_tps, state.warm = 0.0, False
            return 0.0
        instant = delta / elapsed_s
        if state.warm:
            weight = 1.0 - math.exp(-elapsed_s / self.time_constant_s)
            state.rate_tps += weight * (instant - state.rate_tps)
        else:
            state.rate_tps, state.warm = instant, True
        return state.rate_tps
