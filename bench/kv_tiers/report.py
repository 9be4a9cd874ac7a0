"""The markdown table and PNG plot of a kv_tiers run: per variant, the mean over seeds and the spread."""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.kv_tiers.run import VARIANTS, FleetSpec, Outcome, pct
from bench.notes import section


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, sd


def render(
    args: argparse.Namespace,
    spec: FleetSpec,
    outcomes: list[Outcome],
    rates: dict[int, float],
    floors: dict[int, float],
    elapsed: float,
) -> tuple[str, Callable[[Path], None]]:
    by_variant = {v: [o for o in outcomes if o.variant == v] for v in VARIANTS}
    seeds = sorted({o.seed for o in outcomes})
    p90 = {v: [pct(o.ttft_s, 0.9) for o in runs] for v, runs in by_variant.items()}
    lines = [
        "# KV tiers: routing with a host-DRAM tier below HBM and a shared store",
        "",
        f"`python -m bench.kv_tiers` ({'quick' if args.quick else 'full'} run, {elapsed:.0f} s on "
        f"{platform.python_implementation()} {platform.python_version()}). {spec.engines} simulated "
        f"llama-3.1-8b@h100 engines in process (discrete events on one virtual clock: no host noise), "
        f"HBM {spec.hbm_blocks * 16:,} tokens and host DRAM {spec.dram_blocks * 16:,} tokens each, "
        f"DRAM over PCIe at {spec.dram_bandwidth / 1e9:g} GB/s; `+store`: a store shared by the engines, "
        f"{spec.store_blocks * 16:,} tokens at {spec.store_bandwidth / 1e9:g} GB/s and "
        f"{spec.store_latency_s * 1e3:g} ms per load, written on {spec.store_write}; Mooncake conversation "
        f"trace, whole conversations (~{args.requests} requests per seed, prompts <= {args.max_input:,} "
        f"tokens), arrivals at {args.load:.0%} of the fleet's burst capacity "
        f"({', '.join(f'seed {s}: {rates[s]:.2f} req/s' for s in seeds)}). Precise prefix index fed the "
        "engines' KV events (medium GPU / CPU) and the store's (medium STORE), except `approximate+store` "
        "(no events). Mean over seeds, ± the standard deviation across seeds.",
        "",
        "| variant | p50 TTFT (s) | p90 TTFT (s) | p90 vs gpu-only | hit rate | oracle hit rate | hit / oracle "
        "| tokens from HBM | tokens loaded from DRAM | tokens loaded from the store |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = statistics.fmean(p90["gpu-only"]) if p90["gpu-only"] else 0.0
    for v, runs in by_variant.items():
        if not runs:
            continue
        p50m, p50s = _mean_sd([pct(o.ttft_s, 0.5) for o in runs])
        p90m, p90s = _mean_sd(p90[v])
        same_seeds = len(p90["gpu-only"]) == len(p90[v])
        ratios = [g / x for g, x in zip(p90["gpu-only"], p90[v], strict=True) if x > 0] if same_seeds else []
        rm, rs = _mean_sd(ratios) if ratios else (0.0, 0.0)
        hit = [o.hit_tokens / o.prompt_tokens for o in runs]
        oracle = [o.oracle_tokens / o.prompt_tokens for o in runs]
        of_oracle = [o.hit_tokens / o.oracle_tokens for o in runs if o.oracle_tokens]
        hm, hs = _mean_sd(hit)
        om, _ = _mean_sd(oracle)
        fm, fs = _mean_sd(of_oracle) if of_oracle else (0.0, 0.0)
        gpu = statistics.fmean(o.gpu_hit_tokens for o in runs)
        dram = statistics.fmean(o.loaded_tokens for o in runs)
        shared = statistics.fmean(o.store_tokens for o in runs)
        lines.append(
            f"| {v} | {p50m:.3f} ± {p50s:.3f} | {p90m:.3f} ± {p90s:.3f} | {rm:.2f}x ± {rs:.2f} | "
            f"{hm:.1%} ± {hs:.1%} | {om:.1%} | {fm:.0%} ± {fs:.0%} | {gpu:,.0f} | {dram:,.0f} | {shared:,.0f} |"
        )
    lines += [
        "",
        "Per seed, p90 TTFT (s): "
        + "; ".join(f"{v} " + ", ".join(f"{x:.3f}" for x in p90[v]) for v in VARIANTS if p90[v]),
        "",
    ]
    gpu_runs = {o.seed: pct(o.ttft_s, 0.9) for o in by_variant["gpu-only"]}
    if floors and gpu_runs:
        head = "| seed | gpu-only p90 (s) | cold floor p90 (s) | most any router could gain |"
        rule = "| --- | --- | --- | --- |"
        tiered = [v for v in VARIANTS if v != "gpu-only" and by_variant[v]]
        head += "".join(f" {v}: p90 vs gpu-only |" for v in tiered)
        rule += " --- |" * len(tiered)
        lines += [
            "The bound per seed: the cold floor (module doc of bench/kv_tiers/run.py: each request's prefill "
            "with no queue of the tokens no earlier request shared, its p90 over requests) and gpu-only / that "
            "floor, the most any tier scoring could gain over gpu-only on that seed.",
            "",
            head,
            rule,
        ]
        for seed in seeds:
            if seed not in gpu_runs or seed not in floors:
                continue
            g, f = gpu_runs[seed], floors[seed]
            cells = []
            for v in tiered:
                mine = [pct(o.ttft_s, 0.9) for o in by_variant[v] if o.seed == seed]
                cells.append(f" {g / mine[0]:.2f}x |" if mine and mine[0] > 0 else " |")
            lines.append(f"| {seed} | {g:.3f} | {f:.3f} | {g / f:.2f}x |" + "".join(cells))
        lines.append("")
    lines += [
        "- `gpu-only`: lower tiers invisible to the router (today's HBM-only view); `constant`: 1.0 / 0.75 / "
        "0.25 per tier; `physics`: prefill time saved minus load time (docs/routing.md#kv-cache-tiers); "
        "`flat`: every tier like HBM (the precise index before tiers, which ignored the medium); "
        "`physics+store`: `physics` with the shared store, whose blocks count on every replica at the store's "
        "link (the pool's `kv_store`); `approximate+store`: `physics` and the store with no events, the "
        "approximate index modelling HBM, DRAM and the store from the prompts it sent.",
        "- Hit rate counts HBM hits, DRAM and store loads alike (tokens not recomputed); the oracle is, at "
        "each dispatch, the best any engine could serve from HBM, DRAM and the store (it does not know what "
        "requests in flight will compute or later ones evict, so a router can exceed it slightly).",
        "",
        *section(args.out),
    ]
    text = "\n".join(lines)

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [v for v in VARIANTS if p90[v]]
        means = [statistics.fmean(p90[v]) for v in names]
        errs = [statistics.stdev(p90[v]) if len(p90[v]) > 1 else 0.0 for v in names]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(names, means, yerr=errs, capsize=4, color=["#999", "#c93", "#393", "#69c", "#936", "#c69"][: len(names)])
        for i, v in enumerate(names):
            ax.scatter([i] * len(p90[v]), p90[v], color="k", s=8, zorder=3)
        ax.set_ylabel("p90 TTFT (simulated s)")
        ax.set_title(f"KV tiers at {args.load:.0%} load (gpu-only p90 {base:.2f} s)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return text, plot
