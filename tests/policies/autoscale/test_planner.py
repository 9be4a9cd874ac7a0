"""The planner on literal inputs: every decision is a pure function of signals, policy and memory."""

from __future__ import annotations

import itertools

import pytest

from backends.autoscale.config import AutoscaleConfig, RoleBounds
from backends.autoscale.executor import RoleState
from policies.autoscale.forecast import Forecast
from policies.autoscale.planner import plan_pool, replay
from policies.autoscale.types import NEVER, PlannerMemory, PoolSignals, RoleSignals

POLICY = AutoscaleConfig(min_replicas=0, max_replicas=8, idle_s=60, stabilization_s=30, scale_down_cooldown_s=20)
STEP_2 = POLICY.model_copy(update={"scale_down_step": 2})


def signals(
    now: float,
    prefill: float,
    decode: float = 0.0,
    *,
    ready: int = 1,
    starting: int = 0,
    sleeping: int = 0,
    trend: float = 0.0,
    kv: float = 0.0,
    held: int = 0,
    queued: int = 0,
    queued_tokens: float = 0.0,
    inflight: int = 0,
    last_request: float | None = None,
    startup_s: float = 10.0,
    wake_s: float = 0.0,
) -> PoolSignals:
    role = RoleSignals("both", RoleState(ready=ready, starting=starting, sleeping=sleeping), 1000.0, 500.0, kv_usage=kv)
    return PoolSignals(
        pool="p",
        now_s=now,
        prefill=Forecast(prefill, trend, now),
        decode=Forecast(decode, 0.0, now),
        roles=(role,),
        queued_requests=queued,
        queued_tokens=queued_tokens,
        held=held,
        inflight=inflight,
        last_request_s=now if last_request is None else last_request,
        startup_s=startup_s,
        wake_s=wake_s,
    )


def wanted(plan_signals: PoolSignals, policy: AutoscaleConfig = POLICY, memory: PlannerMemory | None = None) -> int:
    return plan_pool(plan_signals, policy, memory or PlannerMemory()).roles[0].wanted


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        pytest.param(0.0, 0.0, 1, id="active but no load keeps one"),
        pytest.param(700.0, 0.0, 1, id="0.7 of a replica at target 0.8"),
        pytest.param(900.0, 0.0, 2, id="over target"),
        pytest.param(100.0, 1500.0, 4, id="decode bound: 3 replicas of work at 0.8"),
        pytest.param(5000.0, 0.0, 7, id="prefill bound"),
        pytest.param(50_000.0, 0.0, 8, id="capped at max_replicas"),
    ],
)
def test_token_velocity_sizes_the_pool(prefill: float, decode: float, expected: int) -> None:
    assert wanted(signals(100.0, prefill, decode)) == expected


def test_a_rising_trend_scales_up_a_start_up_time_early() -> None:
    flat = signals(100.0, 700.0)
    rising = signals(100.0, 700.0, trend=20.0, startup_s=10.0)  # +300 tok/s over the 15 s lead
    assert wanted(flat) == 1
    assert wanted(rising) == 2
    falling = signals(100.0, 700.0, trend=-50.0, ready=1)
    assert wanted(falling) == 1  # a falling trend waits for the measured level


def test_a_sleeping_replica_shortens_the_lead() -> None:
    cold = signals(100.0, 700.0, trend=10.0, startup_s=60.0)  # +650 over 65 s
    warm = signals(100.0, 700.0, trend=10.0, startup_s=60.0, sleeping=1, wake_s=1.0)  # +60 over 6 s
    assert wanted(cold) == 2
    assert wanted(warm) == 1


def test_hysteresis_and_stabilisation_delay_a_scale_down() -> None:
    # 4 replicas; load fits 3 at target 0.8 but not at 0.8 x 0.85 = 0.68
    assert wanted(signals(100.0, 2300.0, ready=4)) == 4
    # well below: the first pass after a scale-up is within the cooldown
    memory = PlannerMemory(last_up_s=95.0)
    assert wanted(signals(100.0, 1000.0, ready=4), memory=memory) == 4
    # past the cooldown, but the window remembers a higher need
    memory = PlannerMemory(last_up_s=50.0, history=((90.0, (("both", 4),)),))
    assert wanted(signals(100.0, 1000.0, ready=4), memory=memory) == 4
    # past both: down to what the window needs at most
    memory = PlannerMemory(last_up_s=50.0, history=((60.0, (("both", 4),)), (80.0, (("both", 2),))))
    assert wanted(signals(100.0, 1000.0, ready=4), memory=memory, policy=STEP_2) == 2


def test_a_scale_down_gives_up_one_replica_at_a_time() -> None:
    # the same pass as above with the default step: one replica fewer, the next after the cooldown
    memory = PlannerMemory(last_up_s=50.0, history=((60.0, (("both", 4),)), (80.0, (("both", 2),))))
    assert wanted(signals(100.0, 1000.0, ready=4), memory=memory) == 3
    # an idle pool still goes to zero in one pass
    idle = signals(200.0, 0.0, ready=4, last_request=100.0)
    assert wanted(idle, memory=PlannerMemory(last_up_s=50.0)) == 0


def test_idle_pool_goes_to_zero_and_min_replicas_holds() -> None:
    idle = signals(200.0, 0.0, last_request=100.0)
    assert wanted(idle) == 0
    recent = signals(200.0, 0.0, last_request=150.0)
    assert wanted(recent) == 1
    kept = AutoscaleConfig(min_replicas=1, max_replicas=4, idle_s=60)
    assert wanted(idle, kept) == 1
    never_used = signals(200.0, 0.0, ready=0, last_request=NEVER)
    assert wanted(never_used) == 0


def test_held_request_cold_starts_a_pool_at_zero() -> None:
    cold = signals(200.0, 0.0, ready=0, held=1, last_request=200.0)
    plan = plan_pool(cold, POLICY, PlannerMemory())
    assert plan.roles[0].current == 0 and plan.roles[0].wanted == 1
    assert plan.memory.last_up_s == 200.0
    # while it starts nothing more is asked for
    assert wanted(signals(201.0, 0.0, ready=0, starting=1, held=3)) == 1


def test_kv_pressure_and_queue_add_replicas() -> None:
    assert wanted(signals(100.0, 100.0, ready=2, kv=0.95)) == 3  # 0.95 x 2 / 0.85 = 2.2
    # 40k queued tokens cleared over the 15 s lead at 1000 tok/s each: +2.67
    assert wanted(signals(100.0, 100.0, ready=1, queued=20, queued_tokens=40_000.0)) == 3


def test_scale_up_cooldown() -> None:
    policy = AutoscaleConfig(max_replicas=8, scale_up_cooldown_s=30)
    memory = PlannerMemory(last_up_s=90.0)
    assert wanted(signals(100.0, 3000.0, ready=2), policy, memory) == 2
    assert wanted(signals(130.0, 3000.0, ready=2), policy, memory) == 4


def test_prefill_decode_roles_are_sized_apart() -> None:
    policy = AutoscaleConfig(
        roles={
            "prefill": RoleBounds(min_replicas=0, max_replicas=4),
            "decode": RoleBounds(min_replicas=1, max_replicas=4),
        }
    )
    roles = (
        RoleSignals("prefill", RoleState(ready=1), 2000.0, 0.0),
        RoleSignals("decode", RoleState(ready=1), 0.0, 1000.0),
    )
    plan = plan_pool(
        PoolSignals("pd", 10.0, Forecast(5000.0, 0.0, 10.0), Forecast(500.0, 0.0, 10.0), roles, last_request_s=10.0),
        policy,
        PlannerMemory(),
    )
    assert (plan.role("prefill").wanted, plan.role("decode").wanted) == (4, 1)  # type: ignore[union-attr]
    assert "prefill 1->4" in plan.reason


def test_replay_carries_memory_between_passes() -> None:
    """A recorded burst and its end: up at once, down only after the window (recorded replicas)."""
    loads = [500.0] * 3 + [4000.0] * 4 + [500.0] * 12
    readies = [1, 1, 1, 1, 5, 5, 5] + [5] * 12
    inputs = [signals(5.0 * i, load, ready=ready) for i, (load, ready) in enumerate(zip(loads, readies, strict=True))]
    decisions = [p.roles[0].wanted for p in replay(inputs, POLICY)]
    assert decisions[:7] == [1, 1, 1, 5, 5, 5, 5]
    first_down = next(i for i, d in enumerate(decisions) if i > 6 and d < 5)
    assert 5.0 * first_down - 5.0 * 6 > POLICY.stabilization_s  # the window outlived the burst's last need
    assert decisions[first_down] == 4  # one replica at a time (scale_down_step)


def test_closed_loop_follows_its_own_decisions() -> None:
    """Fed its own decisions back as the replicas that run: one step up, one step down, no flapping."""
    memory, ready, seen = PlannerMemory(), 1, []
    for i, load in enumerate([500.0] * 3 + [4000.0] * 4 + [500.0] * 20):
        plan = plan_pool(signals(5.0 * i, load, ready=ready), POLICY, memory)
        memory, ready = plan.memory, plan.roles[0].wanted
        seen.append(ready)
    changes = [b for a, b in itertools.pairwise(seen) if a != b]
    assert changes == [5, 4, 3, 2, 1]


def test_a_scale_up_the_budget_has_not_granted_does_not_hold_the_other_roles_cooldown() -> None:
    """Prefill wants a device the decode role holds: its want, repeated every pass while ungranted,
    is one scale-up event, so the decode role's scale-down cooldown ends and the device can move."""
    policy = AutoscaleConfig(
        roles={
            "prefill": RoleBounds(min_replicas=1, max_replicas=2),
            "decode": RoleBounds(min_replicas=1, max_replicas=2),
        },
        scale_down_cooldown_s=4,
        stabilization_s=0,
    )
    roles = (
        RoleSignals("prefill", RoleState(ready=1), 2000.0, 0.0),
        RoleSignals("decode", RoleState(ready=2), 0.0, 1000.0),
    )
    memory = PlannerMemory(last_up_s=10.0)  # the launch counts as a scale event
    decode_wanted = []
    for i in range(20):  # a pass every 0.5 s; the budget never grants the prefill replica (current stays 1)
        now = 10.0 + 0.5 * i
        pool = PoolSignals("pd", now, Forecast(5000.0, 0.0, now), Forecast(10.0, 0.0, now), roles, last_request_s=now)
        plan = plan_pool(pool, policy, memory)
        memory = plan.memory
        assert plan.role("prefill").wanted == 2  # type: ignore[union-attr]
        decode_wanted.append(plan.role("decode").wanted)  # type: ignore[union-attr]
    assert decode_wanted[0] == 2  # the cooldown after the prefill role's scale-up...
    assert decode_wanted.index(1) == 8  # ...ends 4 s later: the decode role gives its device back


def test_an_awake_warm_reserve_runs_beyond_the_need_while_in_use() -> None:
    warm = POLICY.model_copy(update={"warm_reserve": 1})
    assert wanted(signals(100.0, 700.0), warm) == 2  # one for the load, one warm
    assert wanted(signals(100.0, 0.0), warm) == 2  # the floor's one, plus the reserve
    assert wanted(signals(100.0, 900.0, ready=2), warm) == 3
    idle = signals(100.0, 0.0, ready=2, last_request=0.0)  # idle past idle_s: down to min_replicas
    assert wanted(idle, warm) == 0
    plan = plan_pool(signals(100.0, 700.0), warm, PlannerMemory())
    assert plan.roles[0].reserve is None and "+1 warm" in plan.reason


def test_a_scale_down_keeps_the_awake_reserve() -> None:
    warm = POLICY.model_copy(update={"warm_reserve": 1})
    # load for one replica, three running, long after any scale event: down to 1 + the reserve
    plan = plan_pool(signals(500.0, 500.0, ready=3), warm, PlannerMemory())
    assert plan.roles[0].wanted == 2


def test_a_pool_that_sleeps_keeps_its_reserve_asleep() -> None:
    from backends.autoscale.config import SleepConfig

    sleepy = POLICY.model_copy(update={"warm_reserve": 2, "sleep": SleepConfig(level=1)})
    plan = plan_pool(signals(100.0, 700.0), sleepy, PlannerMemory())
    assert plan.roles[0].wanted == 1  # nothing extra awake
    assert plan.roles[0].reserve == 2  # two asleep: the executor's part
    unbounded = POLICY.model_copy(update={"sleep": SleepConfig(level=1)})
    assert plan_pool(signals(100.0, 700.0), unbounded, PlannerMemory()).roles[0].reserve is None


def test_a_surge_goes_above_max_replicas_only_when_the_need_does() -> None:
    surging = POLICY.model_copy(update={"surge_replicas": 2})
    plan = plan_pool(signals(100.0, 50_000.0, ready=8), surging, PlannerMemory())
    assert plan.roles[0].wanted == 10  # 8 + the surge of 2; the budget grants it from free devices
    assert "surge +2 over 8" in plan.reason
    assert wanted(signals(100.0, 50_000.0, ready=8)) == 8  # no surge: capped at max_replicas
    assert wanted(signals(100.0, 5000.0, ready=7), surging) == 7  # below the cap, nothing changes


def test_surge_slots_are_planned_and_hpa_refuses_a_warm_reserve() -> None:
    assert POLICY.model_copy(update={"surge_replicas": 2}).ceiling("both") == 10
    assert AutoscaleConfig(max_replicas=3, surge_replicas=2).ceiling("prefill") == 0  # no such role
    with pytest.raises(ValueError, match="warm_reserve needs planner: tokens"):
        AutoscaleConfig(max_replicas=3, planner="hpa", warm_reserve=1)
