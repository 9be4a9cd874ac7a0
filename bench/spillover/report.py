"""bench/results/spillover.md and .png: SLO attainment and $/Mtok per variant, pooled over the
windows with their spread, and the first window's timeline (who served each arrival)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import notes

TARGET_SLO, TARGET_COST = 0.99, 0.40


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3g}" if values else "-"
    return f"{statistics.mean(values):.3g} (min {min(values):.3g}, max {max(values):.3g})"


def write(
    results: Path,
    name: str,
    rows: Sequence[dict[str, Any]],
    timelines: Mapping[str, Sequence[tuple[float, str, bool]]],
    meta: Mapping[str, Any],
) -> None:
    results.mkdir(parents=True, exist_ok=True)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {v: [r for r in rows if r["variant"] == v] for v in variants}
    cost = {v: [r["usd_per_mtok"] for r in by[v] if r["usd_per_mtok"] is not None] for v in variants}
    lines = [
        "# Spill-over: a self-hosted pool sized for the mean, a hosted API for the bursts",
        "",
        "`.venv/bin/python -m bench.spillover` (bench/spillover/run.py says how). "
        f"{meta['windows']} window(s) of {meta['window_s']:.0f} s of Azure's conversation trace (rows from "
        f"{meta['trace_rows']}), each replayed through a fresh gateway per variant; self-hosted: one simulated "
        f"H100 replica sized for each window's mean (`max_num_seqs` {meta['seqs']}: {meta['headroom']:g}x the "
        "mean offered concurrency); hosted: an Anthropic stand-in, TTFT "
        f"{meta['hosted']['ttft_ms']:.0f} ms, {meta['hosted']['tpot_ms']:.0f} ms/token, "
        f"${meta['hosted']['in']:g}/${meta['hosted']['out']:g} per Mtok in/out; the GPU at "
        f"${meta['gpu_hour_usd']:.2f}/h; spill after {meta['spill_wait_ms']:.0f} ms waiting"
        + (
            f" (spill-priced: also once the predicted wait x ${meta['usd_per_wait_s']:g}/s exceeds the hosted "
            "pool's price for the request's tokens). "
            if meta.get("usd_per_wait_s") is not None
            else ". "
        )
        + f"SLO: TTFT <= {meta['slo']['ttft_s']:g} s, TPOT <= {meta['slo']['tpot_s'] * 1000:.0f} ms. "
        f"Host: {meta['host_cpus']} CPUs shared by the gateway, the sim, the stand-in and the client.",
        "",
        "| variant | SLO attainment (mean, min-max over windows) | $/Mtok | hosted share of tokens | "
        "spilled requests | TTFT p99 s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v in variants:
        rs = by[v]
        lines.append(
            f"| {v} | {_spread([r['slo_attainment'] for r in rs])} | {_spread(cost[v])} | "
            f"{_spread([r['hosted_token_share'] for r in rs])} | {sum(r['spilled_requests'] for r in rs)} | "
            f"{_spread([r['ttft_p99_s'] or 0.0 for r in rs])} |"
        )
    lines += ["", "Per window:", "", "| variant | window | requests | served | SLO | $/Mtok | owned $ | hosted $ |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        per = r["usd_per_mtok"]
        lines.append(
            f"| {r['variant']} | {r['window']} | {r['requests']} | {r['served']} | {r['slo_attainment']:.4f} | "
            f"{per:.3f} | {r['owned_usd']:.4f} | {r['hosted_usd']:.4f} |"
            if per is not None
            else f"| {r['variant']} | {r['window']} | {r['requests']} | {r['served']} | - | - | - | - |"
        )
    if "spill-over" in cost and "all-hosted" in cost and cost["all-hosted"] and cost["spill-over"]:
        ratio = statistics.mean(cost["spill-over"]) / statistics.mean(cost["all-hosted"])
        slo = min(r["slo_attainment"] for r in by["spill-over"])
        ok = slo >= TARGET_SLO and ratio <= TARGET_COST
        lines += [
            "",
            f"**Target** (spill-over >= {TARGET_SLO:.0%} SLO attainment at <= {TARGET_COST:.0%} of all-hosted "
            f"$/Mtok): worst window {slo:.2%}, cost ratio {ratio:.1%}: **{'met' if ok else 'not met'}**.",
        ]
    report = results / f"{name}.md"
    lines += ["", notes.plot_line(report, "SLO attainment and $/Mtok per variant; the first window's timeline")]
    lines += ["", *notes.section(report)]
    report.write_text("\n".join(lines).rstrip("\n") + "\n")
    _plot(results / f"{name}.png", by, timelines)


def _plot(
    path: Path, by: Mapping[str, Sequence[dict[str, Any]]], timelines: Mapping[str, Sequence[tuple[float, str, bool]]]
) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v, rs in by.items():
        xs = [r["usd_per_mtok"] or 0.0 for r in rs]
        ys = [r["slo_attainment"] * 100 for r in rs]
        left.scatter(xs, ys, label=v, s=40)
    left.axhline(TARGET_SLO * 100, color="grey", linestyle=":", linewidth=1)
    left.set_xlabel("$ per million tokens")
    left.set_ylabel("SLO attainment (%)")
    left.set_title("each window, each variant")
    left.legend()
    spill = timelines.get("spill-pools") or []
    if spill:
        t0 = min(t for t, _, _ in spill)
        bins: dict[int, list[int]] = {}
        for t, pool, _ in spill:
            slot = bins.setdefault(int((t - t0) // 2), [0, 0])
            slot[1 if pool == "hosted" else 0] += 1
        slots = sorted(bins)
        starts = [s * 2 for s in slots]
        home = [bins[s][0] for s in slots]
        right.bar(starts, home, width=2, label="self-hosted", align="edge")
        right.bar(starts, [bins[s][1] for s in slots], width=2, bottom=home, label="spilled", align="edge")
        right.set_xlabel("seconds into window 0")
        right.set_ylabel("requests started per 2 s")
        right.set_title("spill-over: where each request went")
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
