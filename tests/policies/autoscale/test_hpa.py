"""The HPA-shaped baseline: ratio to target, 10 % tolerance, downscale stabilisation, activation."""

from __future__ import annotations

from backends.autoscale.config import AutoscaleConfig
from backends.autoscale.executor import RoleState
from policies.autoscale.forecast import Forecast
from policies.autoscale.planner import plan_hpa
from policies.autoscale.types import PlannerMemory, PoolSignals, RoleSignals

POLICY = AutoscaleConfig(max_replicas=10, hpa_target_running=10, stabilization_s=30)


def signals(now: float, ready: int, running: int, waiting: int = 0, held: int = 0) -> PoolSignals:
    role = RoleSignals("both", RoleState(ready=ready), 0.0, 0.0, engine_running=running, engine_waiting=waiting)
    return PoolSignals("p", now, Forecast(), Forecast(), (role,), held=held, queued_requests=held)


def test_ratio_tolerance_and_bounds() -> None:
    assert plan_hpa(signals(0, 2, 40), POLICY, PlannerMemory()).roles[0].wanted == 4
    assert plan_hpa(signals(0, 2, 21), POLICY, PlannerMemory()).roles[0].wanted == 2  # within 10 %
    assert plan_hpa(signals(0, 2, 15, waiting=30), POLICY, PlannerMemory()).roles[0].wanted == 5
    assert plan_hpa(signals(0, 4, 400), POLICY, PlannerMemory()).roles[0].wanted == 10


def test_downscale_waits_for_the_window_and_zero_needs_activation() -> None:
    memory = plan_hpa(signals(0, 4, 40), POLICY, PlannerMemory()).memory
    plan = plan_hpa(signals(10, 4, 8), POLICY, memory)
    assert plan.roles[0].wanted == 4  # the window still holds the 4 of t=0
    assert plan_hpa(signals(40, 4, 8), POLICY, plan.memory).roles[0].wanted == 1  # only t=10's 1 is left
    assert plan_hpa(signals(0, 0, 0), POLICY, PlannerMemory()).roles[0].wanted == 0
    assert plan_hpa(signals(0, 0, 0, held=1), POLICY, PlannerMemory()).roles[0].wanted == 1
