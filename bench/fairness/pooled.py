"""Several days of the fairness benchmark read as one: B's p99 TTFT against its solo baseline pooled.

    .venv/bin/python -m bench.fairness.pooled RAW [RAW ...] [--out bench/results/fairness-pooled.md]

Each RAW is a `--raw` file of `python -m bench.fairness` run with its own `--seed` (another day of
arrivals, its own solo baseline). One day's phase 1 gives B so few requests that its p99 is their
second-worst and moves with a single slow request, between runs of the same code. Pooling the days'
requests (B's phase-1 TTFTs of every day in one sample, solo and flooded alike) puts several
requests above the p99, and a bootstrap over the pooled requests says how far that ratio can still
move. Per day the report keeps each day's own ratio, its
worst share deviation and its goodput against FIFO where FIFO ran, so a pooled figure never hides a
day that missed.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.fairness.report import LABELS, MODES_ORDER, ok, summarize

RESULTS = Path(__file__).resolve().parents[1] / "results"
TARGET = 1.2
BOOTSTRAP = 2000


def phase1_ttfts(run: Mapping[str, Any], phase_s: float, tenant: str = "B") -> list[float]:
    """A tenant's TTFTs (s) of the requests it sent in phase 1 and was served."""
    return [float(r["ttft_s"]) for r in run["outcomes"] if r["tenant"] == tenant and ok(r) and r["sent_s"] < phase_s]


def phase1_engine_clock(run: Mapping[str, Any], phase_s: float, time_scale: float) -> list[tuple[float, float]]:
    """B's phase-1 (engine clock, wall clock) pairs (s) where the engine reported its TTFT: the
    engine's own TTFT (engine seconds / time scale) plus the gateway's queue before dispatch, which
    leaves out the host's lag and the gateway's own handling; the wall TTFT has both."""
    out = []
    for r in run["outcomes"]:
        if r["tenant"] == "B" and ok(r) and r["sent_s"] < phase_s and r.get("engine_ttft_s") is not None:
            engine = float(r["engine_ttft_s"]) / time_scale + float(r["queued_ms"]) / 1000
            out.append((engine, float(r["ttft_s"])))
    return out


def ratio_interval(flooded: Sequence[float], solo: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """A 90 % bootstrap interval of p99(flooded) / p99(solo), both resampled."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(flooded), np.asarray(solo)
    ratios = np.empty(BOOTSTRAP)
    for i in range(BOOTSTRAP):
        ratios[i] = np.percentile(rng.choice(a, a.size), 99) / np.percentile(rng.choice(b, b.size), 99)
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def _compare(solo: Sequence[float], flooded: Sequence[float]) -> str:
    """The cells both pooled tables share: p50 / p99 of each side, their p99 ratio and its interval."""
    s50, s99 = np.percentile(solo, [50, 99])
    f50, f99 = np.percentile(flooded, [50, 99])
    low, high = ratio_interval(flooded, solo)
    return (
        f"{len(solo)} / {len(flooded)} | {s50 * 1000:.0f} / {s99 * 1000:.0f} ms | "
        f"{f50 * 1000:.0f} / {f99 * 1000:.0f} ms | {f99 / s99:.2f}x | {low:.2f}-{high:.2f}x"
    )


def _worst(windows: Sequence[Mapping[str, Any]]) -> str:
    """The worst window's deviation, completed and pro-rated (raw files of any age have the first)."""
    completed = max(w["worst_deviation"] for w in windows)
    prorated = [w["worst_deviation_prorated"] for w in windows if "worst_deviation_prorated" in w]
    return f"{completed:.1%} ({max(prorated):.1%})" if prorated else f"{completed:.1%}"


def render(raws: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    days = [(raw, {mode: summarize(run, raw) for mode, run in raw["runs"].items()}) for raw in raws]
    modes = [m for m in MODES_ORDER[1:] if any(m in raw["runs"] for raw in raws)]
    first = raws[0]["args"]
    lines = [
        "# Fairness under saturation, several days pooled",
        "",
        f"`.venv/bin/python -m bench.fairness.pooled {' '.join(names)}`: {len(raws)} days of "
        f"`python -m bench.fairness` (seeds {', '.join(str(raw['args']['seed']) for raw in raws)}; time scale "
        f"{first['time_scale']}, phases of {first['phase_s']:.0f} s, windows of {first['window_s']:.0f} s), "
        "each with its own arrivals and its own solo baseline (B's phase 1 alone). The tenants, the flow "
        "configuration and the columns are those of [fairness.md](fairness.md); each day's own report is beside "
        "it; a raw file stays out of git as written (`bench/results/*-raw.json`), gzipped copies are kept in "
        "`bench/results/raw/` (this command reads either).",
        "",
        "## Per day",
        "",
        "| seed | mode | B solo p99 | B p99 | ratio (target ≤ 1.2x) | B waited > 10 ms | worst share deviation "
        "(pro-rated) | goodput vs FIFO |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for raw, summaries in days:
        solo = summaries["solo-B"]["tenants"]["B"]["phase1_ttft_p99_s"]
        fifo = summaries.get("fifo", {}).get("goodput_tokens_per_s")
        for mode in modes:
            if mode not in summaries:
                continue
            b = summaries[mode]["tenants"]["B"]
            worst = _worst(summaries[mode]["windows"])
            good = f"{summaries[mode]['goodput_tokens_per_s'] / fifo:.2f}x" if fifo else "-"
            waited = "-" if b["phase1_waited"] is None else f"{b['phase1_waited']:.0%}"
            lines.append(
                f"| {raw['args']['seed']} | {LABELS[mode]} | {solo * 1000:.0f} ms | "
                f"{b['phase1_ttft_p99_s'] * 1000:.0f} ms | {b['phase1_ttft_p99_s'] / solo:.2f}x | {waited} | "
                f"{worst} | {good} |"
            )
    lines += [
        "",
        "## Pooled (every day's phase-1 requests of B in one sample)",
        "",
        "| mode | days | B requests (solo / flooded) | solo p50 / p99 | flooded p50 / p99 | p99 ratio | "
        "90 % interval | worst share deviation, any day (pro-rated) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in modes:
        pairs = [(raw, s) for raw, s in days if mode in raw["runs"]]
        solo = [t for raw, _ in pairs for t in phase1_ttfts(raw["runs"]["solo-B"], float(raw["args"]["phase_s"]))]
        flooded = [t for raw, _ in pairs for t in phase1_ttfts(raw["runs"][mode], float(raw["args"]["phase_s"]))]
        if not solo or not flooded:
            continue
        worst = _worst([w for _, s in pairs for w in s[mode]["windows"]])
        lines.append(f"| {LABELS[mode]} | {len(pairs)} | {_compare(solo, flooded)} | {worst} |")
    lines += [
        "",
        "## Pooled on the engine's clock (days whose engine reported its TTFT)",
        "",
        "B's TTFT as the simulated engine timed it (from receiving the request to its first token, in wall "
        "seconds at the time scale) plus its wait in the gateway's queue: what the engines and the "
        "gateway's ordering gave B, without the lag of this 2-core host (client, gateway, engines and Redis "
        "share it) or the gateway's own handling. 'lag' is the wall TTFT less this clock.",
        "",
        "| mode | days | B requests (solo / flooded) | solo p50 / p99 | flooded p50 / p99 | p99 ratio | "
        "90 % interval | lag p50 / p99, solo | lag p50 / p99, flooded |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in modes:
        solo_pairs: list[tuple[float, float]] = []
        flood_pairs: list[tuple[float, float]] = []
        used = 0
        for raw, _ in days:
            if mode not in raw["runs"]:
                continue
            phase_s, scale = float(raw["args"]["phase_s"]), float(raw["args"]["time_scale"])
            solo_day = phase1_engine_clock(raw["runs"]["solo-B"], phase_s, scale)
            flood_day = phase1_engine_clock(raw["runs"][mode], phase_s, scale)
            if solo_day and flood_day:
                used += 1
                solo_pairs += solo_day
                flood_pairs += flood_day
        if not used:
            continue
        solo_lag = np.percentile([w - e for e, w in solo_pairs], [50, 99])
        flood_lag = np.percentile([w - e for e, w in flood_pairs], [50, 99])
        compared = _compare([e for e, _ in solo_pairs], [e for e, _ in flood_pairs])
        lines.append(
            f"| {LABELS[mode]} | {used} | {compared} | {solo_lag[0] * 1000:.0f} / {solo_lag[1] * 1000:.0f} ms | "
            f"{flood_lag[0] * 1000:.0f} / {flood_lag[1] * 1000:.0f} ms |"
        )
    lines += [
        "",
        f"The interval resamples both pooled samples {BOOTSTRAP} times (with replacement) and takes the 5th "
        "and 95th percentile of the ratio of their p99s: the range one more set of days would likely read. "
        "A day's share deviation is the worst 60 s window of that day; the target is within 10 % on one "
        "gateway replica and 15 % on two. Service counts a request where it completed; pro-rated (in "
        "brackets), as the tokens processed in the window (`report.processed_in`), which halves the "
        "straddle of requests across a window's edge.",
    ]
    return "\n".join(lines) + "\n"


def read_raw(path: Path) -> bytes:
    """A raw file as written, or gzipped (`bench/results/raw/*.json.gz`, the copies kept in git)."""
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "raws", nargs="+", type=Path, help="raw files of `python -m bench.fairness --raw` (or gzipped: .json.gz)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness-pooled.md")
    args = parser.parse_args()
    raws = [json.loads(read_raw(path)) for path in args.raws]
    text = render(raws, [path.name for path in args.raws])
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
