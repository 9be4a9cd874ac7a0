"""Spend over time per group, drawn to a PNG (`tokenway usage report --plot out.png`).

Two panels share the time axis: spend per time bucket and cumulative spend, one line per group (the
`top` most expensive groups; the rest are summed as "other"). matplotlib is imported only here, with
the Agg backend, so the gateway never loads it and headless machines can draw.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.ledger.report import group_key, resolve_fields

BUCKETS_S = (60, 300, 900, 3600, 6 * 3600, 86400)


def choose_bucket_s(span_s: float, target_points: int = 60) -> int:
    for bucket in BUCKETS_S:
        if span_s / bucket <= target_points:
            return bucket
    return BUCKETS_S[-1]


def plot_spend(
    entries: Iterable[dict[str, Any]],
    by: Sequence[str],
    out_path: str | Path,
    *,
    bucket_s: int | None = None,
    top: int = 8,
    title: str | None = None,
) -> Path:
    try:
        import matplotlib
    except ImportError as exc:  # matplotlib is the `plot` extra
        raise RuntimeError("--plot needs matplotlib: pip install 'tokenway[plot]'") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fields = resolve_fields(by)
    points = [(float(e["ts"]), " / ".join(group_key(e, fields)) or "all", float(e.get("cost_usd") or 0.0))
              for e in entries]  # fmt: skip
    out = Path(out_path)
    fig, (ax_rate, ax_cum) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    if points:
        start_s, end_s = min(p[0] for p in points), max(p[0] for p in points)
        bucket = bucket_s or choose_bucket_s(end_s - start_s)
        totals: dict[str, float] = defaultdict(float)
        for _, group, cost in points:
            totals[group] += cost
        keep = set(sorted(totals, key=lambda g: -totals[g])[:top])
        series: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for ts, group, cost in points:
            series[group if group in keep else "other"][int(ts // bucket) * bucket] += cost
        first, last = int(start_s // bucket) * bucket, int(end_s // bucket) * bucket
        slots = list(range(first, last + bucket, bucket))
        times = [datetime.fromtimestamp(s, UTC) for s in slots]
        for group in sorted(series, key=lambda g: -sum(series[g].values())):
            per_bucket = [series[group].get(s, 0.0) for s in slots]
            cumulative, running = [], 0.0
            for value in per_bucket:
                running += value
                cumulative.append(running)
            ax_rate.step(times, per_bucket, where="post", label=group)
            ax_cum.plot(times, cumulative, label=group)
        ax_rate.set_ylabel(f"USD per {_bucket_label(bucket)}")
        ax_rate.legend(loc="upper left", fontsize="small", title=", ".join(fields) or None)
    else:
        ax_rate.text(0.5, 0.5, "no usage in the selected window", ha="center", va="center",
                     transform=ax_rate.transAxes)  # fmt: skip
    ax_cum.set_ylabel("cumulative USD")
    ax_cum.set_xlabel("time (UTC)")
    for ax in (ax_rate, ax_cum):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or f"tokenway spend by {', '.join(fields) or 'total'}")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _bucket_label(bucket_s: int) -> str:
    if bucket_s % 86400 == 0:
        return f"{bucket_s // 86400} d"
    if bucket_s % 3600 == 0:
        return f"{bucket_s // 3600} h"
    return f"{bucket_s // 60} min"
