"""Scrape-time gauges: endpoint state and load, limiter headroom, predictor status, ledger health.

These series describe state, not events, so nothing is updated per request: each source is a live
object or a callable read when Prometheus scrapes. Sources are plain objects or dicts so that other
rooms' shapes can be adapted by the gateway without this module importing them.

Dict shapes:

- limiter snapshot: a list of rows, one per subject bucket and dimension (the policy's field names)
  `{"scope": "key"|"tenant"|"model"|"key_model"|"global", "id": "acme", "dimension": "rpm"|"rpd"|
  "tpm"|"tpd"|"max_concurrent"|"usd_per_day"|"usd_per_month", "limit": 600.0, "remaining": 412.0}`.
  Rows of scope "key"/"key_model" are exported only when `labels.key_id` is on. `usd_per_*` rows
  are also exported as `tokenway_budget_{limit,remaining}_usd{scope,id,period}` (period day|month).
- predictor status: `{"pools": {"<pool>": {"samples": 1200, "ttft_mape": 0.12, ...}}, "<name>": 1.0}`;
  every numeric (or bool) field becomes a gauge `tokenway_predictor_<field>`, per pool when nested
  under "pools"; other fields are ignored.
- ledger stats: a flat `{name: number}` mapping; counters end in `_total`, the rest are gauges,
  exported as `tokenway_ledger_<name>`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.types import Endpoint, EndpointState
from gateway.telemetry.families import LabelGuard

log = logging.getLogger("tokenway.telemetry")

EndpointsSource = Iterable[Endpoint] | Callable[[], Iterable[Endpoint]]
LimiterSource = list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]
PredictorSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
LedgerSource = Callable[[], Mapping[str, float]]

_ENDPOINT_STATES = tuple(s.value for s in EndpointState)
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


class StateCollector:
    """Yields the state families from whatever sources have been set; a failing source is skipped
    and counted in `tokenway_telemetry_source_errors_total`, never failing the scrape."""

    def __init__(
        self,
        guards: Mapping[str, LabelGuard],
        *,
        key_id_labels: bool,
        version: str,
        now_s: Callable[[], float],
    ) -> None:
        self._guards = guards
        self._key_id_labels = key_id_labels
        self._version = version
        self._now_s = now_s
        self._endpoints: Callable[[], Iterable[Endpoint]] | None = None
        self._limiter: Callable[[], list[dict[str, Any]]] | None = None
        self._predictor: Callable[[], Mapping[str, Any]] | None = None
        self._ledger: LedgerSource | None = None
        self._source_errors: dict[str, int] = {}

    def set_endpoints(self, source: EndpointsSource) -> None:
        if callable(source):
            self._endpoints = source
        else:
            endpoints = list(source)  # Endpoint objects are live: their fields are read at scrape
            self._endpoints = lambda: endpoints

    def set_limiter(self, source: LimiterSource) -> None:
        if callable(source):
            self._limiter = source
        else:
            rows = list(source)
            self._limiter = lambda: rows

    def set_predictor(self, source: PredictorSource) -> None:
        if callable(source):
            self._predictor = source
        else:
            status = dict(source)
            self._predictor = lambda: status

    def set_ledger(self, source: LedgerSource) -> None:
        self._ledger = source

    def describe(self) -> list[Metric]:
        return []  # families vary with the sources; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("tokenway_build_info", "tokenway version", labels=["version"])
        info.add_metric([self._version], 1.0)
        yield info
        overflow = CounterMetricFamily(
            "tokenway_telemetry_label_overflow",
            "label values folded into 'other' by the cardinality guard",
            labels=["label"],
        )
        for label, guard in self._guards.items():
            overflow.add_metric([label], float(guard.overflowed))
        yield overflow
        for name, build in self._builders():
            try:
                families = build()
            except Exception:
                log.exception("telemetry source %s failed during a scrape", name)
                self._source_errors[name] = self._source_errors.get(name, 0) + 1
                continue
            yield from families
        errors = CounterMetricFamily(
            "tokenway_telemetry_source_errors", "state sources that raised during a scrape", labels=["source"]
        )
        for name, count in self._source_errors.items():
            errors.add_metric([name], float(count))
        yield errors

    def _builders(self) -> list[tuple[str, Callable[[], list[Metric]]]]:
        out: list[tuple[str, Callable[[], list[Metric]]]] = []
        if (endpoints := self._endpoints) is not None:
            out.append(("endpoints", lambda: self._endpoint_families(endpoints())))
        if (limiter := self._limiter) is not None:
            out.append(("limiter", lambda: self._limiter_families(limiter())))
        if (predictor := self._predictor) is not None:
            out.append(("predictor", lambda: self._predictor_families(predictor())))
        if (ledger := self._ledger) is not None:
            out.append(("ledger", lambda: self._ledger_families(ledger())))
        return out

    def _endpoint_families(self, endpoints: Iterable[Endpoint]) -> list[Metric]:
        pool_g, endpoint_g = self._guards["pool"], self._guards["endpoint"]
        labels = ["pool", "endpoint"]
        state = GaugeMetricFamily(
            "tokenway_endpoint_state",
            "1 for the endpoint's current state (starting, ready, draining, unhealthy, dead)",
            labels=[*labels, "role", "engine", "state"],
        )
        gauges = {
            name: GaugeMetricFamily(f"tokenway_endpoint_{name}", doc, labels=labels)
            for name, doc in (
                ("running_requests", "requests the engine reports running"),
                ("waiting_requests", "requests the engine reports queued"),
                ("kv_usage_ratio", "engine KV-cache usage, 0..1"),
                ("inflight_requests", "requests the gateway has in flight on the endpoint"),
                ("inflight_prefill_tokens", "uncached prompt tokens dispatched and not yet prefilled"),
                ("inflight_decode_tokens", "context tokens of requests in decode"),
                ("stats_age_seconds", "seconds since the last successful metrics scrape (+Inf: never)"),
                ("consecutive_failures", "passive-health failures in a row"),
            )
        }
        counters = {
            name: CounterMetricFamily(f"tokenway_endpoint_{name}", doc, labels=labels)
            for name, doc in (
                ("prefix_cache_hits_tokens", "prompt tokens the engine served from its prefix cache"),
                ("prefix_cache_queries_tokens", "prompt tokens the engine looked up in its prefix cache"),
                ("restarts", "restarts of a launched replica"),
            )
        }
        offload = CounterMetricFamily(
            "tokenway_endpoint_kv_offload_bytes",
            "bytes the engine's KV offloading moved, as the engine reports them (vllm:kv_offload_total_bytes)",
            labels=[*labels, "transfer_type"],
        )
        now_s = self._now_s()
        seen: set[tuple[str, str]] = set()
        for e in endpoints:
            values = [pool_g(e.pool), endpoint_g(e.id)]
            if (values[0], values[1]) in seen:
                continue  # folded into "other" twice: a family cannot repeat a series
            seen.add((values[0], values[1]))
            current = e.state.value
            for s in _ENDPOINT_STATES:
                state.add_metric([*values, e.role.value, e.engine, s], 1.0 if s == current else 0.0)
            st, inflight = e.stats, e.inflight
            gauges["running_requests"].add_metric(values, st.running)
            gauges["waiting_requests"].add_metric(values, st.waiting)
            gauges["kv_usage_ratio"].add_metric(values, st.kv_usage_ratio)
            gauges["inflight_requests"].add_metric(values, inflight.requests)
            gauges["inflight_prefill_tokens"].add_metric(values, inflight.prefill_tokens)
            gauges["inflight_decode_tokens"].add_metric(values, inflight.decode_tokens)
            gauges["stats_age_seconds"].add_metric(values, e.stats_age_s(now_s))
            gauges["consecutive_failures"].add_metric(values, e.consecutive_failures)
            counters["prefix_cache_hits_tokens"].add_metric(values, st.prefix_cache_hits_tokens)
            counters["prefix_cache_queries_tokens"].add_metric(values, st.prefix_cache_queries_tokens)
            counters["restarts"].add_metric(values, e.restarts)
            for transfer, moved in st.kv_offload_bytes.items():
                offload.add_metric([*values, transfer], moved)
        return [state, *gauges.values(), *counters.values(), offload]

    def _limiter_families(self, rows: list[dict[str, Any]]) -> list[Metric]:
        id_g = self._guards["limiter_id"]
        labels = ["scope", "id", "dimension"]
        limit = GaugeMetricFamily("tokenway_limiter_limit", "configured capacity of a limit", labels=labels)
        remaining = GaugeMetricFamily(
            "tokenway_limiter_remaining", "capacity left in a limit's current window/bucket", labels=labels
        )
        budget_labels = ["scope", "id", "period"]
        budget_limit = GaugeMetricFamily("tokenway_budget_limit_usd", "budget per period", labels=budget_labels)
        budget_remaining = GaugeMetricFamily(
            "tokenway_budget_remaining_usd", "budget left in the current period", labels=budget_labels
        )
        seen: set[tuple[str, str, str]] = set()
        for row in rows:
            scope = str(row.get("scope", ""))
            if scope in ("key", "key_model") and not self._key_id_labels:
                continue
            ident, dimension = id_g(str(row.get("id", ""))), str(row.get("dimension", ""))
            if (scope, ident, dimension) in seen:
                continue  # folded into "other" twice: keep the first, a family cannot repeat a series
            seen.add((scope, ident, dimension))
            values = [scope, ident, dimension]
            if "limit" in row:
                limit.add_metric(values, float(row["limit"]))
            if "remaining" in row:
                remaining.add_metric(values, float(row["remaining"]))
            if dimension.startswith("usd_"):
                period = [scope, ident, dimension.removeprefix("usd_").removeprefix("per_")]
                if "limit" in row:
                    budget_limit.add_metric(period, float(row["limit"]))
                if "remaining" in row:
                    budget_remaining.add_metric(period, float(row["remaining"]))
        return [limit, remaining, budget_limit, budget_remaining]

    def _predictor_families(self, status: Mapping[str, Any]) -> list[Metric]:
        pool_g = self._guards["pool"]
        families: dict[str, tuple[GaugeMetricFamily, bool]] = {}  # name -> (family, per pool)
        seen: set[tuple[str, str]] = set()

        def add(field: str, pool: str | None, value: float) -> None:
            name = "tokenway_predictor_" + _NAME_RE.sub("_", field)
            if name not in families:
                labels = ["pool"] if pool is not None else []
                doc = f"predictor status field {field!r}"
                families[name] = (GaugeMetricFamily(name, doc, labels=labels), pool is not None)
            family, per_pool = families[name]
            if per_pool != (pool is not None) or (name, pool or "") in seen:
                return  # a name used both per pool and globally, or a pool folded into "other" twice
            seen.add((name, pool or ""))
            family.add_metric([pool] if pool is not None else [], value)

        pools = status.get("pools")
        if isinstance(pools, Mapping):
            for pool, fields in pools.items():
                if isinstance(fields, Mapping):
                    for field, value in fields.items():
                        if _numeric(value):
                            add(field, pool_g(str(pool)), float(value))
        for field, value in status.items():
            if field != "pools" and _numeric(value):
                add(field, None, float(value))
        return [family for family, _ in families.values()]

    def _ledger_families(self, stats: Mapping[str, float]) -> list[Metric]:
        out: list[Metric] = []
        for field, value in stats.items():
            name = "tokenway_ledger_" + _NAME_RE.sub("_", field)
            if field.endswith("_total"):
                family: Metric = CounterMetricFamily(name, f"usage ledger {field}")
            else:
                family = GaugeMetricFamily(name, f"usage ledger {field}")
            family.add_metric([], float(value))  # type: ignore[attr-defined]
            out.append(family)
        return out


def _numeric(value: object) -> bool:
    return isinstance(value, int | float)  # bool is an int: exported as 0/1
