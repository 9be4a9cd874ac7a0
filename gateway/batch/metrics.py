"""The batch runner's series, in the gateway's registry.

A batch line's request is also an ordinary request of the walk: it is in `tokenway_requests_total`,
the token and cost counters and the GenAI histograms like any other (its ledger record names the
batch). These add what only the runner knows:

- `tokenway_batch_lines_total{outcome}`: lines recorded — `ok` (output file), `error` (error file),
  `duplicate` (a second answer for a line already recorded, dropped);
- `tokenway_batch_deferrals_total{reason}`: lines given back to run later — `no_spare_capacity` (the
  runner found no room), `batch_no_spare_capacity` (the walk's batch gate found none at routing),
  `backing_off` (a scheduling pass skipped a batch whose models are backing off after refusals),
  `rate_limit_exceeded`, `insufficient_quota`, `upstream_error`, `http_503`, ... (`other` beyond those);
- `tokenway_batch_lines_in_flight`, `tokenway_batches{status}` (unfinished batches, as of the
  runner's last tick).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from gateway.telemetry.families import CounterFamily, FamiliesCollector

_REASONS: Final = frozenset(
    {
        "no_spare_capacity",
        "batch_no_spare_capacity",
        "backing_off",
        "rate_limit_exceeded",
        "insufficient_quota",
        "upstream_error",
        "no_healthy_backend",
        "slo_unattainable",
        "queue_full",
        "queue_timeout",
        "http_429",
        "http_503",
        "http_408",
    }
)


class _Gauges:
    def __init__(self, in_flight: Callable[[], int], statuses: Callable[[], Mapping[str, int]]) -> None:
        self.in_flight = in_flight
        self.statuses = statuses

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "tokenway_batch_lines_in_flight", "batch lines running in this process", value=float(self.in_flight())
        )
        family = GaugeMetricFamily("tokenway_batches", "unfinished batches by status", labels=("status",))
        for status, count in sorted(self.statuses().items()):
            family.add_metric((status,), float(count))
        yield family

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily("tokenway_batch_lines_in_flight", ""),
            GaugeMetricFamily("tokenway_batches", "", labels=("status",)),
        ]


class BatchMetrics:
    def __init__(self) -> None:
        self.lines = CounterFamily(
            "tokenway_batch_lines_total", "batch lines recorded, by outcome (ok, error, duplicate)", ("outcome",)
        )
        self.deferrals = CounterFamily(
            "tokenway_batch_deferrals_total", "batch lines given back to run later, by reason", ("reason",)
        )

    def register(
        self, registry: CollectorRegistry, in_flight: Callable[[], int], statuses: Callable[[], Mapping[str, int]]
    ) -> None:
        registry.register(FamiliesCollector([self.lines, self.deferrals]))
        registry.register(_Gauges(in_flight, statuses))

    def line(self, outcome: str) -> None:
        self.lines.child(outcome).inc()

    def deferred(self, reason: str) -> None:
        self.deferrals.child(reason if reason in _REASONS else "other").inc()
