"""Service windows and fair-share ratios."""

from __future__ import annotations

import pytest

from policies.flow.order import ServiceWindow, fair_share_ratios


def test_window_sums_recent_service_only() -> None:
    window = ServiceWindow(window_s=60.0)
    window.add("a", 100.0, now_s=0.0)
    window.add("a", 50.0, now_s=0.5)
    window.add("b", 30.0, now_s=30.0)
    assert window.totals(now_s=30.0) == {"a": 150.0, "b": 30.0}
    assert window.totals(now_s=75.0) == {"b": 30.0}
    assert window.totals(now_s=200.0) == {}


def test_fair_share_ratio_is_share_over_weight_share() -> None:
    ratios = fair_share_ratios({"a": 300.0, "b": 100.0}, {"a": 3.0, "b": 1.0})
    assert ratios == pytest.approx({"a": 1.0, "b": 1.0})
    skewed = fair_share_ratios({"a": 100.0, "b": 100.0}, {"a": 3.0, "b": 1.0})
    assert skewed["a"] == pytest.approx(2 / 3) and skewed["b"] == pytest.approx(2.0)
    assert fair_share_ratios({}, {}) == {}
