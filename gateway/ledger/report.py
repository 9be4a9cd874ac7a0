"""Usage report: ledger entries grouped by fields, with requests, tokens, cost, CPM and TTFT spread.

CPM is cost per million tokens, input (cached included) plus output. TTFT percentiles use linear
interpolation between ranks (numpy's default) over the requests that had a first token. Group
fields are ledger fields (codec.py), plus `key` (= key_id), `backend` (= pool), and the time buckets
`day` and `hour` (UTC) of the finish time.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

Format = Literal["table", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "csv", "json")

FIELD_ALIASES = {"key": "key_id", "backend": "pool"}
TIME_FIELDS = {"day": "%Y-%m-%d", "hour": "%Y-%m-%dT%H:00Z"}
GROUPABLE = frozenset(
    {
        "tenant", "key_id", "requested_model", "model", "served_model", "fallback_from", "fallback_reason",
        "pool", "endpoint", "prefill_endpoint", "engine", "api", "stream", "status", "http_status",
        "error_code", "reject_reason", "usage_source",
    }
)  # fmt: skip
METRIC_COLUMNS = (
    "requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "cost_usd", "cpm_usd",
    "ttft_p50_ms", "ttft_p90_ms",
)  # fmt: skip


class ReportError(ValueError):
    """The report cannot be made as asked (bad --by, --since or ledger directory): a CLI message."""


def resolve_fields(by: Sequence[str]) -> list[str]:
    """Canonical group fields for `--by`; raises ReportError naming an unknown one."""
    out = []
    for name in by:
        name = FIELD_ALIASES.get(name.strip(), name.strip())
        if not name:
            continue
        if name not in GROUPABLE and name not in TIME_FIELDS:
            known = ", ".join(sorted(GROUPABLE | set(TIME_FIELDS) | set(FIELD_ALIASES)))
            raise ReportError(f"cannot group by {name!r}; known fields: {known}")
        out.append(name)
    return out


@dataclass(slots=True)
class GroupTotals:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)

    def add(self, entry: dict[str, Any]) -> None:
        self.requests += 1
        if entry.get("status") in ("error", "aborted"):
            self.errors += 1
        self.input_tokens += int(entry.get("input_tokens") or 0)
        self.cached_input_tokens += int(entry.get("cached_input_tokens") or 0)
        self.output_tokens += int(entry.get("output_tokens") or 0)
        self.cost_usd += float(entry.get("cost_usd") or 0.0)
        ttft = entry.get("ttft_s")
        if isinstance(ttft, int | float):
            self.ttfts_s.append(float(ttft))

    def merge(self, other: GroupTotals) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.input_tokens += other.input_tokens
        self.cached_input_tokens += other.cached_input_tokens
        self.output_tokens += other.output_tokens
        self.cost_usd += other.cost_usd
        self.ttfts_s.extend(other.ttfts_s)

    @property
    def cpm_usd(self) -> float | None:
        tokens = self.input_tokens + self.output_tokens
        return self.cost_usd / tokens * 1e6 if tokens else None

    def metrics(self) -> dict[str, float | int | None]:
        ttfts = sorted(self.ttfts_s)
        p50, p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
            "cpm_usd": self.cpm_usd,
            "ttft_p50_ms": p50 * 1000.0 if p50 is not None else None,
            "ttft_p90_ms": p90 * 1000.0 if p90 is not None else None,
        }


@dataclass(slots=True)
class Report:
    by: list[str]
    groups: dict[tuple[str, ...], GroupTotals]
    total: GroupTotals

    def rows(self) -> list[dict[str, Any]]:
        """One dict per group, most expensive first: group fields then METRIC_COLUMNS."""
        ordered = sorted(self.groups.items(), key=lambda kv: (-kv[1].cost_usd, kv[0]))
        return [{**dict(zip(self.by, key, strict=True)), **totals.metrics()} for key, totals in ordered]


def group_key(entry: dict[str, Any], by: Sequence[str]) -> tuple[str, ...]:
    values = []
    for name in by:
        if name in TIME_FIELDS:
            values.append(datetime.fromtimestamp(float(entry["ts"]), UTC).strftime(TIME_FIELDS[name]))
        else:
            value = entry.get(name)
            values.append("" if value is None else str(value))
    return tuple(values)


def build_report(entries: Iterable[dict[str, Any]], by: Sequence[str]) -> Report:
    fields = resolve_fields(by)
    groups: dict[tuple[str, ...], GroupTotals] = {}
    for entry in entries:
        key = group_key(entry, fields)
        totals = groups.get(key)
        if totals is None:
            totals = groups[key] = GroupTotals()
        totals.add(entry)
    total = GroupTotals()
    for totals in groups.values():
        total.merge(totals)
    return Report(fields, groups, total)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    rank = (len(sorted_values) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def render(report: Report, fmt: Format) -> str:
    if fmt == "json":
        return _render_json(report)
    if fmt == "csv":
        return _render_csv(report)
    if fmt == "table":
        return _render_table(report)
    raise ReportError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def _render_json(report: Report) -> str:
    doc = {"by": report.by, "groups": report.rows(), "total": report.total.metrics()}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n"


def _render_csv(report: Report) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*report.by, *METRIC_COLUMNS])
    for row in report.rows():
        writer.writerow(["" if row[c] is None else row[c] for c in (*report.by, *METRIC_COLUMNS)])
    total = report.total.metrics()
    label = ["TOTAL", *[""] * (len(report.by) - 1)] if report.by else []
    writer.writerow([*label, *("" if total[c] is None else total[c] for c in METRIC_COLUMNS)])
    return buf.getvalue()


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "cost_usd":
        return f"{value:.6f}"
    if column == "cpm_usd":
        return f"{value:.4f}"
    if column.endswith("_ms"):
        return f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value) if value != "" else "-"


def _render_table(report: Report) -> str:
    columns = [*report.by, *METRIC_COLUMNS]
    body = [[_cell(c, row[c]) for c in columns] for row in report.rows()]
    total_metrics = report.total.metrics()
    label = ["TOTAL", *[""] * (len(report.by) - 1)] if report.by else []
    total = [*label, *(_cell(c, total_metrics[c]) for c in METRIC_COLUMNS)]
    widths = [max(len(c), *(len(r[i]) for r in [*body, total])) for i, c in enumerate(columns)]
    numeric = [c in METRIC_COLUMNS for c in columns]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule, *(line(r) for r in body), rule, line(total)]) + "\n"
