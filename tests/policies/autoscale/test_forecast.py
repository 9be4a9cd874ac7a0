"""The short forecast: Holt's smoothing, and a step up taken at once instead of smoothed."""

from __future__ import annotations

import pytest

from policies.autoscale.forecast import Forecast, stepped_up


def test_a_rate_is_smoothed_towards_the_measurement() -> None:
    forecast = Forecast().update(100.0, 1.0, 0.5, 0.3).update(500.0, 3.0, 0.5, 0.3)
    assert forecast.level == pytest.approx(300.0)
    assert forecast.trend == pytest.approx(0.3 * 200.0 / 2.0)


def test_a_step_takes_the_measured_rate_and_its_rise_into_the_trend() -> None:
    steady = Forecast(100.0, 1.0, 1.0)
    stepped = steady.update(500.0, 3.0, 0.5, 0.3, step=True)
    assert (stepped.level, stepped.at_s) == (500.0, 3.0)
    assert stepped.trend == pytest.approx(0.3 * 400.0 / 2.0 + 0.7 * 1.0)


def test_a_fall_stays_smoothed_even_in_a_step_window() -> None:
    assert Forecast(500.0, 0.0, 1.0).update(100.0, 3.0, 0.5, 0.3, step=True).level == pytest.approx(300.0)


@pytest.mark.parametrize(
    ("count", "expected", "z", "step"),
    [
        (11, 5.0, 3.0, False),  # 5 + 3 x 2.24 = 11.7: within the noise of a Poisson count of 5
        (12, 5.0, 3.0, True),
        (24, 5.0, 3.0, True),  # the chat burst's first window on the benchmark's day
        (3, 0.0, 3.0, False),  # from nothing, the deviation of a count of 1: more than 3 arrivals
        (4, 0.0, 3.0, True),
        (1000, 5.0, 0.0, False),  # z 0: off
    ],
)
def test_a_step_is_a_count_improbable_for_its_forecast(count: int, expected: float, z: float, step: bool) -> None:
    assert stepped_up(count, expected, z) is step
