"""The sim-speed benchmark's report: one run's marks and results summarized (CPU per token and per
step, clock lag, client-side excess latency, busy cores), medians of repeated runs, and the markdown
table that sets runs side by side.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.sim_speed.client import Result


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(
    args: argparse.Namespace, before: dict[str, Any], after: dict[str, Any], results: list[Result], client_cpu_s: float
) -> dict[str, Any]:
    wall = after["wall_s"] - before["wall_s"]
    cpu = after["cpu_s"] - before["cpu_s"]
    scale = args.time_scale
    tokens = sum(
        b["generation_tokens"] - a["generation_tokens"]
        for a, b in zip(before["engines"], after["engines"], strict=True)
    )
    steps = sum(b["steps"] - a["steps"] for a, b in zip(before["engines"], after["engines"], strict=True))
    lags = [
        ((wall * scale) - (b["sim_now_s"] - a["sim_now_s"])) / scale
        for a, b in zip(before["engines"], after["engines"], strict=True)
    ]
    ok = [r for r in results if r.ok]
    cores = [round((b - a) / wall, 3) for a, b in zip(before["cores_busy_s"], after["cores_busy_s"], strict=True)]
    excess_ttft = [(r.wall_ttft_s - r.sim_ttft_s / scale) * 1e3 for r in ok]
    excess_e2e = [(r.wall_e2e_s - r.sim_e2e_s / scale) * 1e3 for r in ok]
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "compare", "profile")},
        "sim": args.sim_path,
        "wall_s": round(wall, 3),
        "requests": len(results),
        "failed": len(results) - len(ok),
        "generated_tokens": int(tokens),
        "client_tokens": sum(r.completion_tokens for r in ok),
        "steps": int(steps),
        "engine_cpu_s": round(cpu, 3),
        "engine_cpu_util": round(cpu / wall, 3) if wall else 0.0,
        "client_cpu_s": round(client_cpu_s, 3),
        "cores_busy": cores,
        # CPU that neither the fleet nor this client used (other processes, kernel): a noisy-run flag
        "foreign_cores": round(sum(cores) - cpu / wall - client_cpu_s / wall, 3) if cores and wall else 0.0,
        "tokens_per_wall_s": round(tokens / wall, 1) if wall else 0.0,
        "cpu_ms_per_1k_tokens": round(cpu * 1e3 / tokens * 1e3, 2) if tokens else float("nan"),
        "cpu_ms_per_request": round(cpu * 1e3 / len(ok), 3) if ok else float("nan"),
        "cpu_us_per_step": round(cpu * 1e6 / steps, 1) if steps else float("nan"),
        "gc_collections_per_s": round((after.get("gc_collections", 0) - before.get("gc_collections", 0)) / wall, 1)
        if wall
        else 0.0,
        "lag_ms_per_wall_s_mean": round(statistics.fmean(lags) / wall * 1e3, 1) if wall else 0.0,
        "lag_ms_per_wall_s_max": round(max(lags) / wall * 1e3, 1) if wall else 0.0,
        "excess_ttft_ms": {f"p{q}": round(_percentile(excess_ttft, q / 100), 2) for q in (50, 90, 99)},
        "excess_e2e_ms": {f"p{q}": round(_percentile(excess_e2e, q / 100), 2) for q in (50, 90, 99)},
        "sim_ttft_ms_p50": round(_percentile([r.sim_ttft_s * 1e3 for r in ok], 0.5), 2),
        "sim_tpot_ms_p50": round(_percentile([r.sim_tpot_s * 1e3 for r in ok], 0.5), 3),
        "max_concurrency_est": round(sum(r.wall_e2e_s for r in ok) / wall, 1) if wall else 0.0,
    }


ROWS = (
    ("requests", "requests"),
    ("generated_tokens", "generated tokens"),
    ("wall_s", "window (wall s)"),
    ("tokens_per_wall_s", "tokens / wall s"),
    ("max_concurrency_est", "mean concurrent streams"),
    ("engine_cpu_util", "fleet CPU (cores)"),
    ("cpu_ms_per_1k_tokens", "CPU ms / 1k tokens"),
    ("cpu_ms_per_request", "CPU ms / request"),
    ("cpu_us_per_step", "CPU us / engine step"),
    ("gc_collections_per_s", "GC collections / s"),
    ("lag_ms_per_wall_s_mean", "clock lag ms / wall s (mean)"),
    ("lag_ms_per_wall_s_max", "clock lag ms / wall s (max)"),
    ("excess_ttft_ms.p50", "client excess TTFT p50 ms"),
    ("excess_ttft_ms.p99", "client excess TTFT p99 ms"),
    ("excess_e2e_ms.p50", "client excess e2e p50 ms"),
    ("excess_e2e_ms.p99", "client excess e2e p99 ms"),
    ("sim_ttft_ms_p50", "simulated TTFT p50 ms"),
    ("sim_tpot_ms_p50", "simulated TPOT p50 ms"),
    ("client_cpu_s", "client CPU s"),
    ("cores_busy", "busy fraction of each core (fleet on 0)"),
    ("foreign_cores", "other CPU use (cores; should be ~0)"),
)


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if part not in data:
            return "-"
        data = data[part]
    return data


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| metric | " + " | ".join(name for name, _ in runs) + " |", "| --- |" + " ---: |" * len(runs)]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(str(_get(data, key)) for _, data in runs) + " |")
    if len(runs) == 2:
        a, b = runs[0][1]["cpu_ms_per_1k_tokens"], runs[1][1]["cpu_ms_per_1k_tokens"]
        lines.append(f"\nCPU per generated token: {a / b:.2f}x less in `{runs[1][0]}` than in `{runs[0][0]}`")
    return "\n".join(lines)


def median(values: list[Any]) -> Any:
    """Element-wise median of summaries (numbers, lists of numbers and dicts of those)."""
    first = values[0]
    if isinstance(first, dict):
        return {key: median([v[key] for v in values]) for key in first}
    if isinstance(first, bool) or not isinstance(first, int | float | list):
        return first
    if isinstance(first, list):
        return [median([v[i] for v in values]) for i in range(len(first))] if first else []
    return round(statistics.median(values), 3)
