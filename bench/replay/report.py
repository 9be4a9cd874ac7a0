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


# The peers issue 42 measures tokenway's default against: the cache-aware routers of other projects.
PEERS = ("vllm-router-cache", "vllm-router-kv", "llm-d-sticky")
TARGET_RATIO = 0.7  # tokenway's p90 TTFT at most this share of the best peer's


def table(runs: Sequence[RunSummary], *, seeds: bool = False) -> list[str]:
    head = "| load | router | seed " if seeds else "| load | router "
    lines = [
        head + "| TTFT p50 | p90 | p99 | client TTFT p50 | p90 | p99 | TPOT p50 | p90 | queue p90 | "
        "throughput | out tok/s | cache hit | TTFT ≤ 2 s | ok |",
        "| ---: | --- " + ("| ---: " if seeds else "") + "| ---: " * 14 + "|",
    ]
    lines.extend(
        f"| {r.load:.0%} | {r.router} | " + (f"{r.seed} | " if seeds else "") + f"{_f(r.ttft_p50_s)} | "
        f"{_f(r.ttft_p90_s)} | {_f(r.ttft_p99_s)} | "
        f"{_f(r.client_ttft_p50_s)} | {_f(r.client_ttft_p90_s)} | {_f(r.client_ttft_p99_s)} | "
        f"{_f(r.tpot_p50_ms, 1)} | {_f(r.tpot_p90_ms, 1)} | {_f(r.queue_p90_s)} | {_f(r.throughput_rps)} | "
        f"{_f(r.output_tps, 0)} | "
        f"{_pct(r.cache_hit_rate)} | {_pct(r.ttft_good_share)} | {r.ok}/{r.requests} |"
        for r in runs
    )
    return lines


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def by_router(runs: Sequence[RunSummary], trace: str, load: float) -> dict[str, list[RunSummary]]:
    """The runs of one (trace, load) per router, in seed order."""
    out: dict[str, list[RunSummary]] = {}
    for r in sorted((r for r in runs if r.trace == trace and abs(r.load - load) < 1e-9), key=lambda r: r.seed):
        out.setdefault(r.router, []).append(r)
    return out


def rounds_table(runs: Sequence[RunSummary], trace: str, load: float) -> list[str]:
    """p90 TTFT and cache hit per round and their mean; the spread between rounds is the noise."""
    groups = by_router(runs, trace, load)
    seeds = sorted({r.seed for rs in groups.values() for r in rs})
    lines = [
        "| router | "
        + " | ".join(f"p90 s{s}" for s in seeds)
        + " | p90 mean | spread | "
        + " | ".join(f"hit s{s}" for s in seeds)
        + " | hit mean |",
        "| --- " + "| ---: " * (2 * len(seeds) + 3) + "|",
    ]
    for name, rs in groups.items():
        p90 = {r.seed: r.ttft_p90_s for r in rs}
        hit = {r.seed: r.cache_hit_rate for r in rs}
        mean = _mean(list(p90.values()))
        spread = (max(p90.values()) - min(p90.values())) / mean if len(p90) > 1 and mean > 0 else float("nan")
        lines.append(
            f"| {name} | " + " | ".join(_f(p90.get(s, float("nan"))) for s in seeds) + f" | {_f(mean)} | "
            f"{_pct(spread)} | "
            + " | ".join(_pct(hit.get(s, float("nan"))) for s in seeds)
            + f" | {_pct(_mean(list(hit.values())))} |"
        )
    return lines


def target_check(runs: Sequence[RunSummary], trace: str, load: float = 0.8) -> list[str]:
    """Issue 42's target at 80 % load: tokenway's p90 TTFT <= 0.7x the best peer's (the peer with the
    lowest mean p90 over the rounds), with a cache hit rate >= that peer's; engine-side numbers."""
    groups = by_router(runs, trace, load)
    peers = {name: rs for name, rs in groups.items() if name in PEERS}
    if not peers:
        return [f"No peer ran on {trace} at {load:.0%} load: target not evaluated."]
    best = min(peers, key=lambda n: _mean([r.ttft_p90_s for r in peers[n]]))
    best_p90 = {r.seed: r.ttft_p90_s for r in peers[best]}
    best_hit = _mean([r.cache_hit_rate for r in peers[best]])
    rr = groups.get("round-robin", [])
    rr_p90 = _mean([r.ttft_p90_s for r in rr])
    lines = [
        f"**{trace}** at {load:.0%}: best peer `{best}` (mean p90 {_f(_mean(list(best_p90.values())))} s, "
        f"cache hit {_pct(best_hit)}).",
        "",
        "| router | p90 mean | ÷ best peer (mean) | ÷ best peer per round | vs round-robin | cache hit | target |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for name in TOKENWAY:
        rs = groups.get(name)
        if not rs:
            continue
        p90 = _mean([r.ttft_p90_s for r in rs])
        ratio = p90 / _mean(list(best_p90.values()))
        per_round = ", ".join(
            f"{r.ttft_p90_s / best_p90[r.seed]:.2f}" for r in rs if r.seed in best_p90 and best_p90[r.seed] > 0
        )
        hit = _mean([r.cache_hit_rate for r in rs])
        checks = [
            (f"p90 ≤ {TARGET_RATIO:g}x best peer", ratio <= TARGET_RATIO),
            ("hit ≥ best peer's", hit >= best_hit),
        ]
        verdict = "; ".join(f"{'met' if ok else 'MISSED'}: {what}" for what, ok in checks)
        lines.append(
            f"| {name} | {_f(p90)} s | {_f(ratio)} | {per_round} | {_f(rr_p90 / p90 if p90 > 0 else float('nan'))}x "
            f"lower | {_pct(hit)} | {verdict} |"
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
            f"(simulated); loads {', '.join(f'{x:.0%}' for x in w['loads'])}. No-queue TTFT floor p90: "
            f"{_f(w.get('ttft_floor_p90_s', float('nan')))} s (every block seen earlier a hit, each request "
            "alone on an idle engine: no router can go below it)."
        )
    lines += ["", "Routers:", ""]
    lines += [f"- `{r['name']}` — {r['note']}" for r in meta["routers"]]
    lines += ["", "## Results", ""]
    multi = len({r.seed for r in runs}) > 1
    order = {name: i for i, name in enumerate(r["name"] for r in meta["routers"])}
    for trace in dict.fromkeys(r.trace for r in runs):
        rows = sorted((r for r in runs if r.trace == trace), key=lambda r: (r.load, order.get(r.router, 99), r.seed))
        offered = {(r.load, r.seed): r.offered_rps for r in rows}
        lines += [
            f"### {trace}",
            "",
            "Offered: "
            + ", ".join(
                f"{load:.0%} = {rps:.2f} req/s" + (f" (seed {seed})" if multi else "")
                for (load, seed), rps in offered.items()
            )
            + ".",
            "",
        ]
        lines += table(rows, seeds=multi)
        lines.append("")
        if multi:
            for load in dict.fromkeys(r.load for r in rows):
                lines += [f"Per round at {load:.0%} (engine TTFT p90 in s; spread = (max - min) / mean):", ""]
                lines += rounds_table(rows, trace, load)
                lines.append("")
    lines += host_lines(meta, runs)
    lines += ["## Targets", ""]
    for trace in dict.fromkeys(r.trace for r in runs):
        for load in dict.fromkeys(r.load for r in runs if r.trace == trace):
            lines += target_check(runs, trace, load)
            lines.append("")
    if plot_name:
        lines += [f"![TTFT CDF per router]({plot_name})", ""]
    if NOTES_PATH.exists():
        lines += [NOTES_PATH.read_text().strip(), ""]
    argv = list(meta["argv"])
    for flag in ("--workdir", "--out", "--traces"):  # local paths: not part of the recipe
        if flag in argv:
            i = argv.index(flag)
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


def plot_cdfs(
    outcomes_by_run: dict[tuple[str, float, str, int], list[dict[str, Any]]], runs: Sequence[RunSummary], path: Path
) -> bool:
    """One panel per (trace, load): the CDF of engine TTFT for each router, its rounds pooled."""
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
        for router in dict.fromkeys(r.router for r in runs if (r.trace, r.load) == (trace, load)):
            outcomes = [
                o
                for (t, x, name, _), rs in outcomes_by_run.items()
                if (t, x, name) == (trace, load, router)
                for o in rs
            ]
            values = sorted(max(o["engine"].get("ttft_s", 0.0), 1e-3) for o in outcomes if o["ok"])
            if not values:
                continue
            ys = [(i + 1) / len(outcomes) for i in range(len(values))]
            style = "-" if router.startswith("tokenway") else "--"
            ax.step(values, ys, where="post", linestyle=style, label=router, linewidth=1.4)
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
