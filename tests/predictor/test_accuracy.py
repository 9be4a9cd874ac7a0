from __future__ import annotations

import math

import pytest

from predictor.features import AccuracyScore, OnlineAccuracy, mape_pct, p90_coverage


def test_mape_and_coverage_math() -> None:
    assert mape_pct([110, 90, 100], [100, 100, 100]) == pytest.approx(20 / 3)
    assert mape_pct([50], [100]) == pytest.approx(50)
    assert p90_coverage([100, 100, 100, 100], [50, 100, 101, 200]) == 0.5
    assert math.isnan(mape_pct([], []))
    score = AccuracyScore.of([10, 20], [15, 25], [10, 30])
    assert (score.samples, score.p90_coverage) == (2, 0.5)
    assert score.mape_pct == pytest.approx(100 * (0 + 1 / 3) / 2)
    assert score.as_dict()["samples"] == 2
    assert AccuracyScore(0, math.nan, math.nan).as_dict() == {"samples": 0, "mape_pct": None, "p90_coverage": None}


def test_online_window_keeps_the_most_recent_predictions() -> None:
    online = OnlineAccuracy(window=4)
    for _ in range(10):
        online.record(200.0, 300.0, 100.0, "prior")  # 100 % off, covered
    for _ in range(4):
        online.record(110.0, 95.0, 100.0, "model")  # 10 % off, not covered
    score = online.score()
    assert (score.samples, score.p90_coverage) == (4, 0.0)
    assert score.mape_pct == pytest.approx(10.0)
    assert online.total == 14


def test_online_split_by_source_and_unusable_actuals() -> None:
    online = OnlineAccuracy(window=100)
    online.record(120.0, 150.0, 100.0, "prior")
    online.record(100.0, 90.0, 100.0, "model")
    online.record(100.0, 90.0, 0.0, "model")  # no percentage error for a zero actual
    online.record(100.0, 90.0, math.nan, "model")
    assert online.score().samples == 2
    assert online.score("prior").mape_pct == pytest.approx(20.0)
    assert online.score("model") == AccuracyScore(1, 0.0, 0.0)
    assert OnlineAccuracy(10).score().samples == 0
