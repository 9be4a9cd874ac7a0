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
                         f"sum by (model) (rate(tokenway_tokens_total{{{SEL}, token_type!=\"cached_input\"}}"
                         "[$__rate_interval]))",
                 "legend": "{{model}}"},
            ], 8),
            ("Prefix-cache hit ratio: engine-reported vs router estimate", "percentunit", [
                {"expr": f"sum by (model) (rate(tokenway_tokens_total{{{SEL}, token_type=\"cached_input\"}}"
                         f"[$__rate_interval])) / sum by (model) (rate(tokenway_tokens_total{{{SEL}, "
                         "token_type=\"input\"}[$__rate_interval]))",
                 "legend": "cached {{model}}"},
                {"expr": "sum by (pool) (rate(tokenway_prefix_cache_estimated_hit_tokens_total[$__rate_interval])) / "
                         "sum by (pool) (rate(tokenway_routing_prompt_tokens_total[$__rate_interval]))",
                 "legend": "estimated {{pool}}"},
            ], 8),
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
