"""Spend over time per group, drawn to a PNG (`tokenway usage report --plot out.png`).

Two panels share the time axis: spend per time bucket and cumulative spend, one line per group (the
`top` most expensive groups; the rest are summed as "other") and, when there is more than one
group, an `all` line: the total of every record. Records without a value for a group field are the
group "(none)" (e.g. requests rejected before authentication have no tenant).

`SpendSeries` aggregates while the report streams: spend per group and time bucket, with buckets
that widen as the data's span grows (1 min, 5 min, ... 1 day; at most about 60 per line), so memory
is groups x 60 numbers whatever the row count. matplotlib is imported only to draw, with the Agg
backend, so the gateway never loads it and headless machines can draw.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.ledger.report import amount_of, group_key, resolve_fields

BUCKETS_S = (60, 300, 900, 3600, 6 * 3600, 86400)
TARGET_POINTS = 60
NONE_LABEL = "(none)"
ALL_LABEL = "all"


def choose_bucket_s(span_s: float, target_points: int = TARGET_POINTS) -> int:
    for bucket in BUCKETS_S:
        if span_s / bucket <= target_points:
            return bucket
    return BUCKETS_S[-1]


class SpendSeries:
    """USD per (group, time bucket), from entries added one at a time."""

    def __init__(self, by: Sequence[str], bucket_s: int | None = None) -> None:
        self.fields = resolve_fields(by)
        self._fixed_bucket = bucket_s is not None
        self.bucket_s = bucket_s or BUCKETS_S[0]
        self.series: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.start_s: float | None = None
        self.end_s: float | None = None
        self._labels: dict[tuple[str, ...], str] = {}

    def label(self, entry: dict[str, Any]) -> str:
        key = group_key(entry, self.fields)
        found = self._labels.get(key)
        if found is None:
            found = self._labels[key] = " / ".join(v or NONE_LABEL for v in key) or ALL_LABEL
        return found

    def add(self, entry: dict[str, Any]) -> None:
        ts = float(entry["ts"])
        if self.start_s is None or self.end_s is None:
            self.start_s = self.end_s = ts
        elif ts > self.end_s:
            self.end_s = ts
            if not self._fixed_bucket and (ts - self.start_s) > TARGET_POINTS * self.bucket_s:
                self._widen(choose_bucket_s(ts - self.start_s))
        elif ts < self.start_s:
            self.start_s = ts
            if not self._fixed_bucket and (self.end_s - ts) > TARGET_POINTS * self.bucket_s:
                self._widen(choose_bucket_s(self.end_s - ts))
        slot = int(ts // self.bucket_s) * self.bucket_s
        self.series[self.label(entry)][slot] += amount_of(entry.get("cost_usd"))

    def _widen(self, bucket_s: int) -> None:
        self.bucket_s = bucket_s
        for group, slots in self.series.items():
            merged: dict[int, float] = defaultdict(float)
            for slot, cost in slots.items():
                merged[int(slot // bucket_s) * bucket_s] += cost
            self.series[group] = merged

    def slots(self) -> list[int]:
        if self.start_s is None or self.end_s is None:
            return []
        first = int(self.start_s // self.bucket_s) * self.bucket_s
        last = int(self.end_s // self.bucket_s) * self.bucket_s
        return list(range(first, last + self.bucket_s, self.bucket_s))

    def lines(self, top: int = 8) -> dict[str, list[float]]:
        """Per-bucket spend of the `top` groups, "other" for the rest, and "all" (with > 1 group)."""
        slots = self.slots()
        totals = {group: sum(values.values()) for group, values in self.series.items()}
        keep = sorted(totals, key=lambda g: -totals[g])[:top]
        out: dict[str, list[float]] = {group: [self.series[group].get(s, 0.0) for s in slots] for group in keep}
        rest = [g for g in totals if g not in keep]
        if rest:
            out["other"] = [sum(self.series[g].get(s, 0.0) for g in rest) for s in slots]
        if len(totals) > 1:
            out[ALL_LABEL] = [sum(self.series[g].get(s, 0.0) for g in totals) for s in slots]
        return out

    def draw(self, out_path: str | Path, *, top: int = 8, title: str | None = None) -> Path:
        try:
            import matplotlib
        except ImportError as exc:  # matplotlib is the `plot` extra
            raise RuntimeError("--plot needs matplotlib: pip install 'tokenway[plot]'") from exc
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        out = Path(out_path)
        fig, (ax_rate, ax_cum) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
        slots = self.slots()
        if slots:
            times = [datetime.fromtimestamp(s, UTC) for s in slots]
            for group, per_bucket in self.lines(top).items():
                cumulative, running = [], 0.0
                for value in per_bucket:
                    running += value
                    cumulative.append(running)
                style: dict[str, Any] = {"color": "black", "linewidth": 2.0} if group == ALL_LABEL else {}
                ax_rate.step(times, per_bucket, where="post", label=group, **style)
                ax_cum.plot(times, cumulative, label=group, **style)
            ax_rate.set_ylabel(f"USD per {_bucket_label(self.bucket_s)}")
            ax_rate.legend(loc="upper left", fontsize="small", title=", ".join(self.fields) or None)
        else:
            ax_rate.text(0.5, 0.5, "no usage in the selected window", ha="center", va="center",
                         transform=ax_rate.transAxes)  # fmt: skip
        ax_cum.set_ylabel("cumulative USD")
        ax_cum.set_xlabel("time (UTC)")
        for ax in (ax_rate, ax_cum):
            ax.grid(True, alpha=0.3)
        fig.suptitle(title or f"tokenway spend by {', '.join(self.fields) or 'total'}")
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out


def plot_spend(
    entries: Iterable[dict[str, Any]],
    by: Sequence[str],
    out_path: str | Path,
    *,
    bucket_s: int | None = None,
    top: int = 8,
    title: str | None = None,
) -> Path:
    series = SpendSeries(by, bucket_s)
    for entry in entries:
        series.add(entry)
    return series.draw(out_path, top=top, title=title)


def _bucket_label(bucket_s: int) -> str:
    if bucket_s % 86400 == 0:
        return f"{bucket_s // 86400} d"
    if bucket_s % 3600 == 0:
        return f"{bucket_s // 3600} h"
    return f"{bucket_s // 60} min"
