"""`bench/results/replay.md` and the TTFT CDF plot from one run's summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.replay.stats import TTFT_GOOD_S, RunSummary

TOKENWAY = ("tokenway-approx", "tokenway-precise")
NOTES_PATH = Path(__file__).with_name("NOTES.md")


def _f(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:,.{digits}f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def table(runs: Sequence[RunSummary]) -> list[str]:
    lines = [
        "| load | router | TTFT p50 | p90 | p99 | client TTFT p50 | p90 | p99 | TPOT p50 | p90 | queue p90 | "
        "throughput | out tok/s | cache hit | TTFT ≤ 2 s | ok |",
        "| ---: | --- " + "| ---: " * 14 + "|",
    ]
    lines.extend(
        f"| {r.load:.0%} | {r.router} | {_f(r.ttft_p50_s)} | {_f(r.ttft_p90_s)} | {_f(r.ttft_p99_s)} | "
        f"{_f(r.client_ttft_p50_s)} | {_f(r.client_ttft_p90_s)} | {_f(r.client_ttft_p99_s)} | "
        f"{_f(r.tpot_p50_ms, 1)} | {_f(r.tpot_p90_ms, 1)} | {_f(r.queue_p90_s)} | {_f(r.throughput_rps)} | "
        f"{_f(r.output_tps, 0)} | "
        f"{_pct(r.cache_hit_rate)} | {_pct(r.ttft_good_share)} | {r.ok}/{r.requests} |"
        for r in runs
    )
    return lines


def target_check(runs: Sequence[RunSummary], trace: str = "mooncake", load: float = 0.8) -> list[str]:
    """The issue's targets at 80 % load, measured on engine TTFT p90 and engine cache hit rates."""
    at = {r.router: r for r in runs if r.trace == trace and abs(r.load - load) < 1e-9}
    if not at:
        return [f"No {trace} run at {load:.0%} load: targets not evaluated."]
    best_hit = max(r.cache_hit_rate for r in at.values())
    rr = at.get("round-robin")
    cache = at.get("vllm-router-cache")
    lines = [
        f"Targets at {load:.0%} load ({trace}; engine TTFT p90; hit rate relative to the best router's "
        f"{_pct(best_hit)}):",
        "",
        "| router | TTFT p90 | vs round-robin | vs vllm-router cache_aware | cache hit (share of best) | targets |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in TOKENWAY:
        r = at.get(name)
        if r is None:
            continue
        vs_rr = rr.ttft_p90_s / r.ttft_p90_s if rr and r.ttft_p90_s > 0 else float("nan")
        vs_cache = cache.ttft_p90_s / r.ttft_p90_s if cache and r.ttft_p90_s > 0 else float("nan")
        share = r.cache_hit_rate / best_hit if best_hit > 0 else float("nan")
        checks = [
            ("≥ 2x lower than round-robin", not math.isnan(vs_rr) and vs_rr >= 2.0),
            ("lower than cache_aware", not math.isnan(vs_cache) and vs_cache > 1.0),
            ("hit rate within 10 % of best", not math.isnan(share) and share >= 0.9),
        ]
        verdict = "; ".join(f"{'met' if ok else 'MISSED'}: {what}" for what, ok in checks)
        lines.append(
            f"| {name} | {_f(r.ttft_p90_s)} s | {_f(vs_rr)}x lower | {_f(vs_cache)}x lower | "
            f"{_pct(share)} | {verdict} |"
        )
    return lines


def host_lines(meta: dict[str, Any], runs: Sequence[RunSummary]) -> list[str]:
    """How hard the host worked: whole-host CPU busy share and client send lag per replay, and the CPU
    seconds of the three kinds of process (engines, router, load generator) per router."""
    if not runs:
        return []
    busy = sorted(r.host_cpu_busy for r in runs if not math.isnan(r.host_cpu_busy))
    lag_ms = max(r.max_client_lag_s for r in runs) * 1000
    lines = ["### Host load", ""]
    if busy:
        cpus = meta["host"].split(",")[1].strip()
        lines.append(
            f"Whole-host CPU busy during a replay (every process on the machine, {cpus}): median "
            f"{busy[len(busy) // 2]:.0%}, range {busy[0]:.0%} to {busy[-1]:.0%}. The load generator sent every "
            f"request within {lag_ms:.0f} ms of its schedule."
        )
    per_router: dict[str, list[float]] = {}
    for entry in meta.get("cpu", []):
        name = entry["label"].rsplit(" ", 1)[-1]
        if entry["label"].startswith("capacity"):
            continue
        sums = per_router.setdefault(name, [0.0, 0.0, 0.0])
        sums[0] += entry["engines_cpu_s"]
        sums[1] += entry["router_cpu_s"]
        sums[2] += entry["loadgen_cpu_s"]
    if per_router:
        lines += [
            "",
            "CPU seconds over all replays of a router (real seconds of one core):",
            "",
            "| router | engines (sim process) | router process | load generator |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [f"| {k} | {v[0]:.0f} | {v[1]:.0f} | {v[2]:.0f} |" for k, v in per_router.items()]
    lines.append("")
    return lines


def markdown(meta: dict[str, Any], runs: Sequence[RunSummary], plot_name: str | None) -> str:
    scale = ", ".join(f"{v:g}x ({k})" for k, v in meta["time_scales"].items())
    lines = [
        "# Trace replay: routers on one simulated fleet",
        "",
        f"Generated by `bench/replay/run.py` on {meta['when']} ({meta['host']}) in "
        f"{meta['elapsed_s'] / 60:.1f} min. Fleet: {meta['engines']} simulated `{meta['preset']}` engines in one "
        f"`sim` process (vLLM V1 scheduling, prefix caching, KV events on), simulated clock at "
        f"{scale} real time. Every router replays the same requests at the same arrival times, one after "
        "another, each through a freshly started router process, with the engines' prefix caches emptied "
        "(`POST /reset_prefix_cache`) before each replay.",
        "",
        "**Units.** TTFT, TPOT and throughput are in *simulated* seconds. `TTFT` / `TPOT` columns are what "
        "the engines measured (the `metrics` object of each response: arrival at the engine to first token; "
        "host CPU delays excluded) — the primary numbers. `client TTFT` is what the load generator saw, in "
        f"real seconds x the time scale (includes the router, loopback HTTP and any host CPU contention). "
        f"Cache hit = the engines' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` (tokens) "
        f"over the replay. `TTFT ≤ 2 s` = share of all requests with engine TTFT ≤ {TTFT_GOOD_S:g} s. "
        "`queue p90` = engine-reported time from arrival to first scheduling (simulated s). TPOT in ms.",
        "",
        "## Workloads",
        "",
    ]
    for name, w in meta["workloads"].items():
        cap = meta["capacities"].get(name, {})
        lines.append(
            f"- **{name}** — {w['description']}: {w['requests']} requests, mean prompt {w['mean_prompt_tokens']:,.0f} "
            f"tokens, mean output {w['mean_output_tokens']:,.0f} tokens, infinite-cache block hit ratio "
            f"{_pct(w['infinite_cache_hit_ratio'])}; trace span {w['trace_span_s']:,.0f} s compressed to the "
            f"offered rate. Capacity (least-load, burst): {_f(cap.get('capacity_rps', float('nan')))} req/s "
            f"(simulated); loads {', '.join(f'{x:.0%}' for x in w['loads'])}."
        )
    lines += ["", "Routers:", ""]
    lines += [f"- `{r['name']}` — {r['note']}" for r in meta["routers"]]
    lines += ["", "## Results", ""]
    for trace in dict.fromkeys(r.trace for r in runs):
        rows = [r for r in runs if r.trace == trace]
        offered = {r.load: r.offered_rps for r in rows}
        lines += [
            f"### {trace}",
            "",
            "Offered: " + ", ".join(f"{load:.0%} = {rps:.2f} req/s" for load, rps in offered.items()) + ".",
            "",
        ]
        lines += table(rows)
        lines.append("")
    lines += host_lines(meta, runs)
    lines += ["## Targets", ""]
    lines += target_check(runs)
    lines.append("")
    if plot_name:
        lines += [f"![TTFT CDF per router]({plot_name})", ""]
    if NOTES_PATH.exists():
        lines += [NOTES_PATH.read_text().strip(), ""]
    argv = list(meta["argv"])
    if "--workdir" in argv:  # a local path: not part of the recipe
        i = argv.index("--workdir")
        del argv[i : i + 2]
    lines += [
        "## Reproduce",
        "",
        "```",
        "python3 -m venv bench/.venv-vllm-router && bench/.venv-vllm-router/bin/pip install vllm-router",
        f".venv/bin/python -m bench.replay.run {' '.join(argv)} --workdir DIR".replace("  ", " "),
        ".venv/bin/python -m bench.replay.run --report-only --workdir DIR   # rewrite this report from DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def plot_cdfs(outcomes_by_run: dict[str, list[dict[str, Any]]], runs: Sequence[RunSummary], path: Path) -> bool:
    """One panel per (trace, load): the CDF of engine TTFT for each router."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = list(dict.fromkeys((r.trace, r.load) for r in runs))
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (trace, load) in zip(axes.flat, panels, strict=False):
        for r in runs:
            if (r.trace, r.load) != (trace, load):
                continue
            outcomes = outcomes_by_run.get(f"{trace} {load:.0%} {r.router}", [])
            values = sorted(max(o["engine"].get("ttft_s", 0.0), 1e-3) for o in outcomes if o["ok"])
            if not values:
                continue
            ys = [(i + 1) / len(outcomes) for i in range(len(values))]
            style = "-" if r.router.startswith("tokenway") else "--"
            ax.step(values, ys, where="post", linestyle=style, label=r.router, linewidth=1.4)
        ax.axvline(TTFT_GOOD_S, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.0)
        ax.set_xlabel("engine TTFT (simulated s, log)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{trace} at {load:.0%} of capacity")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
