"""The agents benchmark's numbers, markdown and plot, from the raw programs of every mode.

A program's slowdown is its completion time (its first call sent to its last answer) in a mode
over its completion time alone on the pool (`solo`, the same program, the same engines' settings).
Per mode and width, the slowdowns of every seed's programs of that width are pooled: p50, p99 and
the worst. The target of issue 44: the 1-way programs' p99 at most 1.5x their solo time while the
40-way program runs. A program with a failed call counts as failed and is left out of the ratios
(the table says how many). A person's reading goes in bench/results/agents.notes.md (kept across
re-renders, `bench/notes.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import notes

TARGET = 1.5
MODES_ORDER = ("request", "program", "program-2", "program-reserve", "program-reserve-2")
LABELS = {
    "request": "request-level (arrival order inside the tenant)",
    "program": "program-fair (least attained service)",
    "program-2": "program-fair, 2 gateways sharing it in Redis",
    "program-reserve": "program-fair + program slot reserve",
    "program-reserve-2": "program-fair + program slot reserve, 2 gateways (Redis)",
}


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def slowdowns(raw: Mapping[str, Any], mode: str) -> dict[int, list[float]]:
    """Width -> every program's completion time over its solo time, every seed pooled."""
    solo = {(seed, p["name"]): p for seed, rows in raw["runs"]["solo"].items() for p in rows}
    out: dict[int, list[float]] = {}
    for seed, rows in raw["runs"].get(mode, {}).items():
        for p in rows:
            alone = solo.get((seed, p["name"]))
            if alone is None or not p["ok"] or not alone["ok"] or alone["completion_s"] <= 0:
                continue
            out.setdefault(int(p["width"]), []).append(p["completion_s"] / alone["completion_s"])
    return out


def critical(calls: Sequence[Sequence[Any]], index: int) -> float:
    """Sum over turns of the largest value (column `index` of the raw call rows) among the turn's
    calls: a turn ends with its last call, so that call's wait (or engine time) is the turn's."""
    per_turn: dict[int, float] = {}
    for row in calls:
        value = float(row[index]) if len(row) > index else 0.0
        per_turn[int(row[0])] = max(per_turn.get(int(row[0]), 0.0), value)
    return sum(per_turn.values())


def engine_ratios(raw: Mapping[str, Any], mode: str) -> dict[int, list[float]]:
    """Width -> every program's critical-path engine time over its solo run's: how much slower the
    engines served it, waiting in the gateway left out."""
    solo = {(seed, p["name"]): p for seed, rows in raw["runs"]["solo"].items() for p in rows}
    out: dict[int, list[float]] = {}
    for seed, rows in raw["runs"].get(mode, {}).items():
        for p in rows:
            alone = solo.get((seed, p["name"]))
            if alone is None or not p["ok"] or not alone["ok"]:
                continue
            base = critical(alone["calls"], 9)
            if base > 0:
                out.setdefault(int(p["width"]), []).append(critical(p["calls"], 9) / base)
    return out


def summarize(raw: Mapping[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Mode -> width -> programs, failed, p50 / p99 / worst slowdown, p99 wait of a call (ms)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for mode in [m for m in MODES_ORDER if m in raw["runs"]] + [
        m for m in raw["runs"] if m not in MODES_ORDER and m != "solo"
    ]:
        ratios = slowdowns(raw, mode)
        engine = engine_ratios(raw, mode)
        rows = [p for seed_rows in raw["runs"][mode].values() for p in seed_rows]
        widths = sorted({int(p["width"]) for p in rows})
        out[mode] = {}
        for width in widths:
            mine = [p for p in rows if int(p["width"]) == width]
            waits = [float(c[6]) for p in mine for c in p["calls"]]
            values = ratios.get(width, [])
            out[mode][width] = {
                "programs": len(mine),
                "failed": sum(1 for p in mine if not p["ok"]),
                "p50": pct(values, 50),
                "p99": pct(values, 99),
                "worst": max(values) if values else None,
                "completion_s_p50": pct([p["completion_s"] for p in mine], 50),
                "wait_ms_p99": pct(waits, 99),
                # the share of its completion time a program spent waiting in the gateway (its turns' last calls)
                "wait_share": pct([critical(p["calls"], 6) / 1000.0 / p["completion_s"] for p in mine if p["ok"]], 50),
                "engine_p50": pct(engine.get(width, []), 50),
            }
    return out


def solo_times(raw: Mapping[str, Any]) -> dict[int, float | None]:
    rows = [p for seed_rows in raw["runs"]["solo"].values() for p in seed_rows]
    widths = sorted({int(p["width"]) for p in rows})
    return {w: pct([p["completion_s"] for p in rows if int(p["width"]) == w], 50) for w in widths}


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _n(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pc(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def render(
    raw: Mapping[str, Any],
    summary: Mapping[str, Mapping[int, Mapping[str, Any]]],
    plot_name: str,
    reading: Sequence[str] = (),
) -> str:
    args = raw["args"]
    pool = raw["pool"]
    seeds = sorted(raw["runs"]["solo"], key=int)
    solo = solo_times(raw)
    widths = ", ".join(f"{count} x {width}-way" for width, count in raw["widths"])
    lines = [
        "# Agent programs on a saturated pool: request-level vs program-fair queueing",
        "",
        "`.venv/bin/python -m bench.agents"
        + (f" --seeds {args['seeds']}" if args.get("seeds") else "")
        + f" --time-scale {args['time_scale']}`"
        + (" (--quick)" if args.get("quick") else ""),
        "",
        f"Pool: {pool['engines']} simulated {pool['preset']} engines, `max_num_seqs` {pool['max_num_seqs']}"
        f" ({pool['engines'] * pool['max_num_seqs']} batch slots), time scale {args['time_scale']}; flow"
        " control holds what the engines cannot start now. One tenant. Programs per seed: "
        f"{widths}, replaying τ²-bench retail sessions (a turn = `width` parallel calls, a tool run of"
        f" {args['tool_s']} s between turns); the 40-way program starts first, the others within"
        f" {args['stagger_s']} s. Seeds: {', '.join(seeds)}. Machine: {raw['machine']}."
        + (
            f" The program slot reserve modes keep {raw['program_reserve_slots']} of each engine's"
            " slots from a program over its share of the tenant's calls in flight while a smaller one is active"
            " (`program_reserve_slots`)."
            if any(m.startswith("program-reserve") for m in raw["runs"]) and "program_reserve_slots" in raw
            else ""
        ),
        "",
        "Slowdown = a program's completion time over its completion time alone on the pool (same"
        " program, fresh engines); p50 / p99 / worst over every seed's programs of that width."
        f" Target: 1-way p99 ≤ {TARGET}x.",
        "",
        "Of that slowdown, *waiting* is the share of a program's completion time its turns spent waiting in"
        " the gateway (each turn's longest wait), and *engine* its engines' own time (the simulator's"
        " `metrics.e2e_s`, each turn's longest call) over that in the solo run: a full batch decodes every"
        " sequence slower and other calls' prefills stall it, which no queue order changes.",
        "",
        "| mode | width | programs (failed) | solo p50 (s) | slowdown p50 | p99 | worst | waiting (p50) |"
        " engine (p50) | call wait p99 (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, per_width in summary.items():
        for width in sorted(per_width, reverse=True):
            row = per_width[width]
            lines.append(
                f"| {LABELS.get(mode, mode)} | {width}-way | {row['programs']} ({row['failed']}) |"
                f" {_n(solo.get(width))} | {_x(row['p50'])} | {_x(row['p99'])} | {_x(row['worst'])} |"
                f" {_pc(row['wait_share'])} | {_x(row['engine_p50'])} | {_n(row['wait_ms_p99'], 0)} |"
            )
    smallest = min((w for per in summary.values() for w in per), default=None)
    if smallest is not None:
        lines.append("")
        for mode, per_width in summary.items():
            p99 = per_width.get(smallest, {}).get("p99")
            if p99 is None:
                continue
            verdict = "meets" if p99 <= TARGET else "misses"
            lines.append(
                f"- {LABELS.get(mode, mode)}: the {smallest}-way programs' p99 is {p99:.2f}x their solo"
                f" time: {verdict} the {TARGET}x target."
            )
    lines += ["", f"![p99 slowdown per program width]({plot_name})", "", *reading]
    return "\n".join(lines)


def plot(summary: Mapping[str, Mapping[int, Mapping[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    widths = sorted({w for per in summary.values() for w in per})
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    step = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * step for j in range(len(widths))]
        p99 = [summary[mode].get(w, {}).get("p99") or 0.0 for w in widths]
        p50 = [summary[mode].get(w, {}).get("p50") or 0.0 for w in widths]
        bars = ax.bar(xs, p99, step * 0.95, label=f"{LABELS.get(mode, mode)}: p99")
        ax.scatter(xs, p50, color="black", marker="_", s=200, zorder=3, label="p50" if i == 0 else None)
        for x, v in zip(xs, p99, strict=True):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
        del bars
    ax.axhline(TARGET, color="tab:red", linestyle="--", linewidth=1, label=f"target {TARGET}x (1-way)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(widths)), [f"{w}-way" for w in widths])
    ax.set_ylabel("completion time / solo time")
    ax.set_title("Agent programs beside a 40-way program (pooled seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(raw: dict[str, Any], out: Path) -> None:
    summary = summarize(raw)
    png = out.with_suffix(".png")
    out.write_text(render(raw, summary, png.name, notes.section(out)))
    plot(summary, png)
    print(out.read_text())
