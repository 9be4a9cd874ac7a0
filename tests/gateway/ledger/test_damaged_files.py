"""Ledger files read back damaged (bench/chaos/disk_fuzz.py): a line longer than any record is skipped a
chunk at a time, never held whole, and a file that cannot be opened is skipped with a warning; the
records around either are all read, by the reader and by the tenants' spend."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.console.tenant_spend import _new_file_entries
from gateway.ledger.plot import SpendSeries
from gateway.ledger.reader import MAX_LINE_BYTES, ReadStats, bounded_lines, iter_entries
from gateway.ledger.report import ReportBuilder
from gateway.ledger.writer import encode
from tests.gateway.ledger.records import make_record

HUGE = b"x" * (3 * MAX_LINE_BYTES) + b"\n"


class Watched(io.BytesIO):
    """A file that remembers the most bytes one call returned."""

    most = 0

    def readline(self, size: int | None = -1) -> bytes:
        line = super().readline(size)
        self.most = max(self.most, len(line))
        return line

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.most = max(self.most, len(data))
        return data


def test_a_line_longer_than_any_record_is_passed_over_without_being_held() -> None:
    f = Watched(b"a\n" + HUGE + b"b\n" + b"y" * (MAX_LINE_BYTES + 5))
    assert list(bounded_lines(f)) == [b"a\n", len(HUGE), b"b\n", MAX_LINE_BYTES + 5]
    assert f.most <= MAX_LINE_BYTES + 1


def test_records_around_a_huge_line_are_all_read(tmp_path: Path) -> None:
    path = tmp_path / "usage-20250101-001.jsonl"
    path.write_bytes(encode(make_record(1)) + HUGE + encode(make_record(2)))
    stats, warnings = ReadStats(), list[str]()
    ids = [e["request_id"] for e in iter_entries(tmp_path, stats=stats, warn=warnings.append)]
    assert ids == ["req-00000001", "req-00000002"]
    assert stats.corrupt_lines == 1 and ":2: a line of" in warnings[0]


def test_a_file_that_cannot_be_opened_costs_only_its_own_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "usage-20250101-001.jsonl").write_bytes(encode(make_record(1)))
    (tmp_path / "usage-20250101-002.jsonl").write_bytes(encode(make_record(2)))
    real_open = Path.open

    def refusing(self: Path, *args: object, **kwargs: object) -> object:
        if self.name == "usage-20250101-001.jsonl":  # chmod 000, as a test run as root cannot make it
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", refusing)
    warnings: list[str] = []
    assert [e["request_id"] for e in iter_entries(tmp_path, warn=warnings.append)] == ["req-00000002"]
    assert len(warnings) == 1 and "not read" in warnings[0]
    offsets: dict[str, int] = {}
    assert [e["request_id"] for e in _new_file_entries(tmp_path, 0.0, offsets)] == ["req-00000002"]


def test_the_tenants_spend_reads_past_a_huge_line(tmp_path: Path) -> None:
    path = tmp_path / "usage-20250101-001.jsonl"
    first, second = encode(make_record(1)), encode(make_record(2))
    path.write_bytes(first + HUGE + second)
    offsets: dict[str, int] = {}
    assert [e["request_id"] for e in _new_file_entries(tmp_path, 0.0, offsets)] == ["req-00000001", "req-00000002"]
    assert offsets[path.name] == path.stat().st_size


@pytest.mark.parametrize("bad", ["12", None, [], {"a": 1}, True, "x"])
def test_a_record_whose_figures_are_of_the_wrong_type_costs_the_report_those_figures_only(bad: object) -> None:
    good = {"ts": 1_796_000_000.0, "tenant": "t", "status": "ok", "input_tokens": 3, "output_tokens": 4,
            "cost_usd": 0.5, "ttft_s": 0.2}  # fmt: skip
    damaged = {**good, "input_tokens": bad, "output_tokens": bad, "cost_usd": bad, "ttft_s": bad,
               "cache_saved_usd": bad, "cached_input_tokens": bad}  # fmt: skip
    builder, series = ReportBuilder(["tenant"]), SpendSeries(["tenant"])
    for entry in (good, damaged):
        builder.add(entry)
        series.add(entry)
    total = builder.report().total
    assert (total.requests, total.input_tokens, total.output_tokens, total.cost_usd) == (2, 3, 4, 0.5)
    assert sum(sum(slots.values()) for slots in series.series.values()) == 0.5
