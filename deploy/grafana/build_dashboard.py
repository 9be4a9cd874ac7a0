"""Generates deploy/grafana/dashboards/tokenway.json (run: python deploy/grafana/build_dashboard.py).

The dashboard is code so that its queries stay in step with gateway/telemetry's metric names;
tests/deploy/test_compose.py checks that the committed JSON equals this output and that every metric
it queries is one the gateway exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "tokenway-prometheus"}
OUT = Path(__file__).with_name("dashboards") / "tokenway.json"

SEL = 'tenant=~"$tenant", model=~"$model"'
GENAI_SEL = 'gen_ai_response_model=~"$model"'


def _quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[dict[str, str]]:
    return [
        {
            "expr": f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            "legend": f"p{int(q * 100)} {{{{{by}}}}}",
        }
        for q in qs
    ]


# (title, unit, [(expr, legend)], width) per row
ROWS: list[tuple[str, list[tuple[str, str, list[dict[str, str]], int]]]] = [
    (
        "Traffic",
        [
            ("Requests/s by status", "reqps", [
                {"expr": f"sum by (status, http_status) (rate(tokenway_requests_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{status}} {{http_status}}"},
            ], 8),
            ("Requests/s by tenant", "reqps", [
                {"expr": f"sum by (tenant) (rate(tokenway_requests_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{tenant}}"},
            ], 8),
            ("Admission outcomes/s", "reqps", [
                {"expr": f"sum by (outcome, reason) (rate(tokenway_admission_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{outcome}} {{reason}}"},
            ], 8),
        ],
    ),
    (
        "Tokens and cost",
        [
            ("Tokens/s by type", "short", [
                {"expr": f"sum by (token_type) (rate(tokenway_tokens_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{token_type}}"},
            ], 6),
            ("Tokens/s by model", "short", [
                {"expr": f"sum by (model) (rate(tokenway_tokens_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{model}}"},
            ], 6),
            ("Spend USD/hour by tenant", "currencyUSD", [
                {"expr": f"3600 * sum by (tenant) (rate(tokenway_cost_usd_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{tenant}}"},
            ], 6),
            ("Spend USD/hour by model", "currencyUSD", [
                {"expr": f"3600 * sum by (model) (rate(tokenway_cost_usd_total{{{SEL}}}[$__rate_interval]))",
                 "legend": "{{model}}"},
            ], 6),
            ("Spend over the range by tenant and model", "currencyUSD", [
                {"expr": f"sum by (tenant, model) (increase(tokenway_cost_usd_total{{{SEL}}}[$__range]))",
                 "legend": "{{tenant}} / {{model}}"},
            ], 8),
            ("Cost per million tokens by model", "currencyUSD", [
                {"expr": f"1e6 * sum by (model) (rate(tokenway_cost_usd_total{{{SEL}}}[$__rate_interval])) / "
                         f"sum by (model) (rate(tokenway_tokens_total{{{SEL}}}"
                         "[$__rate_interval]))",
                 "legend": "{{model}}"},
            ], 8),
            ("Prefix-cache hit ratio: engine-reported vs router estimate", "percentunit", [
                {"expr": f"sum by (model) (rate(tokenway_cached_input_tokens_total{{{SEL}}}"
                         f"[$__rate_interval])) / sum by (model) (rate(tokenway_tokens_total{{{SEL}, "
                         "token_type=\"input\"}[$__rate_interval]))",
                 "legend": "cached {{model}}"},
                {"expr": "sum by (pool) (rate(tokenway_prefix_cache_estimated_hit_tokens_total[$__rate_interval])) / "
                         "sum by (pool) (rate(tokenway_routing_prompt_tokens_total[$__rate_interval]))",
                 "legend": "estimated {{pool}}"},
                {"expr": "sum by (pool, tier) (rate(tokenway_prefix_cache_tier_tokens_total[$__rate_interval])) / "
                         "on (pool) group_left "
                         "sum by (pool) (rate(tokenway_routing_prompt_tokens_total[$__rate_interval]))",
                 "legend": "estimated {{pool}} from {{tier}}"},
            ], 8),
        ],
    ),
    (
        "KV cache: the supply side (docs/routing.md, KV-cache tiers)",
        [
            ("Prefill tokens not recomputed/s: real and credited", "short", [
                {"expr": "sum by (pool, measure) (rate(tokenway_prefill_tokens_saved_total[$__rate_interval]))",
                 "legend": "{{pool}} {{measure}}"},
            ], 6),
            ("Prefill GPU-seconds saved per second: router's and engines' count", "short", [
                {"expr": "sum by (pool) (rate(tokenway_prefill_gpu_seconds_saved_total[$__rate_interval]))",
                 "legend": "{{pool}} router"},
                {"expr": "sum by (pool) (rate(tokenway_prefill_engine_gpu_seconds_saved_total[$__rate_interval]))",
                 "legend": "{{pool}} engines"},
            ], 6),
            ("Prefill saved over the range (pool GPU cost)", "currencyUSD", [
                {"expr": "sum by (pool) (increase(tokenway_prefill_saved_usd_total[$__range]))",
                 "legend": "{{pool}} router"},
                {"expr": "sum by (pool) (increase(tokenway_prefill_engine_saved_usd_total[$__range]))",
                 "legend": "{{pool}} engines"},
            ], 6),
            ("KV bytes moved by link (PD transfers, lower-tier loads)", "Bps", [
                {"expr": "sum by (pool, link) (rate(tokenway_kv_bytes_moved_total[$__rate_interval]))",
                 "legend": "{{pool}} {{link}}"},
                {"expr": "sum by (pool, transfer_type) "
                         "(rate(tokenway_endpoint_kv_offload_bytes_total[$__rate_interval]))",
                 "legend": "engines' own {{pool}} {{transfer_type}}"},
            ], 6),
        ],
    ),
    (
        "Latency",
        [
            ("Time to first token", "s",
             _quantiles("gen_ai_server_time_to_first_token_seconds", "gen_ai_response_model", GENAI_SEL), 6),
            ("Time per output token", "s",
             _quantiles("gen_ai_server_time_per_output_token_seconds", "gen_ai_response_model", GENAI_SEL), 6),
            ("End-to-end request duration", "s",
             _quantiles("gen_ai_server_request_duration_seconds", "gen_ai_response_model", GENAI_SEL), 6),
            ("Gateway overhead", "s",
             _quantiles("tokenway_gateway_overhead_seconds", "outcome", ""), 6),
        ],
    ),
    (
        "Rejections, fallbacks, upstream",
        [
            ("Rejections/s by reason", "reqps", [
                {"expr": f"sum by (reason) (rate(tokenway_admission_total{{{SEL}, outcome=~\"rejected|shed\"}}"
                         "[$__rate_interval]))",
                 "legend": "{{reason}}"},
            ], 6),
            ("Fallbacks/s", "reqps", [
                {"expr": "sum by (from_model, to_model, reason) (rate(tokenway_fallbacks_total[$__rate_interval]))",
                 "legend": "{{from_model}} → {{to_model}} ({{reason}})"},
            ], 6),
            ("Upstream errors and retries/s", "reqps", [
                {"expr": "sum by (pool, kind) (rate(tokenway_upstream_errors_total[$__rate_interval]))",
                 "legend": "error {{pool}} {{kind}}"},
                {"expr": "sum by (pool) (rate(tokenway_upstream_retries_total[$__rate_interval]))",
                 "legend": "retry {{pool}}"},
            ], 6),
            ("Routing decisions/s", "reqps", [
                {"expr": "sum by (pool, reason) (rate(tokenway_routing_decisions_total[$__rate_interval]))",
                 "legend": "{{pool}} {{reason}}"},
            ], 6),
            ("Limiter headroom (remaining / limit)", "percentunit", [
                {"expr": "tokenway_limiter_remaining / tokenway_limiter_limit",
                 "legend": "{{scope}} {{id}} {{dimension}}"},
            ], 12),
            ("Budget remaining", "currencyUSD", [
                {"expr": "tokenway_budget_remaining_usd", "legend": "{{scope}} {{id}} per {{period}}"},
            ], 12),
            ("Spend drift: enforced counters vs the ledger (alert: TokenwaySpendDrift)", "percentunit", [
                {"expr": "max by (period) (tokenway_spend_drift_ratio)", "legend": "drift ratio per {{period}}"},
                {"expr": "max by (period) (tokenway_spend_drift_usd)", "legend": "drift $ per {{period}}"},
                {"expr": "max by (period) (tokenway_spend_drift_keys)", "legend": "keys past tolerance per {{period}}"},
            ], 12),
        ],
    ),
    (
        "Backends",
        [
            ("Endpoints by state", "short", [
                {"expr": "sum by (pool, state) (tokenway_endpoint_state)", "legend": "{{pool}} {{state}}"},
            ], 6),
            ("Running / waiting requests", "short", [
                {"expr": "tokenway_endpoint_running_requests", "legend": "running {{endpoint}}"},
                {"expr": "tokenway_endpoint_waiting_requests", "legend": "waiting {{endpoint}}"},
            ], 6),
            ("KV-cache usage", "percentunit", [
                {"expr": "tokenway_endpoint_kv_usage_ratio", "legend": "{{endpoint}}"},
            ], 6),
            ("Gateway in-flight", "short", [
                {"expr": "tokenway_endpoint_inflight_requests", "legend": "requests {{endpoint}}"},
                {"expr": "tokenway_endpoint_inflight_prefill_tokens", "legend": "prefill tokens {{endpoint}}"},
            ], 6),
            ("Redis round trips", "s", [
                *_quantiles("tokenway_redis_command_duration_seconds", "op", "", (0.5, 0.99)),
                {"expr": "sum by (op) (rate(tokenway_redis_errors_total[$__rate_interval]))",
                 "legend": "errors/s {{op}}"},
            ], 12),
            ("Usage ledger", "short", [
                {"expr": "rate(tokenway_ledger_written_total[$__rate_interval])", "legend": "records/s written"},
                {"expr": "tokenway_ledger_pending_records", "legend": "pending"},
                {"expr": "rate(tokenway_ledger_dropped_total[$__rate_interval])", "legend": "dropped/s"},
            ], 12),
        ],
    ),
    (
        "LoRA adapters",
        [
            ("Adapter requests/s", "reqps", [
                {"expr": "sum by (lora_name, status) (rate(tokenway_lora_requests_total[$__rate_interval]))",
                 "legend": "{{lora_name}} {{status}}"},
            ], 6),
            ("Adapter tokens/s", "short", [
                {"expr": "sum by (lora_name, token_type) (rate(tokenway_lora_tokens_total[$__rate_interval]))",
                 "legend": "{{lora_name}} {{token_type}}"},
            ], 6),
            ("Adapter time to first token (loads show here)", "s",
             _quantiles("tokenway_lora_time_to_first_token_seconds", "lora_name", "", (0.5, 0.9)), 6),
            ("Adapter loads, preloads, idle unloads, losses/s", "ops", [
                {"expr": "sum by (lora_name, event) (rate(tokenway_lora_adapter_events_total[$__rate_interval]))",
                 "legend": "{{lora_name}} {{event}}"},
            ], 6),
        ],
    ),
    (
        "Agent programs",
        [
            ("Spend/s of the top runs", "currencyUSD", [
                {"expr": "topk(10, sum by (tenant, program) "
                         "(rate(tokenway_program_cost_usd_total[$__rate_interval])))",
                 "legend": "{{tenant}} {{program}}"},
            ], 8),
            ("Calls/s of the top runs", "reqps", [
                {"expr": "topk(10, sum by (tenant, program) (rate(tokenway_program_calls_total[$__rate_interval])))",
                 "legend": "{{tenant}} {{program}}"},
            ], 8),
            ("Tokens/s of the top runs", "short", [
                {"expr": "topk(10, sum by (tenant, program, token_type) "
                         "(rate(tokenway_program_tokens_total[$__rate_interval])))",
                 "legend": "{{tenant}} {{program}} {{token_type}}"},
            ], 8),
            ("Program outcomes and reported value/s", "short", [
                {"expr": "sum by (tenant, success) (rate(tokenway_program_outcomes_total[$__rate_interval]))",
                 "legend": "{{tenant}} success={{success}}"},
                {"expr": "sum by (tenant) (rate(tokenway_program_outcome_value_total[$__rate_interval]))",
                 "legend": "value {{tenant}}"},
            ], 24),
        ],
    ),
    (
        "Request shape",
        [
            ("Tokens per request (GenAI semconv)", "short",
             _quantiles("gen_ai_client_token_usage", "gen_ai_token_type", GENAI_SEL, (0.5, 0.9, 0.99)), 24),
        ],
    ),
    (
        "Waiting room (flow control)",
        [
            ("Queue depth by band", "short", [
                {"expr": "sum by (pool, band) (tokenway_queue_depth)", "legend": "{{pool}} {{band}}"},
            ], 6),
            ("Queue wait", "s", _quantiles("tokenway_queue_wait_seconds", "pool", "", (0.5, 0.99)), 6),
            ("Fair share by tenant", "percentunit", [
                {"expr": "tokenway_fair_share_ratio", "legend": "{{pool}} {{tenant}}"},
            ], 6),
            ("Fair-share counters age", "s", [
                {"expr": "tokenway_fair_counters_age_seconds", "legend": "{{pool}} {{band}}"},
            ], 6),
        ],
    ),
    (
        "Batch",
        [
            ("Batch lines/s by outcome", "short", [
                {"expr": "sum by (outcome) (rate(tokenway_batch_lines_total[$__rate_interval]))",
                 "legend": "{{outcome}}"},
            ], 8),
            ("Batch lines deferred/s by reason", "short", [
                {"expr": "sum by (reason) (rate(tokenway_batch_deferrals_total[$__rate_interval]))",
                 "legend": "{{reason}}"},
            ], 8),
            ("Batches and lines in flight", "short", [
                {"expr": "sum by (status) (tokenway_batches)", "legend": "batches {{status}}"},
                {"expr": "sum (tokenway_batch_lines_in_flight)", "legend": "lines in flight"},
            ], 8),
        ],
    ),
    (
        "Elastic pools",
        [
            ("Replicas: running vs desired", "short", [
                {"expr": "sum by (pool, state) (tokenway_pool_replicas)", "legend": "{{pool}} {{state}}"},
                {"expr": "sum by (pool) (tokenway_pool_desired_replicas)", "legend": "desired {{pool}}"},
            ], 6),
            ("Scale events and drain timeouts", "short", [
                {"expr": "sum by (pool, direction) (increase(tokenway_pool_scale_events_total[$__rate_interval]))",
                 "legend": "{{direction}} {{pool}}"},
                {"expr": "sum by (pool) (increase(tokenway_pool_drain_timeouts_total[$__rate_interval]))",
                 "legend": "drain timeouts {{pool}}"},
            ], 6),
            ("Cold starts: held requests, wait, start-up", "s", [
                *_quantiles("tokenway_cold_start_wait_seconds", "pool", "", (0.5, 0.99)),
                {"expr": "tokenway_pool_startup_seconds", "legend": "start-up {{pool}}"},
                {"expr": "tokenway_pool_held_requests", "legend": "held {{pool}}"},
            ], 6),
            ("Stream migrations/s", "short", [
                {"expr": "sum by (pool, outcome) (rate(tokenway_stream_migrations_total[$__rate_interval]))",
                 "legend": "{{pool}} {{outcome}}"},
            ], 6),
        ],
    ),
    (
        "Predictor accuracy",
        [
            ("Live error |observed - predicted| / observed", "percentunit",
             _quantiles("tokenway_predictor_error_ratio", "target", "", (0.5, 0.9)), 8),
            ("Online MAPE and p90 coverage", "percentunit", [
                {"expr": "tokenway_predictor_ttft_mape_ratio", "legend": "TTFT MAPE {{pool}}"},
                {"expr": "tokenway_predictor_tpot_mape_ratio", "legend": "TPOT MAPE {{pool}}"},
                {"expr": "tokenway_predictor_ttft_p90_coverage_ratio", "legend": "TTFT p90 coverage {{pool}}"},
                {"expr": "tokenway_predictor_tpot_p90_coverage_ratio", "legend": "TPOT p90 coverage {{pool}}"},
            ], 8),
            ("Models: version, age, samples", "short", [
                {"expr": "tokenway_predictor_model_version", "legend": "version {{pool}}"},
                {"expr": "tokenway_predictor_ttft_model_age_seconds", "legend": "TTFT age s {{pool}}"},
                {"expr": "tokenway_predictor_tpot_model_age_seconds", "legend": "TPOT age s {{pool}}"},
                {"expr": "tokenway_predictor_ttft_samples", "legend": "TTFT samples {{pool}}"},
                {"expr": "tokenway_predictor_tpot_samples", "legend": "TPOT samples {{pool}}"},
                {"expr": "tokenway_predictor_ttft_model", "legend": "TTFT learned {{pool}}"},
                {"expr": "tokenway_predictor_tpot_model", "legend": "TPOT learned {{pool}}"},
            ], 8),
        ],
    ),
    (
        "Engines and budgets",
        [
            ("Replica restarts and passive-health failures", "short", [
                {"expr": "sum by (pool, endpoint) (increase(tokenway_endpoint_restarts_total[$__rate_interval]))",
                 "legend": "restarts {{endpoint}}"},
                {"expr": "tokenway_endpoint_consecutive_failures", "legend": "failures in a row {{endpoint}}"},
            ], 6),
            ("Engine prefix-cache hit ratio and stats age", "short", [
                {"expr": "sum by (pool) (rate(tokenway_endpoint_prefix_cache_hits_tokens_total[$__rate_interval])) / "
                         "sum by (pool) (rate(tokenway_endpoint_prefix_cache_queries_tokens_total[$__rate_interval]))",
                 "legend": "hit ratio {{pool}}"},
                {"expr": "tokenway_endpoint_stats_age_seconds", "legend": "stats age s {{endpoint}}"},
                {"expr": "tokenway_endpoint_inflight_decode_tokens", "legend": "decode tokens {{endpoint}}"},
            ], 6),
            ("Budget used this period", "percentunit", [
                {"expr": "1 - tokenway_budget_remaining_usd / tokenway_budget_limit_usd",
                 "legend": "{{scope}} {{id}} per {{period}}"},
            ], 6),
            ("Telemetry health", "short", [
                {"expr": "sum by (label) (tokenway_telemetry_label_overflow_total)", "legend": "folded {{label}}"},
                {"expr": "sum by (source) (tokenway_telemetry_source_errors_total)", "legend": "errors {{source}}"},
                {"expr": "count by (version) (tokenway_build_info)", "legend": "gateways on {{version}}"},
            ], 6),
        ],
    ),
]  # fmt: skip


def _panel(
    panel_id: int, title: str, unit: str, targets: list[dict[str, str]], x: int, y: int, w: int
) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 10}}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t["expr"], "legendFormat": t["legend"]}
            for i, t in enumerate(targets)
        ],
    }


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        next_id, y, x = next_id + 1, y + 1, 0
        for title, unit, targets, width in row_panels:
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(_panel(next_id, title, unit, targets, x, y, width))
            next_id, x = next_id + 1, x + width
        y += 8
    return {
        "uid": "tokenway-overview",
        "title": "tokenway",
        "description": "Traffic, tokens, cost, latency, rejections and backend load of the tokenway gateway.",
        "tags": ["tokenway", "llm", "gateway"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                _variable("tenant", "label_values(tokenway_requests_total, tenant)"),
                _variable("model", "label_values(tokenway_requests_total, model)"),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUT}")
