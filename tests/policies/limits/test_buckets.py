"""Bucket arithmetic and calendar periods (the Lua script is held to the same numbers in test_redis_store)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from policies.limits import memory_store


@pytest.mark.parametrize(
    ("used", "updated", "now", "rate", "expected"),
    [
        (100.0, 0.0, 1.0, 10.0, 90.0),
        (100.0, 0.0, 20.0, 10.0, 0.0),  # never below empty
        (100.0, 5.0, 4.0, 10.0, 100.0),  # a clock step back drains nothing
        (700.0, 0.0, 10.0, 10.0, 600.0),  # debt drains like anything else
    ],
    ids=["drains", "floor", "clock-back", "debt"],
)
def test_drained(used: float, updated: float, now: float, rate: float, expected: float) -> None:
    assert memory_store.drained(used, updated, now, rate) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("used", "cost", "capacity", "rate", "expected"),
    [
        (0.0, 10.0, 100.0, 1.0, 0.0),
        (95.0, 10.0, 100.0, 1.0, 5.0),
        (150.0, 10.0, 100.0, 2.0, 30.0),
        (0.0, 101.0, 100.0, 1.0, math.inf),
    ],
    ids=["fits", "short", "in-debt", "never"],
)
def test_wait(used: float, cost: float, capacity: float, rate: float, expected: float) -> None:
    assert memory_store.wait_s(used, cost, capacity, rate) == pytest.approx(expected)


def test_reset_is_time_until_full() -> None:
    assert memory_store.reset_s(600.0, 100.0) == pytest.approx(6.0)
    assert memory_store.reset_s(0.0, 100.0) == 0.0


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC),
        datetime(2024, 3, 1, tzinfo=UTC),
        datetime(2025, 12, 31, 12, tzinfo=UTC),
        datetime(2026, 1, 1, tzinfo=UTC),
    ],
    ids=["leap-day", "march", "new-years-eve", "new-year"],
)
def test_periods_follow_the_utc_calendar(moment: datetime) -> None:
    now = moment.timestamp()
    month = memory_store.period_id("month", now)
    assert month == moment.year * 12 + moment.month - 1
    assert memory_store.period_end_s("month", month) > now >= memory_store.period_end_s("month", month - 1)
    day = memory_store.period_id("day", now)
    assert memory_store.period_end_s("day", day) - now <= 86_400
