"""The planning loop's token rates: a pass off the schedule (a held request, a freed device) a fraction
of a second after the last one must not measure a rate over that sliver of time."""

from __future__ import annotations

from pathlib import Path

from backends.autoscale.executor import Executor
from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.supervisor import Supervisor
from gateway.autoscale.loop import Autoscaler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def autoscaler(tmp_path: Path, clock: Clock) -> Autoscaler:
    pool = PoolConfig.model_validate(
        {
            "name": "chat",
            "model": "llama-3.1-8b",
            "engine": "sim",
            "preset": "llama-3.1-8b@h100",
            "replicas": 0,
            "devices": "auto",
            "autoscale": {"min_replicas": 0, "max_replicas": 4, "interval_s": 2.0},
        }
    )
    fleet = Fleet.from_configs([pool])
    settings = BackendsSettings.model_validate(
        {"devices": [0, 1, 2, 3], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run")}
    )
    executor = Executor(Supervisor(settings), fleet, settings, clock=clock)
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
