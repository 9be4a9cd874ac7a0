from __future__ import annotations

import pytest

from backends.types import EndpointStats
from predictor.service import PrefillRateTracker
from tests.predictor.synthetic import endpoint


def _scrape(tracker: PrefillRateTracker, at_s: float, queries: float, hits: float = 0.0) -> float:
    ep = endpoint(0)
    ep.stats = EndpointStats(scraped_at_s=at_s, prefix_cache_queries_tokens=queries, prefix_cache_hits_tokens=hits)
    return tracker.rate_tps(ep)


def test_rate_of_uncached_prompt_tokens() -> None:
    tracker = PrefillRateTracker(time_constant_s=5.0)
    assert _scrape(tracker, 10.0, 1000) == 0.0  # first sight: no interval yet
    assert _scrape(tracker, 11.0, 3000, hits=500) == pytest.approx(1500.0)  # (2000 - 500) / 1 s
    assert _scrape(tracker, 11.0, 9999) == pytest.approx(1500.0)  # same scrape: unchanged
    settled = 0.0
    for i in range(1, 200):  # a steady 4000 tokens/s, no hits
        settled = _scrape(tracker, 11.0 + 0.25 * i, 3000 + 1000 * i, hits=500)
    assert settled == pytest.approx(4000.0, rel=1e-3)


def test_a_counter_reset_restarts_the_estimate() -> None:
    tracker = PrefillRateTracker()
    _scrape(tracker, 1.0, 0)
    _scrape(tracker, 2.0, 50_000)
    assert _scrape(tracker, 3.0, 10) == 0.0
    assert _scrape(tracker, 4.0, 1010) == pytest.approx(1000.0)


def test_never_scraped_endpoints_read_zero() -> None:
    tracker = PrefillRateTracker()
    ep = endpoint(1)
    ep.stats = EndpointStats(prefix_cache_queries_tokens=5000)  # scraped_at_s 0: never scraped
    assert tracker.rate_tps(ep) == 0.0
    assert tracker.rate_tps(ep) == 0.0
