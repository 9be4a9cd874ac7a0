"""Adapter demand in the planners: a pool whose replicas load LoRA adapters faster than
`adapter_loads_per_min` per replica asks for one more (within max_replicas), a scale-down that would
push the rate over it is held, and the knob at 0 turns it off. Pure functions over literal inputs."""

from __future__ import annotations

import dataclasses

from backends.autoscale.config import AutoscaleConfig
from policies.autoscale.planner import plan_hpa, plan_pool, replay
from policies.autoscale.types import PlannerMemory
from tests.policies.autoscale.test_planner import signals

POLICY = AutoscaleConfig(
    min_replicas=1, max_replicas=4, idle_s=60, stabilization_s=0, scale_down_cooldown_s=0, adapter_loads_per_min=30
)


def test_thrashing_replicas_ask_for_one_more() -> None:
    quiet = signals(100.0, 300.0, ready=2)  # 0.4 replicas of token work: two are plenty
    assert plan_pool(quiet, POLICY, PlannerMemory()).roles[0].wanted == 1
    thrash = dataclasses.replace(quiet, adapter_loads_per_min=45.0)
    plan = plan_pool(thrash, POLICY, PlannerMemory())
    assert plan.roles[0].wanted == plan.roles[0].desired == 3
    assert "adapters 45.0 loads/min/replica > 30: +1" in plan.reason
    assert plan.memory.last_up_s == 100.0 and dict(plan.memory.wanted) == {"both": 3}
    # the next pass, still waiting for the replica, is the same want: not a new scale-up
    again = plan_pool(dataclasses.replace(thrash, now_s=105.0), POLICY, plan.memory)
    assert again.roles[0].wanted == 3 and again.memory.last_up_s == 100.0


def test_at_max_replicas_or_with_the_knob_off_nothing_changes() -> None:
    full = dataclasses.replace(signals(100.0, 300.0, ready=4), adapter_loads_per_min=100.0)
    assert plan_pool(full, POLICY, PlannerMemory()).roles[0].wanted == 4  # held at max, no surge for adapters
    off = POLICY.model_copy(update={"adapter_loads_per_min": 0.0})
    thrash = dataclasses.replace(signals(100.0, 300.0, ready=2), adapter_loads_per_min=100.0)
    assert plan_pool(thrash, off, PlannerMemory()).roles[0].wanted == 1


def test_a_scale_down_that_would_thrash_is_held() -> None:
    # 20 loads/min on each of 2 replicas: under 30, but 40 on one replica
    calm = dataclasses.replace(signals(100.0, 300.0, ready=2), adapter_loads_per_min=20.0)
    plan = plan_pool(calm, POLICY, PlannerMemory(last_down_s=50.0))
    assert plan.roles[0].wanted == 2 and "scale-down held" in plan.reason
    assert plan.memory.last_down_s == 50.0  # nothing was scaled down
    # 10 loads/min each: 20 on one replica is fine, the token planner's scale-down goes ahead
    cooler = dataclasses.replace(calm, adapter_loads_per_min=10.0)
    assert plan_pool(cooler, POLICY, PlannerMemory()).roles[0].wanted == 1


def test_scale_up_cooldown_applies() -> None:
    policy = POLICY.model_copy(update={"scale_up_cooldown_s": 60.0})
    thrash = dataclasses.replace(signals(100.0, 300.0, ready=2), adapter_loads_per_min=45.0)
    plan = plan_pool(thrash, policy, PlannerMemory(last_up_s=80.0))
    assert plan.roles[0].wanted == 2 and "cooldown" in plan.reason


def test_the_hpa_planner_and_replay_see_it_too() -> None:
    thrash = dataclasses.replace(signals(100.0, 300.0, ready=2), adapter_loads_per_min=45.0)
    hpa = POLICY.model_copy(update={"planner": "hpa"})
    assert plan_hpa(thrash, hpa, PlannerMemory()).roles[0].wanted == 3
    assert [p.roles[0].wanted for p in replay([thrash], POLICY)] == [3]
