"""The lean families must expose exactly what prometheus_client's own metrics would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.telemetry.families import CounterFamily, FamiliesCollector, HistogramFamily

BUCKETS = (0.1, 0.5, 1.0, 5.0)
VALUES = (0.05, 0.1, 0.3, 0.5, 0.7, 1.0, 2.0, 9.0, 0.0)


def test_histogram_and_counter_render_like_prometheus_client() -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    hist = HistogramFamily("lat_seconds", "latency", ("route",), BUCKETS)
    count = CounterFamily("hits_total", "hits", ("route",))
    ours.register(FamiliesCollector([hist, count]))
    ref_hist = Histogram("lat_seconds", "latency", ["route"], buckets=BUCKETS, registry=reference)
    ref_count = Counter("hits_total", "hits", ["route"], registry=reference)
    for v in VALUES:
        hist.child("a").observe(v)
        ref_hist.labels("a").observe(v)
        count.child("a").inc(2)
        ref_count.labels("a").inc(2)

    def samples(registry: CollectorRegistry) -> list[str]:
        # prometheus_client adds *_created series to its own metrics; ours have none.
        return sorted(
            line
            for line in generate_latest(registry).decode().splitlines()
            if line and not line.startswith("#") and "_created" not in line
        )

    assert samples(ours) == samples(reference)


def test_child_rejects_a_wrong_label_count() -> None:
    family = CounterFamily("x_total", "x", ("a", "b"))
    with pytest.raises(ValueError, match="expected labels"):
        family.child("only-one")
