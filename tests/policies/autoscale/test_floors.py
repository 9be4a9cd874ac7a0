"""Scheduled floors on literal inputs: which floor is in force when, and what the planner does with it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from backends.autoscale.config import AutoscaleConfig, RoleBounds, Window, parse_hhmm
from policies.autoscale.forecast import Floor, floor_at, schedule_floors
from policies.autoscale.planner import plan_hpa, plan_pool, replay
from policies.autoscale.types import PlannerMemory
from tests.policies.autoscale.test_planner import signals

POLICY = AutoscaleConfig(min_replicas=0, max_replicas=8, idle_s=60, stabilization_s=30, scale_down_cooldown_s=20)
WED_1000 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC).timestamp()  # a wednesday
NOW = 1000.0  # the monotonic clock at WED_1000


def window(start: str, end: str, count: int = 3, days: tuple[int, ...] = ()) -> Window:
    return Window(parse_hhmm(start), parse_hhmm(end), {"": count}, frozenset(days))


def at(windows: list[Window], minutes_from_10: float, lead_s: float = 0.0) -> int:
    unix = WED_1000 + minutes_from_10 * 60
    now = NOW + minutes_from_10 * 60
    return floor_at(schedule_floors(windows, unix, now), "both", now, lead_s)[0]


def test_a_window_holds_from_start_to_end() -> None:
    daily = [window("10:30", "11:00")]
    assert at(daily, 0) == 0
    assert at(daily, 30) == 3
    assert at(daily, 59.9) == 3
    assert at(daily, 60) == 0


def test_the_floor_comes_a_lead_time_early() -> None:
    daily = [window("10:30", "11:00")]
    assert at(daily, 29, lead_s=30) == 0
    assert at(daily, 29.5, lead_s=30) == 3  # the replicas asked for now serve at 10:30


def test_a_window_wraps_midnight_and_belongs_to_the_day_it_starts() -> None:
    late = [window("22:00", "02:00", days=(2,))]  # wednesday 22:00 to thursday 02:00
    assert at(late, 12 * 60 + 30) == 3  # wednesday 22:30
    assert at(late, 15 * 60 + 30) == 3  # thursday 01:30
    assert at(late, 16 * 60 + 30) == 0  # thursday 02:30
    assert at(late, -11 * 60) == 0  # tuesday 23:00: tuesday is not listed
    assert at([window("22:00", "02:00")], -11 * 60) == 3  # every day: tuesday's window


def test_days_select_the_start_day() -> None:
    assert at([window("10:30", "11:00", days=(0, 1))], 40) == 0  # monday, tuesday only
    assert at([window("10:30", "11:00", days=(2,))], 40) == 3


def test_the_largest_floor_wins_and_roles_apply_apart() -> None:
    floors = (Floor(0, 100, 2), Floor(0, 50, 4), Floor(0, 100, 6, "decode"))
    assert floor_at(floors, "both", 10, 0)[0] == 4
    assert floor_at(floors, "both", 60, 0)[0] == 2
    assert floor_at(floors, "decode", 60, 0)[0] == 6
    assert floor_at(floors, "prefill", 60, 0)[0] == 2
    assert floor_at(floors, "both", 100, 0) == (0, None)  # expired


def test_the_schedule_config_is_validated() -> None:
    late = {"start": "23:30", "end": "00:15", "min_replicas": 2, "days": ["fri"]}
    config = AutoscaleConfig.model_validate({"max_replicas": 4, "schedule": [late]})
    assert config.windows() == (Window(23 * 60 + 30, 15, {"": 2}, frozenset({4})),)
    bads: list[dict[str, object]] = [{"start": "25:00", "end": "01:00", "min_replicas": 1},
                {"start": "10:00", "end": "10:7", "min_replicas": 1},
                {"start": "10:00", "end": "11:00", "min_replicas": -1},
                {"start": "10:00", "end": "11:00", "min_replicas": 1, "days": ["someday"]},
                {"start": "10:00", "end": "11:00", "min_replicas": {"decode": 2}}]  # fmt: skip
    for bad in bads:
        with pytest.raises(ValidationError):
            AutoscaleConfig.model_validate({"max_replicas": 4, "schedule": [bad]})


def test_the_planner_starts_the_floor_a_lead_early_and_clamps_it() -> None:
    floors = (Floor(100.0, 200.0, 5),)
    idle = signals(80.0, 0.0, ready=0, last_request=-1000.0, startup_s=10.0)  # lead 10 + 5 s interval
    assert plan_pool(idle, POLICY, PlannerMemory()).roles[0].wanted == 0
    early = signals(86.0, 0.0, ready=0, last_request=-1000.0, startup_s=10.0)
    plan = plan_pool(replace(early, floors=floors), POLICY, PlannerMemory())
    assert plan.roles[0].wanted == 5
    assert "scheduled floor 5" in plan.reason
    small = POLICY.model_copy(update={"max_replicas": 3})
    assert plan_pool(replace(early, floors=floors), small, PlannerMemory()).roles[0].wanted == 3
    # load above the floor still scales past it
    assert (
        plan_pool(replace(signals(150.0, 7000.0, ready=5), floors=floors), POLICY, PlannerMemory()).roles[0].wanted == 8
    )


def test_an_idle_pool_keeps_its_floor_and_scales_down_after_it_by_the_usual_rules() -> None:
    floors = (Floor(100.0, 200.0, 4),)
    quiet = [replace(signals(t, 0.0, ready=4, last_request=-1000.0), floors=floors) for t in (150.0, 195.0, 205.0)]
    plans = replay(quiet, POLICY)
    assert [p.roles[0].wanted for p in plans] == [4, 4, 0]  # idle: straight to zero once the floor ends
    busy = [replace(signals(t, 100.0, ready=4), floors=floors) for t in (150.0, 195.0, 205.0, 226.0, 250.0)]
    wanted = [p.roles[0].wanted for p in replay(busy, POLICY)]
    assert wanted[:3] == [4, 4, 4]  # after the window: the stabilisation window still holds 4
    assert wanted[3:] == [3, 3]  # then one step down per cooldown


def test_a_floor_for_one_role_of_a_pd_pool() -> None:
    policy = AutoscaleConfig(roles={"prefill": RoleBounds(max_replicas=4), "decode": RoleBounds(max_replicas=4)})
    base = signals(50.0, 0.0, ready=1)
    roles = tuple(replace(base.roles[0], role=name) for name in ("prefill", "decode"))
    pd = replace(base, roles=roles, floors=(Floor(40.0, 90.0, 3, "decode"),))
    plan = plan_pool(pd, policy, PlannerMemory())
    assert {r.role: r.wanted for r in plan.roles} == {"prefill": 0, "decode": 3}  # no load: no prefill


def test_the_hpa_baseline_takes_the_floor_as_its_largest_recommendation() -> None:
    policy = POLICY.model_copy(update={"planner": "hpa"})
    quiet = replace(signals(90.0, 0.0, ready=1), floors=(Floor(100.0, 200.0, 3),))
    plan = plan_hpa(quiet, policy, PlannerMemory())
    assert plan.roles[0].wanted == 3 and "scheduled floor 3" in plan.reason
    assert plan_hpa(replace(quiet, now_s=80.0), policy, PlannerMemory()).roles[0].wanted == 0  # not yet: no load


def test_a_floor_in_force_stays_when_the_learnt_lead_shrinks() -> None:
    """The first start shows the replicas come up in 1 s, not the 10 s prior: the floor opened early
    keeps its replicas (before, the shorter lead dropped it and the planner stopped what it had started)."""
    floors = (Floor(100.0, 200.0, 2),)
    passes = [
        replace(signals(86.0, 0.0, startup_s=10.0, ready=0, last_request=-1000.0), floors=floors),  # lead 15: open
        replace(signals(90.0, 0.0, startup_s=1.0, ready=2, last_request=-1000.0), floors=floors),  # lead 6
        replace(signals(99.0, 0.0, startup_s=1.0, ready=2, last_request=-1000.0), floors=floors),
    ]
    assert [p.roles[0].wanted for p in replay(passes, POLICY)] == [2, 2, 2]
    assert floor_at(floors, "both", 90.0, 6.0)[0] == 0  # the shorter lead alone would not cover it
    assert floor_at(floors, "both", 90.0, 6.0, kept=floors)[0] == 2
    assert floor_at(floors, "both", 200.0, 6.0, kept=floors)[0] == 0  # ended: kept no longer
    policy = POLICY.model_copy(update={"planner": "hpa"})
    memory = PlannerMemory()
    seen = []
    for each in passes:
        plan = plan_hpa(each, policy, memory)
        memory = plan.memory
        seen.append(plan.roles[0].wanted)
    assert seen == [2, 2, 2]


def test_a_schedule_floor_is_kept_across_passes_whose_clocks_differ_by_microseconds() -> None:
    kept = (Floor(100.0, 200.0, 2, "", "schedule 10:00-11:00"),)
    rebuilt = (Floor(100.000004, 200.000004, 2, "", "schedule 10:00-11:00"),)
    assert floor_at(rebuilt, "both", 90.0, 1.0, kept=kept)[0] == 2
    other = (Floor(100.0, 200.0, 3, "", "schedule 10:00-11:00"),)
    assert floor_at(other, "both", 90.0, 1.0, kept=kept)[0] == 0
