"""Elastic pools' series: replicas by state, the planner's desired count, cold starts, migrations.

`tokenway_pool_replicas{pool,role,state}` and `tokenway_pool_desired_replicas{pool,role}` are read
from the autoscaler's status at scrape time, so a Kubernetes HPA or KEDA can scale engine
Deployments from the same decision; scale events and drain timeouts are counters read the same
way. `tokenway_cold_start_wait_seconds{pool}` is observed once per request held for a replica to
start or wake, `tokenway_stream_migrations_total{pool,outcome}` once per stream cut by its replica
(`migrated`: it continued elsewhere; `failed`: it could not). Pool labels pass the label guard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.telemetry.families import CounterFamily, FamiliesCollector, HistogramFamily
from gateway.telemetry.metrics import GatewayMetrics

COLD_START_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
STATES = ("ready", "starting", "draining", "sleeping", "stopped")

StatusSource = Callable[[], Mapping[str, Any]]


class PoolMetrics:
    """Registers the elastic-pool families on a `GatewayMetrics` registry (and its OTLP export)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._pool = metrics.guards["pool"]
        self.cold_start = HistogramFamily(
            "tokenway_cold_start_wait_seconds",
            "time a request was held while a replica of its pool started or woke",
            ("pool",),
            COLD_START_BUCKETS_S,
            otel_name="tokenway.cold_start.wait",
            unit="s",
        )
        self.migrations = CounterFamily(
            "tokenway_stream_migrations_total",
            "streams cut by their replica (killed, or stopped by a drain): continued on another one or not",
            ("pool", "outcome"),
            otel_name="tokenway.stream.migrations",
            unit="{stream}",
        )
        self._status: StatusSource | None = None
        metrics.registry.register(FamiliesCollector((self.cold_start, self.migrations)))
        metrics.registry.register(_PoolGauges(self))
        metrics.families = (*metrics.families, self.cold_start, self.migrations)

    def observe_cold_start(self, pool: str, seconds: float) -> None:
        self.cold_start.child(self._pool(pool)).observe(seconds)

    def observe_migration(self, pool: str, outcome: str) -> None:
        self.migrations.child(self._pool(pool), outcome).inc()

    def set_status(self, source: StatusSource) -> None:
        """`Autoscaler.status` (read at scrape time)."""
        self._status = source

    def gauges(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily(
            "tokenway_pool_replicas",
            "replicas of an autoscaled pool by role and state",
            labels=("pool", "role", "state"),
        )
        desired = GaugeMetricFamily(
            "tokenway_pool_desired_replicas", "replicas the autoscaler wants per pool and role", labels=("pool", "role")
        )
        held = GaugeMetricFamily("tokenway_pool_held_requests", "requests held for a cold start", labels=("pool",))
        startup = GaugeMetricFamily(
            "tokenway_pool_startup_seconds", "start-up time learnt from measured launches", labels=("pool",)
        )
        scale = CounterMetricFamily(
            "tokenway_pool_scale_events", "replicas added or removed by the autoscaler", labels=("pool", "direction")
        )
        drains = CounterMetricFamily(
            "tokenway_pool_drain_timeouts", "scale-down drains that outlived drain_timeout_s", labels=("pool",)
        )
        status = self._status() if self._status is not None else {}
        for pool in status.get("pools") or ():
            name = self._pool(pool["name"])
            for role, info in (pool.get("roles") or {}).items():
                counts = info.get("replicas") or {}
                for state in STATES:
                    replicas.add_metric((name, role, state), float(counts.get(state, 0)))
                if info.get("desired") is not None:
                    desired.add_metric((name, role), float(info["desired"]))
            held.add_metric((name,), float(pool.get("held", 0)))
            startup.add_metric((name,), float(pool.get("startup_s", 0.0)))
            for direction, count in (pool.get("scale_events") or {}).items():
                scale.add_metric((name, direction), float(count))
            drains.add_metric((name,), float(pool.get("drain_timeouts", 0)))
        yield from (replicas, desired, held, startup, scale, drains)


class _PoolGauges:
    def __init__(self, owner: PoolMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        yield from self._owner.gauges()

    def describe(self) -> list[Metric]:
        return []
