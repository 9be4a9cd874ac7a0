"""The fairness benchmark's numbers, markdown and plot, from the raw outcomes of every mode.

Service is what the engines did for a tenant: uncached prompt + output tokens of its requests that
completed, counted in the window where they completed. A window's fair allocation is the weighted
max-min share of what the band was served (water-filling over the tenants' offered tokens in the
window): a tenant asking for less than its weighted share is entitled to what it asked for, the
rest is split by weight among the others. "Within 10 %" compares each tenant's service with that
allocation; when every tenant of the band is backlogged it is exactly the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

WAITED_S = 0.010
MODES_ORDER = (
    "solo-B",
    "fifo",
    "priority",
    "flow",
    "flow-reserve",
    "flow-2",
    "flow-preempt",
    "flow-reserve-preempt",
    "flow-reserve-preempt-2",
    "flow-lane",
    "flow-lane-2",
)
FLOW_MODES = tuple(mode for mode in MODES_ORDER if mode.startswith("flow"))
LABELS = {
    "solo-B": "B alone",
    "fifo": "FIFO (no flow control)",
    "priority": "priority only",
    "flow": "flow control",
    "flow-reserve": "flow control + reserve",
    "flow-2": "flow control + reserve, 2 replicas",
    "flow-preempt": "flow control + preemption",
    "flow-reserve-preempt": "flow control + reserve + preemption",
    "flow-reserve-preempt-2": "flow control + reserve + preemption, 2 replicas",
    "flow-lane": "flow control + reserve + preemption + clear lane",
    "flow-lane-2": "flow control + reserve + preemption + clear lane, 2 replicas",
}


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def water_fill(demand: Mapping[str, float], weight: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair allocation of `capacity` to tenants asking `demand`."""
    alloc = {t: 0.0 for t in demand}
    active = {t for t, d in demand.items() if d > 0}
    left = capacity
    while active and left > 1e-9:
        total_w = sum(weight[t] for t in active)
        share = {t: left * weight[t] / total_w for t in active}
        satisfied = {t for t in active if demand[t] - alloc[t] <= share[t]}
        if not satisfied:
            for t in active:
                alloc[t] += share[t]
            break
        for t in satisfied:
            left -= demand[t] - alloc[t]
            alloc[t] = demand[t]
        active -= satisfied
    return alloc


def cost(row: Mapping[str, Any]) -> float:
    return float(row["prompt_tokens"] - row["cached_tokens"] + row["completion_tokens"])


def ok(row: Mapping[str, Any]) -> bool:
    return bool(row["status"] == 200 and row["ttft_s"] is not None and row["completion_tokens"] > 0)


def summarize(run: Mapping[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    rows = run["outcomes"]
    tenants = {t["name"]: t for t in raw["tenants"]}
    window_s = float(raw["args"]["window_s"])
    end_s = 2 * float(raw["args"]["phase_s"])
    per_tenant: dict[str, Any] = {}
    for name in tenants:
        mine = [r for r in rows if r["tenant"] == name]
        if not mine:
            continue
        served = [r for r in mine if ok(r)]
        codes: dict[str, int] = {}
        for r in mine:
            if not ok(r):
                key = r["code"] or str(r["status"])
                codes[key] = codes.get(key, 0) + 1
        ttft = [r["ttft_s"] for r in served]
        phase1_rows = [r for r in served if r["sent_s"] < end_s / 2]
        phase1 = [r["ttft_s"] for r in phase1_rows]
        queued1 = [r["queued_ms"] / 1000.0 for r in phase1_rows]
        engine1 = [r["ttft_s"] - r["queued_ms"] / 1000.0 for r in phase1_rows]
        per_tenant[name] = {
            "sent": len(mine),
            "served": len(served),
            "failed": codes,
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "phase1_ttft_p50_s": pct(phase1, 50),
            "phase1_ttft_p99_s": pct(phase1, 99),
            "queued_p50_ms": pct([r["queued_ms"] for r in served], 50),
            # over WAITED_S: a request that enters the room behind the flood's and goes in the same
            # round shows a few ms there (its header is rounded to ms), which is no wait for a slot
            "phase1_waited": sum(1 for q in queued1 if q > WAITED_S) / len(queued1) if queued1 else None,
            "phase1_queued_p50_s": pct(queued1, 50),
            "phase1_queued_p99_s": pct(queued1, 99),
            "phase1_after_queue_p50_s": pct(engine1, 50),
            "phase1_after_queue_p99_s": pct(engine1, 99),
        }
    windows = []
    units = engine_units(rows)
    start = 0.0
    while start + window_s <= end_s + 1e-9:
        windows.append(window(rows, tenants, start, start + window_s, units))
        start += window_s
    served_rows = [r for r in rows if ok(r)]
    horizon = max((r["sent_s"] + r["e2e_s"] for r in served_rows), default=end_s)
    return {
        "tenants": per_tenant,
        "windows": windows,
        "goodput_tokens_per_s": sum(cost(r) for r in served_rows) / max(horizon, 1e-9),
        "completed_per_s": len(served_rows) / max(horizon, 1e-9),
        "mae": length_mae(rows, end_s),
        "counters_age_s": run.get("counters_age_s") or [],
    }


def engine_units(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per tenant, engine-counted tokens per client-counted token over its served requests.

    The client counts a request's offer as its prompt words and planned output; the engine counts the
    prompt after the chat template (a few tokens more per message). Service is in the engine's count,
    so an offer compared with it must be too: a served request asked for what it cost, a refused one
    for its offer scaled by this ratio."""
    cost_sum: dict[str, float] = {}
    offered_sum: dict[str, float] = {}
    for r in rows:
        if ok(r) and r["offered_tokens"] > 0:
            cost_sum[r["tenant"]] = cost_sum.get(r["tenant"], 0.0) + cost(r)
            offered_sum[r["tenant"]] = offered_sum.get(r["tenant"], 0.0) + r["offered_tokens"]
    return {t: cost_sum[t] / offered_sum[t] for t in cost_sum}


def window(
    rows: Sequence[Mapping[str, Any]],
    tenants: Mapping[str, Any],
    start: float,
    end: float,
    units: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Service per tenant in [start, end) against each band's weighted max-min fair allocation.

    Service counts where a request completed, demand where it was sent, so a tenant served in full
    still reads a few per cent off in a window that its requests straddle (B alone shows it). Beside
    it, `worst_deviation_prorated` counts service as the tokens processed in the window: a request's
    uncached prompt at its first token, its output spread evenly from there to its end (the engine
    produces them at about that pace), which halves that straddle."""
    units = engine_units(rows) if units is None else units
    served: dict[str, float] = {t: 0.0 for t in tenants}
    prorated: dict[str, float] = {t: 0.0 for t in tenants}
    demand: dict[str, float] = {t: 0.0 for t in tenants}
    for r in rows:
        done_s = r["sent_s"] + r["e2e_s"]
        if ok(r) and start <= done_s < end:
            served[r["tenant"]] += cost(r)
        if ok(r):
            prorated[r["tenant"]] += processed_in(r, start, end)
        if start <= r["sent_s"] < end:
            # a refused request asked for service too, in the engine's count as near as is known
            asked = cost(r) if ok(r) else r["offered_tokens"] * units.get(r["tenant"], 1.0)
            demand[r["tenant"]] += asked
    out: dict[str, Any] = {"start_s": start, "end_s": end, "tenants": {}}
    bands: dict[str, list[str]] = {}
    for name, spec in tenants.items():
        bands.setdefault(spec["priority"], []).append(name)
    worst = worst_prorated = 0.0
    for members in bands.values():
        weights = {t: tenants[t]["weight"] for t in members}
        asked = {t: demand[t] for t in members}
        capacity = sum(served[t] for t in members)
        alloc = water_fill(asked, weights, capacity)
        alloc_prorated = water_fill(asked, weights, sum(prorated[t] for t in members))
        total = capacity or 1.0
        contested = len([m for m in members if demand[m] > 0]) > 1
        for t in members:
            ratio = served[t] / alloc[t] if alloc[t] > 0 else None
            ratio_prorated = prorated[t] / alloc_prorated[t] if alloc_prorated[t] > 0 else None
            out["tenants"][t] = {
                "served_tokens": served[t],
                "share": served[t] / total,
                "fair_share": alloc[t] / total,
                "ratio": ratio,
                "ratio_prorated": ratio_prorated,
            }
            if ratio is not None and contested:
                worst = max(worst, abs(ratio - 1.0))
            if ratio_prorated is not None and contested:
                worst_prorated = max(worst_prorated, abs(ratio_prorated - 1.0))
    out["worst_deviation"] = worst
    out["worst_deviation_prorated"] = worst_prorated
    return out


def processed_in(row: Mapping[str, Any], start: float, end: float) -> float:
    """The tokens of a served request the engine processed in [start, end): its uncached prompt at its
    first token, its output evenly between the first token and its end."""
    first_s = float(row["sent_s"] + row["ttft_s"])
    done_s = float(row["sent_s"] + row["e2e_s"])
    prompt = float(row["prompt_tokens"] - row["cached_tokens"]) if start <= first_s < end else 0.0
    output = float(row["completion_tokens"])
    if done_s <= first_s:
        return prompt + (output if start <= first_s < end else 0.0)
    overlap = max(min(done_s, end) - max(first_s, start), 0.0)
    return prompt + output * overlap / (done_s - first_s)


def _flow_header(value: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in value.split(";"):
        name, _, number = part.partition("=")
        try:
            out[name] = float(number)
        except ValueError:
            continue
    return out


def length_mae(rows: Sequence[Mapping[str, Any]], end_s: float) -> dict[str, Any]:
    """MAE (tokens) of the gateway's output-length predictions, raw and drift-corrected, per tenant."""
    out: dict[str, Any] = {}
    for tenant in sorted({r["tenant"] for r in rows}):
        raw_err, corrected_err = [], []
        for r in rows:
            if r["tenant"] != tenant or not ok(r) or not r.get("flow"):
                continue
            flow = _flow_header(r["flow"])
            if "raw" in flow and "output" in flow:
                raw_err.append(abs(r["completion_tokens"] - flow["raw"]))
                corrected_err.append(abs(r["completion_tokens"] - flow["output"]))
        if raw_err:
            out[tenant] = {
                "n": len(raw_err),
                "raw": float(np.mean(raw_err)),
                "corrected": float(np.mean(corrected_err)),
            }
    return out


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else (f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s")


def _reserve(raw: Mapping[str, Any]) -> str:
    """The reserve the run used: a fixed `reserve_slots` (older runs) or sized from demand."""
    reserve = raw.get("reserve")
    if not isinstance(reserve, Mapping):
        return f"`reserve_slots: {raw.get('reserve_slots', '?')}`"
    return "`" + ", ".join(f"{k}: {v}" for k, v in reserve.items()) + "` (sized from the light tenants' recent peak)"


def render(raw: Mapping[str, Any], summaries: Mapping[str, Any], plot_name: str) -> str:
    args = raw["args"]
    solo = summaries.get("solo-B", {}).get("tenants", {}).get("B", {})
    solo_p99 = solo.get("phase1_ttft_p99_s")
    lines = [
        "# Fairness under saturation: FIFO, priority only, flow control",
        "",
        "`.venv/bin/python -m bench.fairness` "
        + ("--quick " if args.get("quick") else "")
        + f"(time scale {args['time_scale']}, phases of {args['phase_s']:.0f} s, windows of {args['window_s']:.0f} s; "
        + f"{raw['machine']}). Two simulated Llama-3.1-8B@H100 engines, `--max-num-seqs 8`; "
        + f"capacity measured at {raw['capacity_tokens_per_s']:.0f} tokens/s. Wall-clock latencies.",
        "",
        "Tenants: **A** (normal, weight 1) floods at 5x its fair share, its outputs tripling halfway through "
        "phase 1 (drift); **B** (normal, weight 2) sends at its usual rate (0.3 of capacity) in phase 1 and "
        "floods in phase 2; **C** (low) is batch traffic. Flow control: `max_engine_waiting: 0`, "
        "normal band waits at most "
        + f"{args['phase_s'] / 8:.0f} s (then 429), low {args['phase_s'] / 4:.0f} s (503); "
        + f'"+ reserve": {_reserve(raw)} (of the 16 batch slots, kept for tenants under their share of what is '
        "in flight, `policies/flow/saturation.py`).",
        "",
        f"![fairness]({plot_name})",
        "",
        "## Latency (TTFT, served requests)",
        "",
        "| mode | tenant | sent | served | turned away / failed | p50 | p99 | phase 1 p50 | phase 1 p99 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES_ORDER:
        if mode not in summaries:
            continue
        for tenant, t in summaries[mode]["tenants"].items():
            failed = ", ".join(f"{k} {v}" for k, v in sorted(t["failed"].items())) or "-"
            lines.append(
                f"| {LABELS[mode]} | {tenant} | {t['sent']} | {t['served']} | {failed} | {_fmt_s(t['ttft_p50_s'])} | "
                f"{_fmt_s(t['ttft_p99_s'])} | {_fmt_s(t['phase1_ttft_p50_s'])} | {_fmt_s(t['phase1_ttft_p99_s'])} |"
            )
    lines += ["", "B's phase-1 p99 TTFT against its solo baseline (target ≤ 1.2x):", ""]
    for mode in MODES_ORDER[1:]:
        if mode in summaries and solo_p99:
            b = summaries[mode]["tenants"].get("B", {}).get("phase1_ttft_p99_s")
            lines.append(f"- {LABELS[mode]}: {b / solo_p99:.2f}x" if b else f"- {LABELS[mode]}: -")
    lines += [
        "",
        "Where B's phase-1 TTFT goes: the wait in the gateway's waiting room (`x-tokenway-queued-ms`) "
        "and the rest (routing, prefill, first token):",
        "",
        f"| mode | B requests that waited over {WAITED_S * 1000:.0f} ms | wait p50 | wait p99 | rest p50 | rest p99 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES_ORDER:
        b = summaries.get(mode, {}).get("tenants", {}).get("B")
        if b and b.get("phase1_waited") is not None:
            lines.append(
                f"| {LABELS[mode]} | {b['phase1_waited']:.0%} | {_fmt_s(b['phase1_queued_p50_s'])} | "
                f"{_fmt_s(b['phase1_queued_p99_s'])} | {_fmt_s(b.get('phase1_after_queue_p50_s'))} | "
                f"{_fmt_s(b['phase1_after_queue_p99_s'])} |"
            )
    lines += [
        "",
        "## Service shares per window (normal band: A and B; fair = weighted max-min of what each asked)",
        "",
        "| mode | window | A share (fair) | B share (fair) | worst deviation from fair | same, pro-rated |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES_ORDER[1:]:
        if mode not in summaries:
            continue
        for w in summaries[mode]["windows"]:
            a, b = w["tenants"].get("A", {}), w["tenants"].get("B", {})
            lines.append(
                f"| {LABELS[mode]} | {w['start_s']:.0f}-{w['end_s']:.0f} s | {a.get('share', 0):.1%} "
                f"({a.get('fair_share', 0):.1%}) | {b.get('share', 0):.1%} ({b.get('fair_share', 0):.1%}) | "
                f"{w['worst_deviation']:.1%} | {w.get('worst_deviation_prorated', 0.0):.1%} |"
            )
    solo_windows = summaries.get("solo-B", {}).get("windows", [])
    straddle = [abs(r - 1.0) for w in solo_windows if (r := w["tenants"].get("B", {}).get("ratio")) is not None]
    straddle_prorated = [
        abs(r - 1.0) for w in solo_windows if (r := w["tenants"].get("B", {}).get("ratio_prorated")) is not None
    ]
    lines += [
        "",
        "A tenant's demand is what it sent in the window, in the engine's token count (a served request "
        "asked for what it cost; a refused one for its offer scaled to the engine's count); its service is "
        "what completed in the window; pro-rated, the tokens processed in the window (a request's uncached "
        "prompt at its first token, its output evenly from there to its end).",
    ]
    if straddle:
        lines.append(
            f"B alone, served in full, reads up to {max(straddle):.1%} off its demand in a window "
            f"({max(straddle_prorated, default=0.0):.1%} pro-rated): requests that straddle a window's edge, "
            "the measurement's own floor."
        )
    lines += [
        "",
        "## Goodput",
        "",
        "| mode | served tokens/s | vs FIFO | completed req/s |",
        "| --- | --- | --- | --- |",
    ]
    fifo = summaries.get("fifo", {}).get("goodput_tokens_per_s")
    for mode in MODES_ORDER[1:]:
        if mode in summaries:
            g = summaries[mode]["goodput_tokens_per_s"]
            ratio = f"{g / fifo:.2f}x" if fifo else "-"
            lines.append(f"| {LABELS[mode]} | {g:.0f} | {ratio} | {summaries[mode]['completed_per_s']:.2f} |")
    cut = {mode: _preempted(raw["runs"][mode]) for mode in MODES_ORDER if mode in raw["runs"] and "preempt" in mode}
    if cut:
        lines += [
            "",
            "Streams cut by preemption (each waited its turn again and continued where it stopped; "
            "`preempted` on `/admin/status`, summed over the replicas): "
            + ", ".join(f"{LABELS[mode]} {n}" for mode, n in cut.items())
            + ".",
        ]
    lines += [
        "",
        "## Output-length predictions (MAE in tokens, served requests; raw median vs drift-corrected)",
        "",
        "| mode | tenant | requests | raw MAE | corrected MAE | change |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in FLOW_MODES:
        for tenant, m in summaries.get(mode, {}).get("mae", {}).items():
            change = (m["corrected"] - m["raw"]) / m["raw"] if m["raw"] else 0.0
            lines.append(
                f"| {LABELS[mode]} | {tenant} | {m['n']} | {m['raw']:.1f} | {m['corrected']:.1f} | {change:+.0%} |"
            )
    return "\n".join(lines) + "\n"


def plot(raw: Mapping[str, Any], summaries: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    end_s = 2 * float(raw["args"]["phase_s"])
    ax = axes[0]
    for mode in MODES_ORDER:
        run = raw["runs"].get(mode)
        if run is None:
            continue
        values = sorted(
            r["ttft_s"] for r in run["outcomes"] if r["tenant"] == "B" and ok(r) and r["sent_s"] < end_s / 2
        )
        if values:
            ax.plot(values, np.linspace(0, 1, len(values)), label=LABELS[mode])
    ax.set_xscale("log")
    ax.set_xlabel("B's TTFT in phase 1 (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    ax = axes[1]
    bins = np.arange(0, end_s + 10, 10)
    for mode in MODES_ORDER[1:]:
        run = raw["runs"].get(mode)
        if run is None:
            continue
        a = np.zeros(len(bins) - 1)
        b = np.zeros(len(bins) - 1)
        for r in run["outcomes"]:
            if not ok(r) or r["tenant"] not in ("A", "B"):
                continue
            k = np.searchsorted(bins, r["sent_s"] + r["e2e_s"], side="right") - 1
            if 0 <= k < len(a):
                (a if r["tenant"] == "A" else b)[k] += cost(r)
        share = np.divide(b, a + b, out=np.full_like(b, np.nan), where=(a + b) > 0)
        ax.plot(bins[:-1] + 5, share, label=LABELS[mode])
    ax.axhline(2 / 3, color="grey", linestyle=":", label="B's weight share (2/3)")
    ax.axvline(end_s / 2, color="black", linewidth=0.5)
    ax.set_xlabel("time (s); B floods too after the line")
    ax.set_ylabel("B's share of the normal band's service")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[2]
    run = raw["runs"].get("flow")
    if run is not None:
        rows = sorted(
            (r for r in run["outcomes"] if r["tenant"] == "A" and ok(r) and r.get("flow")), key=lambda r: r["sent_s"]
        )
        t = [r["sent_s"] for r in rows]
        flows = [_flow_header(r["flow"]) for r in rows]
        ax.plot(t, [r["completion_tokens"] for r in rows], ".", markersize=2, alpha=0.4, label="actual")
        ax.plot(t, [f.get("raw", np.nan) for f in flows], label="predicted (median)")
        ax.plot(t, [f.get("output", np.nan) for f in flows], label="predicted, drift-corrected")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("A's output tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _preempted(run: Mapping[str, Any]) -> int:
    total = 0
    for status in run.get("flow_status") or []:
        if isinstance(status, Mapping):
            total += int(status.get("pools", {}).get("llama", {}).get("preempted", 0) or 0)
    return total


def write(raw: dict[str, Any], out: Path) -> None:
    summaries = {mode: summarize(run, raw) for mode, run in raw["runs"].items()}
    plot_path = out.with_suffix(".png")
    plot(raw, summaries, plot_path)
    out.write_text(render(raw, summaries, plot_path.name))
    print(out.read_text())
