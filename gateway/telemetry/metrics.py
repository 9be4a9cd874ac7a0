"""Prometheus metrics of one gateway: per-request series from `RequestRecord`s, event hooks, and
scrape-time state gauges, all in a registry owned by this object (tests build several apps in one
process; nothing touches prometheus_client's global registry).

Per request the lifecycle calls `observe(record)` once. The record's label values are looked up in a
small bounded cache of pre-resolved children, so a repeat combination costs a tuple, one dict lookup
and a dozen float additions. Label values pass a `LabelGuard` per dimension (`gateway/telemetry/families.py`).

Families (see README.md for the full catalogue): GenAI semconv histograms
`gen_ai_client_token_usage`, `gen_ai_server_time_to_first_token_seconds`,
`gen_ai_server_time_per_output_token_seconds`, `gen_ai_server_request_duration_seconds`, and
`tokenway_*` counters/histograms for requests, admission outcomes, tokens, cost, overhead, routing,
upstream errors/retries, Redis, predictor error; gauges for endpoints, limiter and budgets; an agent
program's calls, tokens and dollars with a `program` label kept for the busiest live runs only
(`programs.py`).

Two features register their own families on the same registry (and its OTLP export), below:
flow control's waiting rooms (`FlowMetrics`) and elastic pools (`PoolMetrics`). Each is built by
the app factory only when its feature is on, so a gateway without them exports none of their series.

Flow control's series
---------------------

Waiting-room depth, time waited, fair-share ratios, counter staleness.

`tokenway_queue_wait_seconds{pool,band,tenant}` is a lean histogram observed once per request that
went through a waiting room (0 for those that went at once, so its count is every such request);
the gauges are read from the rooms' status at scrape time, so nothing else runs per request. Tenant
and pool labels pass the gateway's label guards: bounded by the configured tenants and pools.

Elastic pools' series
---------------------

Replicas by state, the planner's desired count, cold starts, migrations.

`tokenway_pool_replicas{pool,role,state}` and `tokenway_pool_desired_replicas{pool,role}` are read
from the autoscaler's status at scrape time, so a Kubernetes HPA or KEDA can scale engine
Deployments from the same decision; scale events and drain timeouts are counters read the same
way. `tokenway_cold_start_wait_seconds{pool}` is observed once per request held for a replica to
start or wake, `tokenway_stream_migrations_total{pool,outcome}` once per stream cut by its replica
(`migrated`: it continued elsewhere; `failed`: it could not). Pool labels pass the label guard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from time import monotonic, time_ns
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.app.settings import MetricsConfig
from gateway.request.record import RequestRecord
from gateway.telemetry import genai
from gateway.telemetry.families import (
    CounterChild,
    CounterFamily,
    FamiliesCollector,
    Family,
    HistogramChild,
    HistogramFamily,
    LabelGuard,
)
from gateway.telemetry.programs import ProgramMetrics
from gateway.telemetry.state import (
    EndpointsSource,
    LedgerSource,
    LimiterSource,
    PredictorSource,
    StateCollector,
)
from policies.routing.kv_tiers import KvSupply

# ---- Per-request series and event hooks

# Reject reasons that mean "shed under load" rather than "over a limit".
SHED_REASONS = frozenset({"shed", "load_shed", "queue_full", "queue_timeout", "queue_shed", "overloaded"})

GATEWAY_OVERHEAD_BUCKETS_S = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
REDIS_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
PREDICTOR_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)

_SERIES_CACHE_MAX = 4096
_GUARDED_LABELS = ("tenant", "model", "pool", "endpoint", "key_id", "reason", "limiter_id", "lora_name")
KV_TIERS = ("gpu", "cpu", "disk", "remote")  # policies/routing/kv_tiers.py's TIER_NAMES: a bounded label
# tokenway_kv_bytes_moved_total's `link`: backends/types.py's LINK_CLASSES, a pair without labels, lower tiers
KV_LINKS = frozenset(("same_node", "same_rack", "cross_rack", "cross_zone", "unknown", "cpu", "disk", "remote"))
LORA_EVENTS = ("load", "preload", "load_failed", "unload", "evict", "lost")  # gateway/transport/lora.py's events


@dataclass(slots=True, frozen=True)
class _RecordSeries:
    """The children one label combination of a record updates, resolved once."""

    requests: CounterChild
    admission: CounterChild
    fallback: CounterChild | None
    input_tokens: CounterChild
    cached_tokens: CounterChild
    output_tokens: CounterChild
    cost_usd: CounterChild
    overhead_s: HistogramChild
    genai_input: HistogramChild | None  # None: the request never reached an engine
    genai_output: HistogramChild | None
    ttft_s: HistogramChild | None
    tpot_s: HistogramChild | None
    duration_s: HistogramChild | None
    lora: _LoraSeries | None  # the request named a LoRA adapter the policy declares


@dataclass(slots=True, frozen=True)
class _LoraSeries:
    """A request for a LoRA adapter: its `lora_name` series, beside the model-labelled ones."""

    requests: CounterChild
    input_tokens: CounterChild
    output_tokens: CounterChild
    ttft_s: HistogramChild | None


class GatewayMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(
        self,
        config: MetricsConfig | None = None,
        *,
        version: str | None = None,
        now_s: Callable[[], float] = monotonic,
    ) -> None:
        self.config = config or MetricsConfig()
        labels_cfg = self.config.labels
        self._key_id_labels = labels_cfg.key_id
        self.guards: dict[str, LabelGuard] = {name: LabelGuard(labels_cfg.max_values) for name in _GUARDED_LABELS}
        self._series: dict[tuple[object, ...], _RecordSeries] = {}  # label tuple -> children, a shortcut
        # (pool, reason) as given -> (the pool's label, the routes child): a shortcut like `_series`
        self._route_series: dict[tuple[str, str], tuple[str, CounterChild]] = {}
        self._loras: frozenset[str] = frozenset()  # the policy's adapters (allow_label_values)

        genai_labels = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model",
                        "gen_ai_response_model", "pool")  # fmt: skip
        self.token_usage = HistogramFamily(
            genai.PROM_TOKEN_USAGE,
            "GenAI semconv gen_ai.client.token.usage: tokens per request by gen_ai_token_type (input, output)",
            (*genai_labels, "gen_ai_token_type"),
            genai.TOKEN_USAGE_BUCKETS,
            otel_name=genai.TOKEN_USAGE,
            unit="{token}",
        )
        self.ttft = HistogramFamily(
            genai.PROM_TIME_TO_FIRST_TOKEN,
            "GenAI semconv gen_ai.server.time_to_first_token: arrival to first content byte sent",
            genai_labels,
            genai.TIME_TO_FIRST_TOKEN_BUCKETS_S,
            otel_name=genai.TIME_TO_FIRST_TOKEN,
            unit="s",
        )
        self.tpot = HistogramFamily(
            genai.PROM_TIME_PER_OUTPUT_TOKEN,
            "GenAI semconv gen_ai.server.time_per_output_token: mean time per output token after the first",
            genai_labels,
            genai.TIME_PER_OUTPUT_TOKEN_BUCKETS_S,
            otel_name=genai.TIME_PER_OUTPUT_TOKEN,
            unit="s",
        )
        self.duration = HistogramFamily(
            genai.PROM_REQUEST_DURATION,
            "GenAI semconv gen_ai.server.request.duration: arrival to last byte, requests that reached an engine",
            (*genai_labels, "error_type"),
            genai.REQUEST_DURATION_BUCKETS_S,
            otel_name=genai.REQUEST_DURATION,
            unit="s",
        )
        money_labels = ("tenant", "model", "pool", *(("key_id",) if self._key_id_labels else ()))
        self.requests = CounterFamily(
            "tokenway_requests_total",
            "finished requests by status (ok, error, rejected, aborted) and HTTP status",
            ("tenant", "model", "api", "status", "http_status"),
            otel_name="tokenway.requests",
            unit="{request}",
        )
        self.admission = CounterFamily(
            "tokenway_admission_total",
            "admission outcome per request: admitted, fell_back, rejected, shed; reason for the last three",
            ("tenant", "model", "outcome", "reason"),
            otel_name="tokenway.admission",
            unit="{request}",
        )
        self.fallbacks = CounterFamily(
            "tokenway_fallbacks_total",
            "requests served by a fallback model",
            ("from_model", "to_model", "reason"),
            otel_name="tokenway.fallbacks",
            unit="{request}",
        )
        self.tokens = CounterFamily(
            "tokenway_tokens_total",
            "tokens by token_type (input, output); the types add up to the total",
            (*money_labels, "token_type"),
            otel_name="tokenway.tokens",
            unit="{token}",
        )
        self.cached_tokens = CounterFamily(
            "tokenway_cached_input_tokens_total",
            'input tokens read from a prefix cache: a part of tokenway_tokens_total{token_type="input"}, not extra',
            money_labels,
            otel_name="tokenway.cached_input_tokens",
            unit="{token}",
        )
        self.cost = CounterFamily(
            "tokenway_cost_usd_total",
            "cost in USD from the policies' price table",
            money_labels,
            otel_name="tokenway.cost",
            unit="USD",
        )
        self.overhead = HistogramFamily(
            "tokenway_gateway_overhead_seconds",
            "time spent in the gateway itself (before the upstream call, or until the rejection)",
            ("outcome",),
            GATEWAY_OVERHEAD_BUCKETS_S,
            otel_name="tokenway.gateway.overhead",
            unit="s",
        )
        self.routes = CounterFamily(
            "tokenway_routing_decisions_total",
            "routing decisions by pool and reason",
            ("pool", "reason"),
            otel_name="tokenway.routing.decisions",
        )
        self.routed_prompt_tokens = CounterFamily(
            "tokenway_routing_prompt_tokens_total",
            "prompt tokens of routed requests",
            ("pool",),
            otel_name="tokenway.routing.prompt_tokens",
            unit="{token}",
        )
        self.estimated_hit_tokens = CounterFamily(
            "tokenway_prefix_cache_estimated_hit_tokens_total",
            "prompt tokens the router expected the chosen endpoint to hold in its prefix cache "
            "(divide by tokenway_routing_prompt_tokens_total for the estimated hit ratio)",
            ("pool",),
            otel_name="tokenway.prefix_cache.estimated_hit_tokens",
            unit="{token}",
        )
        self.tier_tokens = CounterFamily(
            "tokenway_prefix_cache_tier_tokens_total",
            "prompt tokens the router expected the chosen endpoint to serve from each KV tier (gpu: HBM, cpu: host "
            "DRAM, disk, remote: a remote or shared store) instead of recomputing them",
            ("pool", "tier"),
            otel_name="tokenway.prefix_cache.tier_tokens",
            unit="{token}",
        )
        # the supply side of a dispatch (policies/routing/kv_tiers.py): what the cached prefix saved the pool
        self.saved_tokens = CounterFamily(
            "tokenway_prefill_tokens_saved_total",
            "prompt tokens the chosen endpoint was expected not to recompute, by measure: real (tokens of every KV "
            "tier the pool's credit sees) or credited (prefill-token equivalents once lower-tier loads are paid)",
            ("pool", "measure"),
            otel_name="tokenway.prefill.tokens_saved",
            unit="{token}",
        )
        self.saved_gpu_seconds = CounterFamily(
            "tokenway_prefill_gpu_seconds_saved_total",
            "GPU-seconds of prefill the cached prefix saved: roofline compute of the cached tokens minus the "
            "lower tiers' load time, times the replica's GPUs",
            ("pool",),
            otel_name="tokenway.prefill.gpu_seconds_saved",
            unit="s",
        )
        self.saved_usd = CounterFamily(
            "tokenway_prefill_saved_usd_total",
            "the prefill GPU-seconds saved priced at the pool's usd_per_gpu_hour (pools that set one)",
            ("pool",),
            otel_name="tokenway.prefill.saved_usd",
            unit="USD",
        )
        # the same saving by the engine's own count of cached prompt tokens (SupplyMeter.measure_engine)
        self.engine_saved_gpu_seconds = CounterFamily(
            "tokenway_prefill_engine_gpu_seconds_saved_total",
            "GPU-seconds of prefill saved by the cached prompt tokens the engine reported in each answer's usage, "
            "priced like tokenway_prefill_gpu_seconds_saved_total over the router's tiers (requests without a "
            "prefill leg)",
            ("pool",),
            otel_name="tokenway.prefill.engine_gpu_seconds_saved",
            unit="s",
        )
        self.engine_saved_usd = CounterFamily(
            "tokenway_prefill_engine_saved_usd_total",
            "the engine-counted prefill GPU-seconds saved priced at the pool's usd_per_gpu_hour (pools that set one)",
            ("pool",),
            otel_name="tokenway.prefill.engine_saved_usd",
            unit="USD",
        )
        self.kv_bytes_moved = CounterFamily(
            "tokenway_kv_bytes_moved_total",
            "KV bytes the router expected to move, by link: a disaggregated request's prefill-to-decode transfer "
            "by link class (same_node, same_rack, cross_rack, cross_zone, unknown) and lower-tier loads by tier "
            "(cpu, disk, remote)",
            ("pool", "link"),
            otel_name="tokenway.kv.bytes_moved",
            unit="By",
        )
        self.upstream_errors = CounterFamily(
            "tokenway_upstream_errors_total",
            "upstream failures by kind (connect, timeout, http_5xx, http_4xx, stream_broken, ...)",
            ("pool", "endpoint", "kind"),
            otel_name="tokenway.upstream.errors",
        )
        self.retries = CounterFamily(
            "tokenway_upstream_retries_total",
            "upstream attempts beyond the first",
            ("pool",),
            otel_name="tokenway.upstream.retries",
        )
        self.redis_latency = HistogramFamily(
            "tokenway_redis_command_duration_seconds",
            "latency of Redis round trips (limiter scripts, budgets, ledger stream)",
            ("op",),
            REDIS_LATENCY_BUCKETS_S,
            otel_name="tokenway.redis.duration",
            unit="s",
        )
        self.redis_errors = CounterFamily(
            "tokenway_redis_errors_total", "failed Redis round trips", ("op",), otel_name="tokenway.redis.errors"
        )
        self.predictor_error = HistogramFamily(
            "tokenway_predictor_error_ratio",
            "|observed - predicted| / observed for requests that had a prediction",
            ("target",),
            PREDICTOR_ERROR_BUCKETS,
            otel_name="tokenway.predictor.error_ratio",
            unit="1",
        )
        # LoRA adapters (docs/adapters.md): `lora_name` is one of the policy's adapters (at most
        # `labels.max_values` of them, in policy order; the rest are "other"); base-model requests have none
        self.lora_requests = CounterFamily(
            "tokenway_lora_requests_total",
            "finished requests for a LoRA adapter, by adapter and status",
            ("lora_name", "status"),
            otel_name="tokenway.lora.requests",
            unit="{request}",
        )
        self.lora_tokens = CounterFamily(
            "tokenway_lora_tokens_total",
            "tokens of requests for a LoRA adapter, by adapter and token_type (input, output)",
            ("lora_name", "token_type"),
            otel_name="tokenway.lora.tokens",
            unit="{token}",
        )
        self.lora_ttft = HistogramFamily(
            "tokenway_lora_time_to_first_token_seconds",
            "arrival to first content byte of requests for a LoRA adapter (an adapter load on the way shows here)",
            ("lora_name",),
            genai.TIME_TO_FIRST_TOKEN_BUCKETS_S,
            otel_name="tokenway.lora.time_to_first_token",
            unit="s",
        )
        self.lora_events = CounterFamily(
            "tokenway_lora_adapter_events_total",
            "adapter loads (on demand, preload), failed loads, idle unloads, and adapters an engine lost, per adapter",
            ("lora_name", "event"),
            otel_name="tokenway.lora.adapter_events",
            unit="{event}",
        )
        # agent programs (docs/agents.md): the `program` label named for the busiest live runs only
        self.programs = ProgramMetrics(
            self.guards["tenant"], max_programs=labels_cfg.max_programs, idle_s=labels_cfg.program_idle_s, now_s=now_s
        )
        self._count_programs = labels_cfg.max_programs > 0
        self._predictor_ttft = self.predictor_error.child("ttft")
        self._predictor_tpot = self.predictor_error.child("tpot")

        self.families: tuple[Family, ...] = (
            self.token_usage, self.ttft, self.tpot, self.duration, self.requests, self.admission, self.fallbacks,
            self.tokens, self.cached_tokens, self.cost, self.overhead, self.routes, self.routed_prompt_tokens,
            self.estimated_hit_tokens, self.tier_tokens, self.saved_tokens, self.saved_gpu_seconds, self.saved_usd,
            self.engine_saved_gpu_seconds, self.engine_saved_usd, self.kv_bytes_moved,
            self.upstream_errors, self.retries, self.redis_latency, self.redis_errors, self.predictor_error,
            self.lora_requests, self.lora_tokens, self.lora_ttft, self.lora_events, *self.programs.families,
        )  # fmt: skip
        self.created_unix_ns = time_ns()  # start of every cumulative series (OTLP start_time)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(FamiliesCollector(self.families))
        self.state = StateCollector(
            self.guards,
            key_id_labels=self._key_id_labels,
            version=version or _version(),
            now_s=now_s,
        )
        self.registry.register(self.state)

    # -- per request -------------------------------------------------------------------------

    def observe(self, record: RequestRecord) -> None:
        """Account one finished request (any status). The single per-request entry point."""
        key = (
            record.tenant, record.key_id if self._key_id_labels else "", record.requested_model,
            record.model, record.fallback_from, record.fallback_reason, record.pool, record.engine,
            record.api, record.status, record.http_status, record.reject_reason, record.error_code,
            bool(record.endpoint),
        )  # fmt: skip
        series = self._series.get(key)
        if series is None:
            series = self._resolve(record)
            if len(self._series) >= _SERIES_CACHE_MAX:
                self._series.clear()  # children live on in their families; only the shortcut is lost
            self._series[key] = series
        series.requests.value += 1.0
        series.admission.value += 1.0
        if series.fallback is not None:
            series.fallback.value += 1.0
        prompt, cached, completion = record.prompt_tokens, record.cached_tokens, record.completion_tokens
        series.input_tokens.value += prompt
        series.cached_tokens.value += cached
        series.output_tokens.value += completion
        series.cost_usd.value += record.cost_usd
        series.overhead_s.observe(record.gateway_overhead_s)
        lora = series.lora
        if lora is not None:
            lora.requests.value += 1.0
            lora.input_tokens.value += prompt
            lora.output_tokens.value += completion
            if lora.ttft_s is not None and record.ttft_s is not None:
                lora.ttft_s.observe(record.ttft_s)
        if record.program is not None and self._count_programs:
            self.programs.observe(record, record.program)
        if series.duration_s is None:
            return
        series.duration_s.observe(record.duration_s)
        if record.usage_source != "none":
            series.genai_input.observe(prompt)  # type: ignore[union-attr]
            series.genai_output.observe(completion)  # type: ignore[union-attr]
        ttft_s, tpot_s = record.ttft_s, record.tpot_s
        if ttft_s is not None:
            series.ttft_s.observe(ttft_s)  # type: ignore[union-attr]
            if record.predicted_ttft_ms is not None and ttft_s > 0:
                self._predictor_ttft.observe(abs(ttft_s - record.predicted_ttft_ms / 1000.0) / ttft_s)
        if tpot_s is not None:
            series.tpot_s.observe(tpot_s)  # type: ignore[union-attr]
            if record.predicted_tpot_ms is not None and tpot_s > 0:
                self._predictor_tpot.observe(abs(tpot_s - record.predicted_tpot_ms / 1000.0) / tpot_s)

    def _resolve(self, r: RequestRecord) -> _RecordSeries:
        g = self.guards
        tenant, model, pool = g["tenant"](r.tenant), g["model"](r.model), g["pool"](r.pool)
        requested_model = g["model"](r.requested_model)
        if r.status == "rejected":
            reason = g["reason"](r.reject_reason or r.error_code or "unknown")
            outcome = "shed" if r.reject_reason in SHED_REASONS else "rejected"
        elif r.fallback_from is not None:
            outcome, reason = "fell_back", g["reason"](r.fallback_reason or "unknown")
        else:
            outcome, reason = "admitted", ""
        money = (tenant, model, pool, *((g["key_id"](r.key_id),) if self._key_id_labels else ()))
        fallback = None
        if r.fallback_from is not None:
            fallback = self.fallbacks.child(g["model"](r.fallback_from), model, reason)
        reached_engine = bool(r.endpoint)
        gl = (genai.operation_name(r.api), r.engine or "unknown", requested_model, model, pool)
        error_type = "" if r.status == "ok" else g["reason"](r.error_code or r.status)
        return _RecordSeries(
            requests=self.requests.child(tenant, model, r.api, r.status, str(r.http_status)),
            admission=self.admission.child(tenant, model, outcome, reason),
            fallback=fallback,
            input_tokens=self.tokens.child(*money, genai.TOKEN_INPUT),
            cached_tokens=self.cached_tokens.child(*money),
            output_tokens=self.tokens.child(*money, genai.TOKEN_OUTPUT),
            cost_usd=self.cost.child(*money),
            overhead_s=self.overhead.child(outcome),
            genai_input=self.token_usage.child(*gl, genai.TOKEN_INPUT) if reached_engine else None,
            genai_output=self.token_usage.child(*gl, genai.TOKEN_OUTPUT) if reached_engine else None,
            ttft_s=self.ttft.child(*gl) if reached_engine else None,
            tpot_s=self.tpot.child(*gl) if reached_engine else None,
            duration_s=self.duration.child(*gl, error_type) if reached_engine else None,
            lora=self._lora_series(r, reached_engine),
        )

    def _lora_series(self, r: RequestRecord, reached_engine: bool) -> _LoraSeries | None:
        if r.model not in self._loras:
            return None
        name = self.guards["lora_name"](r.model)
        return _LoraSeries(
            requests=self.lora_requests.child(name, r.status),
            input_tokens=self.lora_tokens.child(name, genai.TOKEN_INPUT),
            output_tokens=self.lora_tokens.child(name, genai.TOKEN_OUTPUT),
            ttft_s=self.lora_ttft.child(name) if reached_engine else None,
        )

    # -- event hooks ---------------------------------------------------------------------------

    def observe_route(
        self,
        reason: str,
        pool: str = "",
        *,
        prompt_tokens: int = 0,
        estimated_hit_tokens: int = 0,
        tier_tokens: Sequence[int] = (),
    ) -> None:
        """One routing decision (a request may be routed again on retry). `estimated_hit_tokens`:
        prompt tokens the prefix index expects the chosen endpoint to have cached; `tier_tokens`: of
        them, those per KV tier in `KV_TIERS` order (`TierTokens.as_tuple()`)."""
        found = self._route_series.get((pool, reason))
        if found is None:  # through the label guards once per (pool, reason)
            if len(self._route_series) >= _SERIES_CACHE_MAX:
                self._route_series.clear()
            label = self.guards["pool"](pool)
            found = self._route_series[(pool, reason)] = (
                label,
                self.routes.child(label, self.guards["reason"](reason)),
            )
        pool, routes = found
        routes.value += 1.0
        if prompt_tokens:
            self.routed_prompt_tokens.child(pool).value += prompt_tokens
            self.estimated_hit_tokens.child(pool).value += estimated_hit_tokens
        for tier, tokens in zip(KV_TIERS, tier_tokens, strict=False):
            if tokens:
                self.tier_tokens.child(pool, tier).value += tokens

    def observe_supply(self, pool: str, supply: KvSupply) -> None:
        """What one dispatch's cached prefix saved its pool and the KV bytes it moved
        (`ScoringRouter.supply`). `link` values are bounded: `KV_LINKS`."""
        pool = self.guards["pool"](pool)
        if supply.real_tokens:
            self.saved_tokens.child(pool, "real").value += supply.real_tokens
            self.saved_tokens.child(pool, "credited").value += supply.credited_tokens
        if supply.gpu_seconds:
            self.saved_gpu_seconds.child(pool).value += supply.gpu_seconds
            if supply.usd is not None:
                self.saved_usd.child(pool).value += supply.usd
        for link, moved in supply.bytes_by_link:
            if link in KV_LINKS:
                self.kv_bytes_moved.child(pool, link).value += moved

    def observe_engine_supply(self, pool: str, supply: KvSupply) -> None:
        """What one answer's cached prompt tokens saved, by its engine's own count
        (`ScoringRouter.engine_supply`)."""
        if supply.gpu_seconds:
            pool = self.guards["pool"](pool)
            self.engine_saved_gpu_seconds.child(pool).value += supply.gpu_seconds
            if supply.usd is not None:
                self.engine_saved_usd.child(pool).value += supply.usd

    def observe_upstream_error(self, endpoint: str, kind: str) -> None:
        """One failed upstream attempt; `endpoint` is the endpoint id ("<pool>/<role>-<i>")."""
        pool = self.guards["pool"](endpoint.partition("/")[0])
        self.upstream_errors.child(pool, self.guards["endpoint"](endpoint), self.guards["reason"](kind)).value += 1

    def observe_lora_event(self, adapter: str, event: str) -> None:
        """An adapter loaded, preloaded, refused, unloaded for idleness or the memory budget, or lost by an
        engine (`LORA_EVENTS`)."""
        self.lora_events.child(self.guards["lora_name"](adapter), event).value += 1.0

    def observe_outcome(self, tenant: str, success: bool, value: float | None) -> None:
        """A program's outcome, recorded (`POST /v1/programs/{id}/outcome`)."""
        self.programs.observe_outcome(tenant, success, value)

    def observe_retry(self, pool: str = "") -> None:
        self.retries.child(self.guards["pool"](pool)).value += 1.0

    def observe_redis(self, latency_s: float, ok: bool, op: str = "limiter") -> None:
        self.redis_latency.child(op).observe(latency_s)
        if not ok:
            self.redis_errors.child(op).value += 1.0

    # -- state sources (read at scrape time) --------------------------------------------------

    def set_endpoint_gauges(self, fleet: EndpointsSource) -> None:
        """Endpoints to describe at each scrape: a callable (e.g. `fleet.endpoints`) read per scrape,
        or an iterable of live `Endpoint` objects captured now."""
        self.state.set_endpoints(fleet)

    def set_limiter_gauges(self, snapshot: LimiterSource) -> None:
        """Limiter rows (shape in state.py), or a callable returning them at scrape time."""
        self.state.set_limiter(snapshot)

    def set_predictor_gauges(self, status: PredictorSource) -> None:
        """Predictor status dict (shape in state.py), or a callable returning it at scrape time."""
        self.state.set_predictor(status)

    def set_ledger_stats(self, source: LedgerSource) -> None:
        """A callable returning the ledger's counters, e.g. `LedgerWriter.stats`."""
        self.state.set_ledger(source)

    def allow_label_values(
        self,
        *,
        tenants: Iterable[str] | None = None,
        models: Iterable[str] | None = None,
        pools: Iterable[str] | None = None,
        endpoints: Iterable[str] | None = None,
        key_ids: Iterable[str] | None = None,
        loras: Iterable[str] | None = None,
    ) -> None:
        """Pin label dimensions to the configured values (call at startup and on policy reload);
        anything else, e.g. a client's unknown model name, is exported as "other". `loras`: the policy's
        adapters, the first `labels.max_values` of them a `lora_name` of their own."""
        if loras is not None:
            declared = list(dict.fromkeys(loras))
            self._loras = frozenset(declared)
            self.guards["lora_name"].allow(declared[: self.config.labels.max_values])
        for name, values in (("tenant", tenants), ("model", models), ("pool", pools),
                             ("endpoint", endpoints), ("key_id", key_ids)):  # fmt: skip
            if values is not None:
                self.guards[name].allow(values)
        self._series.clear()
        self._route_series.clear()

    # -- exposition ----------------------------------------------------------------------------

    @property
    def cached_series(self) -> int:
        """Entries of the per-record series shortcut (bounded: cleared when it reaches its cap)."""
        return len(self._series)

    def render(self) -> bytes:
        """The Prometheus text exposition for `GET /metrics` (content type `CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def family_names(self) -> Sequence[str]:
        """Names of the families rendered now (for tests and dashboard checks)."""
        return [m.name for m in self.registry.collect()]


def _version() -> str:
    try:
        return metadata.version("tokenway")
    except metadata.PackageNotFoundError:
        return "dev"


def merged_stats(*sources: Callable[[], Mapping[str, float]]) -> Callable[[], dict[str, float]]:
    """One stats callable from several (the ledger writer and its Redis exporter, say)."""

    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for source in sources:
            out.update(source())
        return out

    return read


# ---- Flow control's series

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


# ---- Elastic pools' series

COLD_START_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
STATES = ("ready", "starting", "draining", "sleeping", "stopped")


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
