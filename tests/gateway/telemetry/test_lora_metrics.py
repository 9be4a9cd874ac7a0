"""The `lora_name` label: requests, tokens and first-token times per LoRA adapter, only for the
policy's adapters (at most `labels.max_values` of them by name, the rest "other"), none for a base
model's requests; adapter events (loads, preloads, failures, idle unloads, losses) per adapter."""

from __future__ import annotations

from gateway.app.settings import MetricLabelsConfig, MetricsConfig
from gateway.telemetry.families import OTHER
from gateway.telemetry.metrics import GatewayMetrics
from tests.gateway.telemetry.test_metrics import ok_record, parse, value


def test_adapter_requests_are_counted_by_lora_name() -> None:
    metrics = GatewayMetrics()
    metrics.allow_label_values(models=["llama-3.1-8b", "sql-lora"], loras=["sql-lora"])
    metrics.observe(ok_record(model="sql-lora", base_model="llama-3.1-8b"))
    metrics.observe(ok_record(model="sql-lora", status="error", http_status=502, ttft_s=None, endpoint=""))
    metrics.observe(ok_record())  # the base model: no lora_name series
    _, samples = parse(metrics)
    assert value(samples, "tokenway_lora_requests_total", lora_name="sql-lora", status="ok") == 1
    assert value(samples, "tokenway_lora_requests_total", lora_name="sql-lora", status="error") == 1
    assert value(samples, "tokenway_lora_requests_total") == 2
    assert value(samples, "tokenway_lora_tokens_total", lora_name="sql-lora", token_type="output") == 600
    assert value(samples, "tokenway_lora_time_to_first_token_seconds_count", lora_name="sql-lora") == 1


def test_lora_name_is_bounded_by_the_policy_and_the_cap() -> None:
    metrics = GatewayMetrics(MetricsConfig(labels=MetricLabelsConfig(max_values=2)))
    adapters = [f"a{i}" for i in range(5)]
    metrics.allow_label_values(models=["llama-3.1-8b", *adapters], loras=adapters)
    for name in adapters:
        metrics.observe(ok_record(model=name))
        metrics.observe_lora_event(name, "load")
    metrics.observe_lora_event("not-declared", "lost")
    _, samples = parse(metrics)
    names = {dict(labels)["lora_name"] for (n, labels) in samples if n == "tokenway_lora_requests_total"}
    assert names == {"a0", "a1", OTHER}
    assert value(samples, "tokenway_lora_requests_total", lora_name=OTHER) == 3
    assert value(samples, "tokenway_lora_adapter_events_total", lora_name=OTHER) == 4
    assert value(samples, "tokenway_lora_adapter_events_total", lora_name="a0", event="load") == 1
