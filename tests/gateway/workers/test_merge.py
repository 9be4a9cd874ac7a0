"""The group's /metrics: counters and histograms of every worker summed, gauges kept per worker
(gateway/workers/metrics.py), and the merged text is a valid exposition that round-trips."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.workers.metrics import merge_expositions


def _worker(requests: float, latencies: list[float], inflight: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("tw_requests", "requests", ["status"], registry=registry)
    counter.labels("ok").inc(requests)
    hist = Histogram("tw_latency_seconds", "latency", buckets=(0.1, 1.0), registry=registry)
    for value in latencies:
        hist.observe(value)
    Gauge("tw_inflight", "in flight", registry=registry).set(inflight)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_histograms_add_up_gauges_stay_per_worker() -> None:
    merged = _samples(merge_expositions([(0, _worker(3, [0.05], 2)), (1, _worker(4, [0.5, 2.0], 5))], 2).decode())
    assert merged[("tw_requests_total", (("status", "ok"),))] == 7
    assert merged[("tw_latency_seconds_count", ())] == 3
    assert merged[("tw_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("tw_latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("tw_latency_seconds_bucket", (("le", "+Inf"),))] == 3
    assert abs(merged[("tw_latency_seconds_sum", ())] - 2.55) < 1e-9
    assert merged[("tw_inflight", (("worker", "0"),))] == 2
    assert merged[("tw_inflight", (("worker", "1"),))] == 5
    assert ("tw_inflight", ()) not in merged
    assert merged[("tokenway_workers", ())] == 2
    assert merged[("tokenway_workers_scraped", ())] == 2


def test_created_is_the_earliest_and_a_missing_worker_is_counted() -> None:
    text = "# HELP c_total c\n# TYPE c_total counter\nc_total 1.0\nc_created 200.0\n"
    later = text.replace("200.0", "300.0")
    merged = _samples(merge_expositions([(0, later), (2, text)], 3).decode())
    assert merged[("c_total", ())] == 2
    assert merged[("c_created", ())] == 200
    assert merged[("tokenway_workers", ())] == 3
    assert merged[("tokenway_workers_scraped", ())] == 2


def test_a_worker_with_metrics_off_adds_nothing() -> None:
    merged = _samples(merge_expositions([(0, _worker(1, [], 0)), (1, "")], 2).decode())
    assert merged[("tw_requests_total", (("status", "ok"),))] == 1
