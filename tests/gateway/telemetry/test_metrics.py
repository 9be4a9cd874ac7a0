"""GatewayMetrics as Prometheus sees it: families and labels after traffic, parsed with
prometheus_client's own text parser."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.types import Endpoint, EndpointState, Role
from gateway.app.settings import MetricLabelsConfig, MetricsConfig
from gateway.request.record import RequestRecord
from gateway.telemetry.families import MAX_VALUE_CHARS, OTHER
from gateway.telemetry.metrics import GatewayMetrics
from policies.policy import Policy, price_usd
from policies.schema import PoliciesConfig
from policies.types import Usage

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(metrics: GatewayMetrics) -> tuple[dict[str, Any], Samples]:
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def ok_record(**overrides: Any) -> RequestRecord:
    record = RequestRecord(
        request_id="req-1",
        api="chat",
        started_at_unix_s=time.time(),
        tenant="acme",
        key_id="acme-k1",
        requested_model="llama",
        model="llama-3.1-8b",
        served_model="meta-llama/Llama-3.1-8B",
        pool="llama-8b",
        endpoint="llama-8b/both-0",
        engine="vllm",
        stream=True,
        prompt_tokens=1200,
        cached_tokens=800,
        completion_tokens=300,
        usage_source="engine",
        cost_usd=0.00123,
        ttft_s=0.120,
        tpot_s=0.011,
        duration_s=3.4,
        gateway_overhead_s=0.0004,
        upstream_attempts=1,
    )
    return replace(record, **overrides)


def traffic(metrics: GatewayMetrics) -> None:
    metrics.observe(ok_record())
    metrics.observe(ok_record(request_id="req-2", tenant="globex", ttft_s=0.3, predicted_ttft_ms=250.0))
    metrics.observe(
        ok_record(
            request_id="req-3",
            fallback_from="llama-3.1-70b",
            fallback_reason="rate_limited",
            model="llama-3.1-8b",
            requested_model="llama-3.1-70b",
        )
    )
    metrics.observe(
        ok_record(
            request_id="req-4",
            status="rejected",
            http_status=429,
            error_code="rate_limit_exceeded",
            reject_reason="rate_limited",
            pool="",
            endpoint="",
            engine="",
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            usage_source="none",
            cost_usd=0.0,
            ttft_s=None,
            tpot_s=None,
        )
    )
    metrics.observe(
        ok_record(request_id="req-5", status="rejected", http_status=503, reject_reason="queue_full", endpoint="")
    )
    metrics.observe(
        ok_record(request_id="req-6", status="error", http_status=502, error_code="upstream_error", ttft_s=None)
    )
    metrics.observe_route(
        "prefix-affinity", "llama-8b", prompt_tokens=1200, estimated_hit_tokens=800, tier_tokens=(500, 300, 0, 0)
    )
    metrics.observe_route("least-load", "llama-8b")
    metrics.observe_upstream_error("llama-8b/both-1", "connect")
    metrics.observe_retry("llama-8b")
    metrics.observe_redis(0.0008, True)
    metrics.observe_redis(0.2, False)


EXPECTED_LABELS = {
    "gen_ai_client_token_usage": {
        "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "pool",
        "gen_ai_token_type",
    },
    "gen_ai_server_time_to_first_token_seconds": {
        "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "pool",
    },
    "gen_ai_server_time_per_output_token_seconds": {
        "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "pool",
    },
    "gen_ai_server_request_duration_seconds": {
        "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "pool",
        "error_type",
    },
    "tokenway_requests": {"tenant", "model", "api", "status", "http_status"},
    "tokenway_admission": {"tenant", "model", "outcome", "reason"},
    "tokenway_fallbacks": {"from_model", "to_model", "reason"},
    "tokenway_tokens": {"tenant", "model", "pool", "token_type"},
    "tokenway_cost_usd": {"tenant", "model", "pool"},
    "tokenway_gateway_overhead_seconds": {"outcome"},
    "tokenway_routing_decisions": {"pool", "reason"},
    "tokenway_routing_prompt_tokens": {"pool"},
    "tokenway_prefix_cache_estimated_hit_tokens": {"pool"},
    "tokenway_prefix_cache_tier_tokens": {"pool", "tier"},
    "tokenway_upstream_errors": {"pool", "endpoint", "kind"},
    "tokenway_upstream_retries": {"pool"},
    "tokenway_redis_command_duration_seconds": {"op"},
    "tokenway_redis_errors": {"op"},
    "tokenway_predictor_error_ratio": {"target"},
    "tokenway_build_info": {"version"},
}  # fmt: skip


def test_families_and_labels_after_traffic() -> None:
    metrics = GatewayMetrics()
    traffic(metrics)
    families, _ = parse(metrics)
    for name, labels in EXPECTED_LABELS.items():
        assert name in families, f"missing family {name}"
        seen = {k for s in families[name].samples for k in s.labels if k not in ("le",)}
        assert seen == labels, name


def test_request_counts_outcomes_and_tokens() -> None:
    metrics = GatewayMetrics()
    traffic(metrics)
    _, s = parse(metrics)
    assert value(s, "tokenway_requests_total") == 6
    assert value(s, "tokenway_requests_total", status="ok", http_status="200") == 3
    assert value(s, "tokenway_requests_total", status="rejected", http_status="429") == 1
    assert value(s, "tokenway_admission_total", outcome="admitted") == 3  # two ok + the upstream error
    assert value(s, "tokenway_admission_total", outcome="fell_back", reason="rate_limited") == 1
    assert value(s, "tokenway_admission_total", outcome="rejected", reason="rate_limited") == 1
    assert value(s, "tokenway_admission_total", outcome="shed", reason="queue_full") == 1
    assert value(s, "tokenway_fallbacks_total", from_model="llama-3.1-70b", to_model="llama-3.1-8b") == 1
    assert value(s, "tokenway_tokens_total", tenant="acme", token_type="input") == 1200 * 3 + 1200  # + shed one
    assert value(s, "tokenway_cached_input_tokens_total", tenant="globex") == 800
    types = {dict(ls)["token_type"] for n, ls in s if n == "tokenway_tokens_total"}
    assert types == {"input", "output"}  # summing over token_type counts each token once
    semconv = {dict(ls)["gen_ai_token_type"] for n, ls in s if "gen_ai_token_type" in dict(ls)}
    assert semconv == {"input", "output"}  # the values OpenTelemetry's GenAI conventions define
    assert value(s, "tokenway_tokens_total", token_type="output") == 300 * 5
    # GenAI histograms only for requests that reached an engine, tokens only with known usage
    assert value(s, "gen_ai_client_token_usage_count", gen_ai_token_type="input") == 4
    assert value(s, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == 300 * 4
    assert value(s, "gen_ai_server_time_to_first_token_seconds_count") == 3
    assert value(s, "gen_ai_server_time_to_first_token_seconds_bucket", le="0.25") == 2
    assert value(s, "gen_ai_server_request_duration_seconds_count", error_type="upstream_error") == 1
    assert value(s, "gen_ai_server_time_per_output_token_seconds_count", gen_ai_provider_name="vllm") == 4
    assert value(s, "tokenway_gateway_overhead_seconds_count") == 6
    assert value(s, "tokenway_routing_decisions_total", reason="prefix-affinity") == 1
    assert value(s, "tokenway_prefix_cache_estimated_hit_tokens_total", pool="llama-8b") == 800
    assert value(s, "tokenway_prefix_cache_tier_tokens_total", pool="llama-8b", tier="cpu") == 300
    tiers = {dict(ls)["tier"] for n, ls in s if n == "tokenway_prefix_cache_tier_tokens_total"}
    assert tiers == {"gpu", "cpu"}  # a tier nothing came from has no series yet
    assert value(s, "tokenway_routing_prompt_tokens_total", pool="llama-8b") == 1200
    assert value(s, "tokenway_upstream_errors_total", endpoint="llama-8b/both-1", kind="connect") == 1
    assert value(s, "tokenway_upstream_retries_total", pool="llama-8b") == 1
    assert value(s, "tokenway_redis_command_duration_seconds_count", op="limiter") == 2
    assert value(s, "tokenway_redis_errors_total", op="limiter") == 1
    assert value(s, "tokenway_predictor_error_ratio_count", target="ttft") == 1


def test_cost_matches_the_price_table() -> None:
    policy = Policy(
        PoliciesConfig.model_validate(
            {
                "models": {
                    "llama-3.1-8b": {
                        "price": {"input_per_mtok": 0.20, "cached_input_per_mtok": 0.05, "output_per_mtok": 0.60}
                    }
                }
            }
        )
    )
    usage = Usage(prompt_tokens=1_000_000, cached_tokens=400_000, completion_tokens=250_000)
    cost = price_usd(policy, "llama-3.1-8b", usage)
    expected = 0.6 * 0.20 + 0.4 * 0.05 + 0.25 * 0.60  # uncached input + cached input + output
    assert cost == pytest.approx(expected)

    metrics = GatewayMetrics()
    for i in range(3):
        metrics.observe(
            ok_record(
                request_id=f"r{i}",
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens,
                cost_usd=cost,
            )
        )
    _, s = parse(metrics)
    assert value(s, "tokenway_cost_usd_total", tenant="acme", model="llama-3.1-8b") == pytest.approx(3 * expected)


def test_label_values_are_bounded() -> None:
    metrics = GatewayMetrics(MetricsConfig(labels=MetricLabelsConfig(max_values=5)))
    for i in range(50):
        metrics.observe(ok_record(request_id=f"r{i}", tenant=f"tenant-{i}", model=f"no-such-model-{i}"))
    _, s = parse(metrics)
    tenants = {ls for (n, labels) in s for k, ls in labels if n == "tokenway_requests_total" and k == "tenant"}
    assert len(tenants) == 6 and OTHER in tenants
    assert value(s, "tokenway_requests_total") == 50
    assert value(s, "tokenway_telemetry_label_overflow_total", label="tenant") == 45


def test_allow_list_folds_unknown_models_without_using_capacity() -> None:
    metrics = GatewayMetrics()
    metrics.allow_label_values(models=["llama-3.1-8b", "llama"], tenants=["acme"])
    metrics.observe(ok_record())
    metrics.observe(ok_record(request_id="junk", requested_model="gpt-17", model="gpt-17", tenant="mallory"))
    _, s = parse(metrics)
    assert value(s, "tokenway_requests_total", model="llama-3.1-8b", tenant="acme") == 1
    assert value(s, "tokenway_requests_total", model=OTHER, tenant=OTHER) == 1


def test_a_flood_of_client_chosen_model_names_keeps_the_memo_bounded_and_counts_right() -> None:
    """404s for models nobody serves carry the client's model name to the `model` label: 3,000
    distinct long names leave the guard's memo at its bound (entries, and each key cut), fold into
    OTHER, and every request is still counted, the served model's exactly."""
    metrics = GatewayMetrics(MetricsConfig(labels=MetricLabelsConfig(max_values=8)))
    metrics.allow_label_values(models=["llama-3.1-8b", "llama"], tenants=["acme"])
    for i in range(3000):
        junk = f"gpt-{i}-" + "z" * 200
        metrics.observe(
            ok_record(
                request_id=f"j{i}", requested_model=junk, model=junk, status="rejected", http_status=404,
                error_code="model_not_found", pool="", endpoint="", completion_tokens=0, cost_usd=0.0,
            )
        )  # fmt: skip
        if i % 100 == 0:
            metrics.observe(ok_record(request_id=f"ok{i}"))
    guard = metrics.guards["model"]
    assert len(guard) == 4 * 8  # the two served names and 30 refusals remembered, then no more
    assert guard.memo_chars == len("llama-3.1-8b") + len("llama") + 30 * MAX_VALUE_CHARS  # each key cut
    _, s = parse(metrics)
    models = {v for (n, labels) in s for k, v in labels if n == "tokenway_requests_total" and k == "model"}
    assert models == {"llama-3.1-8b", OTHER}
    assert value(s, "tokenway_requests_total", model="llama-3.1-8b", status="ok") == 30
    assert value(s, "tokenway_requests_total", model=OTHER, http_status="404") == 3000
    assert value(s, "tokenway_requests_total") == 3030
    assert guard("llama-3.1-8b") == "llama-3.1-8b"  # the flood took nothing from the served model


def test_key_id_label_only_when_configured() -> None:
    plain = GatewayMetrics()
    plain.observe(ok_record())
    assert all("key_id" not in labels for (_, ls) in parse(plain)[1] for labels in [dict(ls)])
    keyed = GatewayMetrics(MetricsConfig(labels=MetricLabelsConfig(key_id=True)))
    keyed.observe(ok_record())
    _, s = parse(keyed)
    assert value(s, "tokenway_cost_usd_total", key_id="acme-k1") == pytest.approx(0.00123)


def test_registries_are_independent() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe(ok_record())
    assert value(parse(b)[1], "tokenway_requests_total") == 0
    assert value(parse(a)[1], "tokenway_requests_total") == 1


@pytest.mark.slow
def test_series_cache_is_bounded_and_keeps_counting() -> None:
    metrics = GatewayMetrics(MetricsConfig(labels=MetricLabelsConfig(max_values=10_000)))
    for i in range(5000):
        metrics.observe(ok_record(request_id=f"r{i}", tenant=f"t{i % 4500}"))
    assert 0 < metrics.cached_series <= 4096
    assert value(parse(metrics)[1], "tokenway_requests_total") == 5000  # clearing the shortcut lost no count


def _endpoint(i: int, state: EndpointState = EndpointState.READY) -> Endpoint:
    e = Endpoint(
        id=f"llama-8b/both-{i}", pool="llama-8b", base_url=f"http://127.0.0.1:{8000 + i}", engine="sim",
        served_model="llama-3.1-8b", role=Role.BOTH, state=state,
    )  # fmt: skip
    e.stats.running, e.stats.waiting, e.stats.kv_usage_ratio = 3 + i, i, 0.25
    e.stats.prefix_cache_hits_tokens, e.stats.prefix_cache_queries_tokens = 500.0, 1000.0
    e.stats.scraped_at_s = 100.0
    e.inflight.begin(prefill_tokens=64)
    return e


def test_endpoint_gauges_read_live_endpoints_at_scrape() -> None:
    metrics = GatewayMetrics(now_s=lambda: 101.5)
    endpoints = [_endpoint(0), _endpoint(1, EndpointState.UNHEALTHY)]
    metrics.set_endpoint_gauges(lambda: endpoints)
    _, s = parse(metrics)
    assert value(s, "tokenway_endpoint_state", endpoint="llama-8b/both-1", state="unhealthy") == 1
    assert value(s, "tokenway_endpoint_state", endpoint="llama-8b/both-1", state="ready") == 0
    assert value(s, "tokenway_endpoint_running_requests", endpoint="llama-8b/both-1") == 4
    assert value(s, "tokenway_endpoint_kv_usage_ratio", endpoint="llama-8b/both-0") == 0.25
    assert value(s, "tokenway_endpoint_inflight_prefill_tokens", pool="llama-8b") == 128
    assert value(s, "tokenway_endpoint_stats_age_seconds", endpoint="llama-8b/both-0") == 1.5
    assert value(s, "tokenway_endpoint_prefix_cache_hits_tokens_total", endpoint="llama-8b/both-0") == 500
    assert value(s, "tokenway_endpoint_kv_offload_bytes_total") == 0  # no engine offloads: no series
    endpoints[1].stats.kv_offload_bytes = {"gpu_to_cpu": 2e9, "cpu_to_gpu": 5e8}  # the engine's own counters
    offloaded = parse(metrics)[1]
    assert (
        value(
            offloaded,
            "tokenway_endpoint_kv_offload_bytes_total",
            endpoint="llama-8b/both-1",
            transfer_type="gpu_to_cpu",
        )
        == 2e9
    )
    endpoints[0].stats.running = 42  # live objects: the next scrape sees the change
    assert value(parse(metrics)[1], "tokenway_endpoint_running_requests", endpoint="llama-8b/both-0") == 42


def test_limiter_and_budget_gauges() -> None:
    metrics = GatewayMetrics()
    metrics.set_limiter_gauges(
        [
            {"scope": "tenant", "id": "acme", "dimension": "tpm", "limit": 100000, "remaining": 61000},
            {"scope": "tenant", "id": "acme", "dimension": "usd_per_day", "limit": 50.0, "remaining": 12.5},
            {"scope": "key", "id": "acme-k1", "dimension": "rpm", "limit": 60, "remaining": 59},
        ]
    )
    _, s = parse(metrics)
    assert value(s, "tokenway_limiter_remaining", scope="tenant", id="acme", dimension="tpm") == 61000
    assert value(s, "tokenway_limiter_limit", dimension="usd_per_day") == 50
    assert value(s, "tokenway_budget_remaining_usd", scope="tenant", id="acme", period="day") == 12.5
    assert value(s, "tokenway_limiter_remaining", scope="key") == 0  # key rows need labels.key_id


def test_predictor_and_ledger_gauges_and_a_failing_source() -> None:
    metrics = GatewayMetrics()
    metrics.set_predictor_gauges(
        lambda: {"pools": {"llama-8b": {"samples": 1200, "ttft_mape": 0.12, "model": "xgb"}}, "ready": True}
    )
    metrics.set_ledger_stats(lambda: {"written_total": 7, "pending_records": 2})
    _, s = parse(metrics)
    assert value(s, "tokenway_predictor_samples", pool="llama-8b") == 1200
    assert value(s, "tokenway_predictor_ttft_mape", pool="llama-8b") == pytest.approx(0.12)
    assert value(s, "tokenway_predictor_ready") == 1
    assert value(s, "tokenway_ledger_written_total") == 7
    assert value(s, "tokenway_ledger_pending_records") == 2

    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("limiter gone")

    metrics.set_limiter_gauges(broken)
    _, s = parse(metrics)  # the scrape still succeeds
    assert value(s, "tokenway_telemetry_source_errors_total", source="limiter") == 1
    assert value(s, "tokenway_ledger_written_total") == 7
