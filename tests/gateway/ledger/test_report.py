from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from typing import Any

import pytest

from gateway.ledger.report import (
    METRIC_COLUMNS,
    ReportBuilder,
    ReportError,
    build_report,
    percentile,
    render,
    resolve_fields,
)
from gateway.ledger.writer import decode, encode
from tests.gateway.ledger.records import make_record

ENTRIES = [decode(encode(make_record(i))) for i in range(400)]


def test_totals_equal_the_sum_of_the_records() -> None:
    report = build_report(ENTRIES, ["tenant", "model"])
    total = report.total.metrics()
    assert total["requests"] == len(ENTRIES)
    assert total["input_tokens"] == sum(e["input_tokens"] for e in ENTRIES)
    assert total["cached_input_tokens"] == sum(e["cached_input_tokens"] for e in ENTRIES)
    assert total["output_tokens"] == sum(e["output_tokens"] for e in ENTRIES)
    assert total["cost_usd"] == pytest.approx(sum(e["cost_usd"] for e in ENTRIES))
    assert total["errors"] == sum(1 for e in ENTRIES if e["status"] != "ok")
    assert sum(int(total[c] or 0) for c in ("served", "rejected", "errors")) == total["requests"]
    rows = report.rows()
    assert sum(r["requests"] for r in rows) == total["requests"]
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(total["cost_usd"])


def test_groups_cpm_and_ttft_percentiles() -> None:
    report = build_report(ENTRIES, ["tenant"])
    by_tenant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in ENTRIES:
        by_tenant[e["tenant"]].append(e)
    rows = {r["tenant"]: r for r in report.rows()}
    assert set(rows) == set(by_tenant)
    for tenant, entries in by_tenant.items():
        row = rows[tenant]
        tokens = sum(e["input_tokens"] + e["output_tokens"] for e in entries)
        assert row["cpm_usd"] == pytest.approx(sum(e["cost_usd"] for e in entries) / tokens * 1e6)
        ttfts = sorted(e["ttft_s"] for e in entries if e["ttft_s"] is not None)
        assert row["ttft_p50_ms"] == pytest.approx(percentile(ttfts, 0.5) * 1000)  # type: ignore[operator]
        assert row["ttft_p90_ms"] == pytest.approx(percentile(ttfts, 0.9) * 1000)  # type: ignore[operator]
    costs = [r["cost_usd"] for r in report.rows()]
    assert costs == sorted(costs, reverse=True), "most expensive first"


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([], 0.5, None, id="empty"),
        pytest.param([3.0], 0.9, 3.0, id="one"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 0.5, 2.5, id="even-median"),
        pytest.param([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9, 9.1, id="p90-linear"),
    ],
)
def test_percentile_interpolates_linearly(values: list[float], q: float, expected: float | None) -> None:
    result = percentile(values, q)
    assert result == (pytest.approx(expected) if expected is not None else None)


def test_aliases_time_buckets_and_unknown_fields() -> None:
    assert resolve_fields(["key", "backend", "day"]) == ["key_id", "pool", "day"]
    with pytest.raises(ReportError, match="cannot group by 'prompt'"):
        resolve_fields(["prompt"])
    report = build_report(ENTRIES, ["day"])
    assert [r["day"] for r in report.rows()] == ["2025-06-15"]


def test_formats() -> None:
    report = build_report(ENTRIES, ["tenant", "model"])
    doc = json.loads(render(report, "json"))
    assert doc["by"] == ["tenant", "model"] and len(doc["groups"]) == 6
    assert doc["total"]["requests"] == 400

    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    assert rows[0] == ["tenant", "model", *METRIC_COLUMNS]
    assert rows[-1][0] == "TOTAL" and int(rows[-1][2]) == 400
    assert sum(int(r[2]) for r in rows[1:-1]) == 400

    table = render(report, "table").splitlines()
    assert table[0].split()[:6] == ["tenant", "model", "requests", "served", "rejected", "errors"]
    assert table[-1].startswith("TOTAL") and "400" in table[-1]
    assert len({len(line) for line in table[:2]}) == 1, "header and rule line up"


def test_empty_report_renders() -> None:
    report = build_report([], ["tenant"])
    assert "TOTAL" in render(report, "table")
    assert json.loads(render(report, "json"))["total"]["cpm_usd"] is None


def test_rejections_are_counted_apart_from_served_requests() -> None:
    statuses = ["ok", "ok", "rejected", "error", "aborted", "rejected"]
    entries = [dict(ENTRIES[i], status=status) for i, status in enumerate(statuses)]
    total = build_report(entries, []).total.metrics()
    assert (total["requests"], total["served"], total["rejected"], total["errors"]) == (6, 2, 2, 2)


def test_csv_rounds_money_and_latency() -> None:
    entries = [dict(e, cost_usd=0.123456789, ttft_s=0.0123456) for e in ENTRIES[:3]]
    rows = list(csv.reader(io.StringIO(render(build_report(entries, ["tenant"]), "csv"))))
    header = rows[0]
    row = dict(zip(header, rows[1], strict=True))
    assert row["cost_usd"] == "0.123457" and row["ttft_p50_ms"] == "12.3"
    assert len(row["cpm_usd"].split(".")[1]) == 4


def test_percentiles_stay_within_one_percent_past_the_exact_range() -> None:
    import random

    rng = random.Random(7)
    ttfts = [rng.lognormvariate(-2.0, 1.0) for _ in range(30_000)]
    entries = [{"ts": 1.0, "status": "ok", "tenant": "a", "ttft_s": t} for t in ttfts]
    builder = ReportBuilder(["tenant"])
    for entry in entries:
        builder.add(entry)
    report = builder.report()
    assert not report.groups[("a",)].ttfts_s.exact  # past 10,000 values: the sketch
    exact = sorted(ttfts)
    metrics = report.total.metrics()
    assert metrics["ttft_p50_ms"] == pytest.approx(percentile(exact, 0.5) * 1000, rel=0.01)  # type: ignore[operator]
    assert metrics["ttft_p90_ms"] == pytest.approx(percentile(exact, 0.9) * 1000, rel=0.01)  # type: ignore[operator]


def test_cache_writes_and_what_caching_saved_are_summed_per_group() -> None:
    """Hosted providers' cache writes and the saving travel through the ledger line into the report;
    a line without them (a self-hosted engine's, an older writer's) counts zero."""
    wrote = make_record(1, pool="claude", cache_write_tokens=900, cache_write_1h_tokens=100, cache_saved_usd=-0.001)
    read = make_record(2, pool="claude", cached_tokens=1000, cache_saved_usd=0.0027)
    plain = make_record(3, pool="owned")
    entries = [decode(encode(r)) for r in (wrote, read, plain)]
    assert "cache_saved_usd" not in entries[2] and entries[0]["cache_write_1h_input_tokens"] == 100
    report = build_report(entries, ["pool"])
    rows = {r["pool"]: r for r in report.rows()}
    assert rows["claude"]["cache_write_input_tokens"] == 1000
    assert rows["claude"]["cache_saved_usd"] == pytest.approx(0.0017)
    assert rows["owned"]["cache_write_input_tokens"] == 0 and rows["owned"]["cache_saved_usd"] == 0.0
    assert "cache_saved_usd" in METRIC_COLUMNS
