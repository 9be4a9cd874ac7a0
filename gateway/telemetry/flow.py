"""Flow control's series: waiting-room depth, time waited, fair-share ratios, counter staleness.

`tokenway_queue_wait_seconds{pool,band,tenant}` is a lean histogram observed once per request that
went through a waiting room (0 for those that went at once, so its count is every such request);
the gauges are read from the rooms' status at scrape time, so nothing else runs per request. Tenant
and pool labels pass the gateway's label guards: bounded by the configured tenants and pools.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from gateway.telemetry.families import FamiliesCollector, HistogramFamily
from gateway.telemetry.metrics import GatewayMetrics

QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

StatusSource = Callable[[], Mapping[str, Any]]


class FlowMetrics:
    """Registers the flow families on a `GatewayMetrics` registry (and its OTLP export)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._guards = metrics.guards
        self.wait = HistogramFamily(
            "tokenway_queue_wait_seconds",
            "time a request waited in its pool's waiting room (0: it went at once)",
            ("pool", "band", "tenant"),
            QUEUE_WAIT_BUCKETS_S,
            otel_name="tokenway.queue.wait",
            unit="s",
        )
        self._status: StatusSource | None = None
        metrics.registry.register(FamiliesCollector((self.wait,)))
        metrics.registry.register(_FlowGauges(self))
        metrics.families = (*metrics.families, self.wait)

    def observe_wait(self, pool: str, band: str, tenant: str, seconds: float) -> None:
        self.wait.child(self._guards["pool"](pool), band, self._guards["tenant"](tenant)).observe(seconds)

    def set_status(self, source: StatusSource) -> None:
        """`FlowQueue.status` (read at scrape time)."""
        self._status = source

    def gauges(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("tokenway_queue_depth", "requests waiting per pool and band", labels=("pool", "band"))
        share = GaugeMetricFamily(
            "tokenway_fair_share_ratio",
            "a tenant's share of the pool's recent service over its weight's share (1: exactly fair)",
            labels=("pool", "tenant"),
        )
        age = GaugeMetricFamily(
            "tokenway_fair_counters_age_seconds",
            "age of the shared virtual counters this replica orders by (0 in memory)",
            labels=("pool", "band"),
        )
        status = self._status() if self._status is not None else {}
        pool_guard, tenant_guard = self._guards["pool"], self._guards["tenant"]
        for pool, room in (status.get("pools") or {}).items():
            pool_label = pool_guard(pool)
            for band, info in (room.get("bands") or {}).items():
                depth.add_metric((pool_label, band), float(sum(info.get("waiting", {}).values())))
                if info.get("counters_age_s") is not None:
                    age.add_metric((pool_label, band), float(info["counters_age_s"]))
            for tenant, ratio in (room.get("fair_share_ratio") or {}).items():
                share.add_metric((pool_label, tenant_guard(tenant)), float(ratio))
        yield depth
        yield share
        yield age


class _FlowGauges:
    def __init__(self, owner: FlowMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        yield from self._owner.gauges()

    def describe(self) -> list[Metric]:
        return []
