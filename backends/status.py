"""What operators see of the fleet: `GET /admin/backends` (JSON) and `tokenway pools status` (a table).

`fleet_status` is a plain snapshot (no I/O: log tails were captured when a replica failed), so the
admin route can call it on the event loop; `format_status` renders the same dict, so the CLI can
print what it fetched from a running gateway.
"""

from __future__ import annotations

import time
from typing import Any

from backends.fleet import Fleet
from backends.scrape import is_stale
from backends.types import Endpoint, EndpointState


def endpoint_status(endpoint: Endpoint, now_s: float, stats_max_age_s: float) -> dict[str, Any]:
    age_s = endpoint.stats_age_s(now_s)
    stats = endpoint.stats
    item: dict[str, Any] = {
        "id": endpoint.id,
        "url": endpoint.base_url,
        "engine": endpoint.engine,
        "served_model": endpoint.served_model,
        "role": endpoint.role.value,
        "state": endpoint.state.value,
        "reason": endpoint.state_reason or None,
        "launched": endpoint.launched,
        "restarts": endpoint.restarts,
        "devices": list(endpoint.devices),
        "pid": endpoint.pid,
        # Kept flat for dashboards and the existing admin shape.
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_usage_ratio": round(stats.kv_usage_ratio, 4),
        "stats_age_s": None if age_s == float("inf") else round(age_s, 3),
        "stats_stale": is_stale(endpoint, now_s, stats_max_age_s),
        "prefix_cache_hits_tokens": stats.prefix_cache_hits_tokens,
        "prefix_cache_queries_tokens": stats.prefix_cache_queries_tokens,
        "preemptions": stats.preemptions,
        "block_size": stats.block_size,
        "num_gpu_blocks": stats.num_gpu_blocks,
        "waiting_by_reason": dict(stats.waiting_by_reason),
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_cached": stats.prompt_tokens_cached,
        "sleep_state": stats.sleep_state,
        # LoRA adapters the engine lists in /v1/models (backends/lora_discovery.py); null: not asked
        "loras": sorted(endpoint.loras) if endpoint.loras is not None else None,
        "inflight_requests": endpoint.inflight.requests,
        "inflight_prefill_tokens": endpoint.inflight.prefill_tokens,
        "inflight_decode_tokens": endpoint.inflight.decode_tokens,
        "consecutive_failures": endpoint.consecutive_failures,
        "ejected_for_s": round(max(0.0, endpoint.ejected_until_s - now_s), 3)
        if endpoint.state is EndpointState.UNHEALTHY
        else None,
        "log_path": endpoint.log_path,
    }
    if endpoint.log_tail:
        item["log_tail"] = list(endpoint.log_tail)
    return item


def fleet_status(fleet: Fleet, now_s: float | None = None, stats_max_age_s: float = 2.0) -> dict[str, Any]:
    """JSON-ready snapshot: pools, endpoints, state and reason, load, KV usage, restarts."""
    now_s = time.monotonic() if now_s is None else now_s
    pools = []
    for pool in fleet.pools.values():
        endpoints = [endpoint_status(e, now_s, stats_max_age_s) for e in pool.endpoints]
        states: dict[str, int] = {}
        for e in pool.endpoints:
            states[e.state.value] = states.get(e.state.value, 0) + 1
        pools.append(
            {
                "name": pool.name,
                "model": pool.config.model,
                "engine": pool.config.engine,
                "disaggregated": pool.config.disaggregated,
                "ready": sum(1 for e in pool.endpoints if e.state is EndpointState.READY),
                "total": len(pool.endpoints),
                "states": states,
                "endpoints": endpoints,
            }
        )
    return {"pools": pools}


_COLUMNS = ("endpoint", "state", "run", "wait", "kv", "inflight", "restarts", "stats_age", "url")


def format_status(status: dict[str, Any], show_log_tail: bool = True) -> str:
    """A fixed-width table of `fleet_status` output, reasons and log tails under failed endpoints."""
    lines: list[str] = []
    for pool in status.get("pools", []):
        lines.append(
            f"pool {pool['name']} (model {pool['model']}, engine {pool['engine']}): "
            f"{pool['ready']}/{pool['total']} ready"
        )
        rows = [_COLUMNS]
        notes: dict[int, list[str]] = {}
        for e in pool["endpoints"]:
            age = e.get("stats_age_s")
            rows.append(
                (
                    e["id"],
                    e["state"] + ("*" if e.get("stats_stale") and e["state"] == "ready" else ""),
                    str(e.get("running", 0)),
                    str(e.get("waiting", 0)),
                    f"{100 * (e.get('kv_usage_ratio') or 0.0):.0f}%",
                    str(e.get("inflight_requests", 0)),
                    str(e.get("restarts", 0)),
                    "-" if age is None else f"{age:.1f}s",
                    e.get("url", ""),
                )
            )
            extra = []
            if e.get("reason"):
                extra.append(f"reason: {e['reason']}")
            if show_log_tail and e.get("log_tail"):
                extra.append(f"last log lines ({e.get('log_path')}):")
                extra += [f"  | {line}" for line in e["log_tail"]]
            if extra:
                notes[len(rows) - 1] = extra
        widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
        for n, row in enumerate(rows):
            lines.append("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
            lines += [f"      {note}" for note in notes.get(n, [])]
        lines.append("")
    if any(e.get("stats_stale") and e["state"] == "ready" for p in status.get("pools", []) for e in p["endpoints"]):
        lines.append("* stats stale: routing treats the endpoint as saturated")
    return "\n".join(lines).rstrip() + "\n"
