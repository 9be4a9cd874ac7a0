"""The planning loop's token rates: a pass off the schedule (a held request, a freed device) a fraction
of a second after the last one must not measure a rate over that sliver of time."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from backends.autoscale.executor import Executor, RoleState
from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.supervisor import Supervisor
from gateway.autoscale.loop import Autoscaler
from policies.autoscale.forecast import LeadTimes
from policies.autoscale.planner import replica_load


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def autoscaler(tmp_path: Path, clock: Clock, **policy: Any) -> Autoscaler:
    pool = PoolConfig.model_validate(
        {
            "name": "chat",
            "model": "llama-3.1-8b",
            "engine": "sim",
            "preset": "llama-3.1-8b@h100",
            "replicas": 0,
            "devices": "auto",
            "autoscale": {"min_replicas": 0, "max_replicas": 4, "interval_s": 2.0, **policy},
        }
    )
    fleet = Fleet.from_configs([pool])
    settings = BackendsSettings.model_validate(
        {"devices": [0, 1, 2, 3], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run")}
    )
    executor = Executor(Supervisor(settings), fleet, settings, lead=LeadTimes(), clock=clock)
    executor.apply = lambda plans: None  # type: ignore[method-assign]  # the rates are under test, not the replicas
    return Autoscaler(fleet, executor, clock=clock)


def test_a_pass_soon_after_another_keeps_the_forecast_and_its_tokens(tmp_path: Path) -> None:
    clock = Clock()
    scaler = autoscaler(tmp_path, clock)
    scaler.tick()  # the first pass: no window yet
    for _ in range(4):  # 4 x 500 prompt tokens over 2 s: 1000 tok/s
        scaler.arrived("chat", 500, 16)
    clock.now += 2.0
    scaler.tick()
    level = scaler.forecasts["chat"][0].level
    assert level == 1000.0
    scaler.arrived("chat", 500, 16)  # one arrival 0.1 s later, and a pass at once (a held request)
    clock.now += 0.1
    scaler.tick()
    assert scaler.forecasts["chat"][0].level == level  # not 5000 tok/s
    clock.now += 1.9
    scaler.tick()  # the next full window counts that arrival: 500 tokens over 2 s
    forecast = scaler.forecasts["chat"][0]
    assert forecast.at_s == clock.now
    assert 250.0 < forecast.level < level


def test_floors_from_the_api_and_the_schedule_reach_the_planner(tmp_path: Path) -> None:
    clock = Clock()
    window = {"start": "10:30", "end": "11:00", "min_replicas": 3}
    scaler = autoscaler(tmp_path, clock, schedule=[window], startup_s=5.0)
    scaler.wall_clock = lambda: datetime(2026, 12, 2, 10, 29, 55, tzinfo=UTC).timestamp() + clock.now - 100.0
    plan = scaler.tick()[0]
    assert plan.roles[0].wanted == 3 and "scheduled floor 3 (schedule 10:30-11:00) opens in 5 s" in plan.reason
    scaler.set_floor("chat", 4, 10.0, 5.0)
    assert [f["min_replicas"] for f in scaler.status()["pools"][0]["floors"]] == [4, 3]
    for _ in range(15):
        scaler.set_floor("chat", 1, 600.0, 1.0)
    with pytest.raises(ValueError, match="at most 16"):
        scaler.set_floor("chat", 1, 600.0, 1.0)
    clock.now += 16.0  # the first API floor has ended: it is dropped, and a new one fits
    scaler.set_floor("chat", 1, 600.0, 1.0)
    assert scaler.clear_floors("chat") == 16


def test_a_burst_window_moves_the_level_at_once_and_noise_does_not(tmp_path: Path) -> None:
    clock = Clock()
    scaler = autoscaler(tmp_path, clock)
    scaler.tick()

    def window(arrivals: int) -> float:
        for _ in range(arrivals):
            scaler.arrived("chat", 500, 16)
        clock.now += 2.0
        scaler.tick()
        return scaler.forecasts["chat"][0].level

    for _ in range(5):
        assert window(4) == 1000.0  # 4 x 500 tokens / 2 s, steady
    assert window(8) == pytest.approx(1500.0)  # within a Poisson count's noise of 4: smoothed
    assert scaler.steps["chat"] == 0
    window(4)
    level = window(20)  # five times the rate: a step
    assert level == 5000.0 and scaler.steps["chat"] == 1
    assert scaler.status()["pools"][0]["forecast_tps"]["steps_up"] == 1


def test_a_step_the_replicas_serving_absorb_is_smoothed(tmp_path: Path) -> None:
    """A cluster of arrivals that four ready replicas serve at the target utilisation is no step: taken
    at once it would hold replicas through the scale-down's stabilisation window for nothing."""
    clock = Clock()
    scaler = autoscaler(tmp_path, clock)
    scaler.executor.role_state = lambda pool, role: RoleState(ready=4)  # type: ignore[method-assign]
    scaler.tick()
    for arrivals in (4, 4, 4, 4, 20):
        for _ in range(arrivals):
            scaler.arrived("chat", 500, 16)
        clock.now += 2.0
        scaler.tick()
    assert scaler.steps["chat"] == 0
    assert scaler.forecasts["chat"][0].level == pytest.approx(3000.0)  # 0.5 x 5000 + 0.5 x 1000
    signals = scaler.signals["chat"][-1]
    assert replica_load(signals.roles[0], 5000.0, 160.0) / 0.8 < 4  # what the four replicas absorb


def test_steps_off_smooth_a_burst_window(tmp_path: Path) -> None:
    clock = Clock()
    scaler = autoscaler(tmp_path, clock, forecast_step_z=0)
    scaler.tick()
    for arrivals in (4, 4, 20):
        for _ in range(arrivals):
            scaler.arrived("chat", 500, 16)
        clock.now += 2.0
        scaler.tick()
    assert scaler.forecasts["chat"][0].level == pytest.approx(3000.0)


def test_a_step_that_began_mid_window_is_measured_over_the_windows_second_half(tmp_path: Path) -> None:
    clock = Clock()
    scaler = autoscaler(tmp_path, clock)
    scaler.tick()
    for _ in range(5):  # 4 x 500 tokens / 2 s, steady
        for _ in range(4):
            scaler.arrived("chat", 500, 16)
        clock.now += 2.0
        scaler.tick()
    scaler.arrived("chat", 500, 16)  # the window's first half at the old rate
    clock.now += 1.5
    for _ in range(19):  # the burst from its middle on
        scaler.arrived("chat", 500, 16)
    clock.now += 0.5
    scaler.tick()
    assert scaler.steps["chat"] == 1
    # 20 x 500 tokens over 2 s is 5000 tok/s; the 19 of the second half ran at 9500
    assert scaler.forecasts["chat"][0].level == pytest.approx(9500.0)
