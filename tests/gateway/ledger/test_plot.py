from __future__ import annotations

from pathlib import Path

import pytest

from gateway.ledger.plot import SpendSeries, choose_bucket_s, plot_spend
from gateway.ledger.writer import decode, encode
from tests.gateway.ledger.records import make_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_spend_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    entries = [decode(encode(make_record(i, started_at_unix_s=1_750_000_000 + i * 30))) for i in range(300)]
    out = plot_spend(entries, ["tenant"], tmp_path / "spend.png", top=2)
    assert out.read_bytes()[:8] == PNG_MAGIC
    empty = plot_spend([], ["tenant"], tmp_path / "empty.png")
    assert empty.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("span_s", "bucket_s"),
    [
        pytest.param(600, 60, id="10min"),
        pytest.param(86400, 3600, id="1day"),
        pytest.param(90 * 86400, 86400, id="90days"),
    ],
)
def test_bucket_keeps_about_sixty_points(span_s: int, bucket_s: int) -> None:
    assert choose_bucket_s(span_s) == bucket_s


def test_the_all_line_is_the_total_and_rows_without_a_tenant_are_their_own_group() -> None:
    entries = [
        {"ts": 1_750_000_000.0, "tenant": "acme", "cost_usd": 1.0},
        {"ts": 1_750_000_010.0, "tenant": "globex", "cost_usd": 2.0},
        {"ts": 1_750_000_020.0, "tenant": "", "cost_usd": 0.0},  # rejected before authentication
    ]
    series = SpendSeries(["tenant"])
    for entry in entries:
        series.add(entry)
    lines = series.lines()
    assert set(lines) == {"acme", "globex", "(none)", "all"}
    assert sum(lines["all"]) == pytest.approx(3.0)


def test_buckets_widen_with_the_span_and_keep_the_sums() -> None:
    series = SpendSeries(["tenant"])
    for i in range(2000):  # 2000 minutes: 60 s buckets would be 2000 points
        series.add({"ts": 1_750_000_000.0 + i * 60, "tenant": "a", "cost_usd": 0.5})
    assert series.bucket_s == choose_bucket_s(1999 * 60) and len(series.slots()) <= 61
    assert sum(series.lines()["a"]) == pytest.approx(1000.0)
