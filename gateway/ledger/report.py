"""Usage report: ledger entries grouped by fields, with requests, tokens, cost, CPM and TTFT spread.

Entries stream through `ReportBuilder.add` one at a time: a group holds counters and a bounded
quantile sketch (`QuantileSketch`, below), never its rows, so a report over ten million rows needs the memory of
its groups, not of its rows. `requests` counts every record; `served` those that ran (status ok),
`rejected` those turned away before an engine (limits, budgets, SLO), `errors` failures and client
aborts. `cache_write_input_tokens` are prompt tokens written to a hosted provider's cache (either
lifetime), `cached_input_tokens` those read from a cache; `cache_saved_usd` is what caching saved
(the cost with every prompt token at the input price, less the cost). CPM is cost per million
tokens, input (cached included) plus output. TTFT percentiles are over the requests that had a
first token: numpy's linear interpolation between ranks while a group has up to 10,000 of them,
within 1 % above. Group fields are ledger fields (writer.py), plus `key`
(= key_id), `backend` (= pool), and the time buckets `day` and `hour` (UTC) of the finish time;
`adapter` is the LoRA adapter a request named ("" for a base model's own requests) and `base_model`
the model that ran (an adapter's base, else the model): docs/adapters.md.

## Percentiles in bounded memory (`QuantileSketch`)

Percentiles of a stream in bounded memory: exact for the first values, a log histogram after.

A group keeps its TTFTs exactly (and its percentiles are numpy's linear interpolation between
ranks) until it holds `exact_up_to` of them; then they move into a histogram of logarithmic bins
(the bin of x is ceil(log_gamma x), gamma = (1 + a) / (1 - a)), and a percentile is the midpoint of
the bin holding that rank: within relative error `a` of a value of the stream at that rank
(DDSketch's guarantee: Masson, Rim and Lee, VLDB 2019). Memory is then one counter per occupied
bin: TTFTs between 1 ms and 10 min occupy at most ~670 bins at a = 1 %, whatever the row count.
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

RELATIVE_ACCURACY = 0.01
EXACT_UP_TO = 10_000


class QuantileSketch:
    __slots__ = ("_bins", "_count", "_exact", "_exact_up_to", "_gamma_ln", "_zeros")

    def __init__(self, exact_up_to: int = EXACT_UP_TO, relative_accuracy: float = RELATIVE_ACCURACY) -> None:
        self._exact: list[float] | None = []
        self._exact_up_to = exact_up_to
        self._gamma_ln = math.log((1 + relative_accuracy) / (1 - relative_accuracy))
        self._bins: dict[int, int] = {}
        self._zeros = 0  # values <= 0 (a clock that did not move) sit below every bin
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def add(self, value: float) -> None:
        self._count += 1
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > self._exact_up_to:
                values, self._exact = self._exact, None
                for v in values:
                    self._bin(v)
            return
        self._bin(value)

    def _bin(self, value: float) -> None:
        if value <= 0.0:
            self._zeros += 1
            return
        index = math.ceil(math.log(value) / self._gamma_ln)
        self._bins[index] = self._bins.get(index, 0) + 1

    def merge(self, other: QuantileSketch) -> None:
        if (
            self._exact is not None
            and other._exact is not None
            and len(self._exact) + len(other._exact) <= self._exact_up_to
        ):
            self._exact.extend(other._exact)
            self._count += other._count
            return
        if self._exact is not None:
            values, self._exact = self._exact, None
            for v in values:
                self._bin(v)
        if other._exact is not None:
            for v in other._exact:
                self._bin(v)
        else:
            for index, n in other._bins.items():
                self._bins[index] = self._bins.get(index, 0) + n
            self._zeros += other._zeros
        self._count += other._count

    def quantile(self, q: float) -> float | None:
        if self._count == 0:
            return None
        if self._exact is not None:
            return percentile(sorted(self._exact), q)
        rank = q * (self._count - 1)  # the 0-based rank numpy interpolates at
        seen = self._zeros
        if rank < seen:
            return 0.0
        for index in sorted(self._bins):
            seen += self._bins[index]
            if rank < seen:
                # the bin covers (gamma^(i-1), gamma^i]; its midpoint is within the accuracy of both ends
                return 2.0 * math.exp(index * self._gamma_ln) / (1.0 + math.exp(self._gamma_ln))
        return 2.0 * math.exp(max(self._bins) * self._gamma_ln) / (1.0 + math.exp(self._gamma_ln))


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """numpy's default (linear interpolation between the ranks around q * (n - 1))."""
    if not sorted_values:
        return None
    rank = (len(sorted_values) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


Format = Literal["table", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "csv", "json")

FIELD_ALIASES = {"key": "key_id", "backend": "pool"}
TIME_FIELDS = {"day": "%Y-%m-%d", "hour": "%Y-%m-%dT%H:00Z"}
GROUPABLE = frozenset(
    {
        "tenant", "key_id", "requested_model", "model", "served_model", "fallback_from", "fallback_reason",
        "pool", "endpoint", "prefill_endpoint", "engine", "api", "stream", "status", "http_status",
        "error_code", "reject_reason", "usage_source", "program", "user", "tag", "adapter", "base_model",
    }
)  # fmt: skip
METRIC_COLUMNS = (
    "requests", "served", "rejected", "errors", "input_tokens", "cached_input_tokens", "cache_write_input_tokens",
    "output_tokens", "cost_usd", "cache_saved_usd", "cpm_usd", "ttft_p50_ms", "ttft_p90_ms",
)  # fmt: skip
# decimals of the money and latency columns in table and csv output (json keeps full precision)
DECIMALS = {"cost_usd": 6, "cache_saved_usd": 6, "cpm_usd": 4, "ttft_p50_ms": 1, "ttft_p90_ms": 1}

__all__ = ["METRIC_COLUMNS", "Report", "ReportBuilder", "ReportError", "build_report", "percentile", "render"]


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


def count_of(value: Any) -> int:
    """A record's token count as the writer writes it (an int), else 0: a line damaged on disk or
    edited by hand (a count that is text) costs the report that figure, never the report itself."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def amount_of(value: Any) -> float:
    """A record's dollar amount (or time) as a finite number, else 0 (see `count_of`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value)


@dataclass(slots=True)
class GroupTotals:
    requests: int = 0
    served: int = 0
    rejected: int = 0
    errors: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    cache_saved_usd: float = 0.0
    ttfts_s: QuantileSketch = field(default_factory=QuantileSketch)

    def add(self, entry: dict[str, Any]) -> None:
        self.requests += 1
        status = entry.get("status")
        if status == "ok":
            self.served += 1
        elif status == "rejected":
            self.rejected += 1
        elif status in ("error", "aborted"):
            self.errors += 1
        self.input_tokens += count_of(entry.get("input_tokens"))
        self.cached_input_tokens += count_of(entry.get("cached_input_tokens"))
        self.cache_write_input_tokens += count_of(entry.get("cache_write_input_tokens")) + count_of(
            entry.get("cache_write_1h_input_tokens")
        )
        self.output_tokens += count_of(entry.get("output_tokens"))
        self.cost_usd += amount_of(entry.get("cost_usd"))
        self.cache_saved_usd += amount_of(entry.get("cache_saved_usd"))
        ttft = entry.get("ttft_s")
        if ttft is not None and amount_of(ttft) == ttft:  # a finite number
            self.ttfts_s.add(ttft)

    def merge(self, other: GroupTotals) -> None:
        self.requests += other.requests
        self.served += other.served
        self.rejected += other.rejected
        self.errors += other.errors
        self.input_tokens += other.input_tokens
        self.cached_input_tokens += other.cached_input_tokens
        self.cache_write_input_tokens += other.cache_write_input_tokens
        self.output_tokens += other.output_tokens
        self.cost_usd += other.cost_usd
        self.cache_saved_usd += other.cache_saved_usd
        self.ttfts_s.merge(other.ttfts_s)

    @property
    def cpm_usd(self) -> float | None:
        tokens = self.input_tokens + self.output_tokens
        return self.cost_usd / tokens * 1e6 if tokens else None

    def metrics(self) -> dict[str, float | int | None]:
        p50, p90 = self.ttfts_s.quantile(0.5), self.ttfts_s.quantile(0.9)
        return {
            "requests": self.requests,
            "served": self.served,
            "rejected": self.rejected,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            "cache_write_input_tokens": self.cache_write_input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
            "cache_saved_usd": self.cache_saved_usd,
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
        elif name == "adapter":  # the LoRA adapter the request named; "" for a base model's own requests
            values.append(str(entry.get("model") or "") if entry.get("base_model") else "")
        elif name == "base_model":  # the model that ran: an adapter's base, else the model itself
            values.append(str(entry.get("base_model") or entry.get("model") or ""))
        else:
            value = entry.get(name)
            values.append(value if isinstance(value, str) else ("" if value is None else str(value)))
    return tuple(values)


class ReportBuilder:
    """Entries in, one at a time; `report()` at the end. Memory: the groups, never the rows."""

    def __init__(self, by: Sequence[str]) -> None:
        self.fields = resolve_fields(by)
        self.groups: dict[tuple[str, ...], GroupTotals] = {}
        # `--by tag`: a record counts in the group of each of its tags (untagged: ""), so groups may
        # overlap and the total is kept apart, each record once
        self._by_tag = "tag" in self.fields
        self._total = GroupTotals()

    def add(self, entry: dict[str, Any]) -> None:
        if entry.get("kind") == "outcome":  # a program's end, not a request (outcomes.py reports them)
            return
        if not self._by_tag:
            self._add(group_key(entry, self.fields) if self.fields else (), entry)
            return
        self._total.add(entry)
        tags = entry.get("tags")
        for tag in tags if isinstance(tags, list) and tags else ("",):
            self._add(group_key({**entry, "tag": tag}, self.fields), entry)

    def _add(self, key: tuple[str, ...], entry: dict[str, Any]) -> None:
        totals = self.groups.get(key)
        if totals is None:
            totals = self.groups[key] = GroupTotals()
        totals.add(entry)

    def report(self) -> Report:
        if self._by_tag:
            return Report(self.fields, self.groups, self._total)
        total = GroupTotals()
        for totals in self.groups.values():
            total.merge(totals)
        return Report(self.fields, self.groups, total)


def build_report(entries: Iterable[dict[str, Any]], by: Sequence[str]) -> Report:
    builder = ReportBuilder(by)
    for entry in entries:
        builder.add(entry)
    return builder.report()


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
        writer.writerow([*(row[c] for c in report.by), *(_csv_cell(c, row[c]) for c in METRIC_COLUMNS)])
    total = report.total.metrics()
    label = ["TOTAL", *[""] * (len(report.by) - 1)] if report.by else []
    writer.writerow([*label, *(_csv_cell(c, total[c]) for c in METRIC_COLUMNS)])
    return buf.getvalue()


def _csv_cell(column: str, value: Any) -> Any:
    """Money to the micro-dollar, CPM to a hundredth of a cent, latency to 0.1 ms."""
    if value is None:
        return ""
    decimals = DECIMALS.get(column)
    return f"{value:.{decimals}f}" if decimals is not None else value


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    decimals = DECIMALS.get(column)
    if decimals is not None:
        return f"{value:.{decimals}f}"
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
