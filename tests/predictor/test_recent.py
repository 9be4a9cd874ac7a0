from __future__ import annotations

import math

import pytest

from predictor.service import RecentTtftCorrection


def test_no_correction_until_three_first_tokens() -> None:
    correction = RecentTtftCorrection(window_s=4.0, weight=0.5)
    assert correction.factor(0.0) == 1.0
    correction.add(1.0, actual_ms=200.0, uncorrected_ms=100.0)
    correction.add(1.1, actual_ms=200.0, uncorrected_ms=100.0)
    assert correction.factor(1.2) == 1.0
    correction.add(1.2, actual_ms=200.0, uncorrected_ms=100.0)
    assert correction.factor(1.3) == pytest.approx(math.sqrt(2.0))  # exp(0.5 * ln 2)


def test_the_median_resists_one_outlier_and_old_errors_age_out() -> None:
    correction = RecentTtftCorrection(window_s=4.0, weight=1.0)
    for at_s, actual_ms in ((0.0, 120.0), (0.5, 120.0), (1.0, 5000.0), (3.0, 80.0), (3.5, 80.0)):
        correction.add(at_s, actual_ms, uncorrected_ms=100.0)
    assert correction.factor(3.6) == pytest.approx(1.2)  # median of 1.2, 1.2, 50, 0.8, 0.8
    assert correction.factor(4.7) == pytest.approx(0.8)  # 0.0 and 0.5 aged out: 50, 0.8, 0.8
    assert correction.factor(6.0) == 1.0  # only the two at 3.0 and 3.5 are left
    assert correction.factor(100.0) == 1.0


def test_disabled_or_meaningless_outcomes_change_nothing() -> None:
    off = RecentTtftCorrection(window_s=0.0, weight=0.5)
    for at_s in (0.0, 0.1, 0.2):
        off.add(at_s, 300.0, 100.0)
    assert not off.enabled and off.factor(0.3) == 1.0
    correction = RecentTtftCorrection(window_s=4.0, weight=0.5)
    for actual_ms, uncorrected_ms in ((0.0, 100.0), (-5.0, 100.0), (100.0, 0.0), (math.nan, 100.0)):
        correction.add(0.0, actual_ms, uncorrected_ms)
    assert correction.factor(0.1) == 1.0


def test_memory_is_bounded_to_the_newest_residuals() -> None:
    correction = RecentTtftCorrection(window_s=1e9, weight=1.0, max_residuals=5)
    for i in range(100):
        correction.add(float(i), actual_ms=400.0 if i < 95 else 100.0, uncorrected_ms=100.0)
    assert correction.factor(100.0) == 1.0  # the last five were exact; the 95 before were dropped
