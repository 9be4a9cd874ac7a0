"""The planners: how many replicas each role of a pool wants, as a pure function of its signals.

Two planners, by the name `autoscale.planner` gives (`PLANNERS`): `tokens` (token velocity, below,
the default) and `hpa` (a baseline shaped like the Kubernetes HPA, for comparison: `plan_hpa`). Both
take the same inputs and return the same `PoolPlan`; the device budget across pools is applied
afterwards (`policies.autoscale.budget`).

The token-velocity planner, per role, every `interval_s` (docs/autoscaling.md has the worked
example):

    lead      = wake_s when a sleeping replica can wake, else startup_s; plus interval_s
    demand    = max(level, forecast(lead)) of the arriving prefill and decode token rates
    load      = replica-equivalents of work at the SLO velocity:
                both:    max(prefill demand / prefill velocity, decode demand / decode velocity)
                prefill: prefill demand / prefill velocity      decode: decode demand / decode velocity
    backlog   = queued prompt tokens / (prefill velocity · lead)  (clear the queue once new replicas run)
    need      = max(load / target_utilization + backlog, kv_usage · ready / kv_target)
    up        = ceil(need)                         scale up when above the current count
    down      = ceil(load / (target · (1 - hysteresis)) + backlog), no lower than the largest `down` of
                the last stabilization_s, and only scale_down_cooldown_s after any scale event;
                at most scale_down_step replicas fewer per scale-down (an idle pool goes to zero at once)
    floor     = 1 while requests are held, queued or in flight, or arrived within idle_s; at least a
                scheduled floor (`policies.autoscale.forecast`: `floor_at`) from `lead` before its window opens to
                its end, clamped to max_replicas (an idle pool keeps it too)
    reserve   = warm_reserve replicas on top of max(up, floor) and max(down, floor) while the pool
                is in use (floor 1), in a pool that does not sleep; a pool that sleeps keeps them
                asleep instead (the plan's `reserve`, fitted under max_replicas by the budget: the
                executor starts them and puts them to sleep, so a step is absorbed by a wake)
    wanted    = clamp(·, min_replicas, max_replicas + surge_replicas); the device budget grants the
                surge above max_replicas only from devices no other pool's planner wants
    adapters  = one more replica while LoRA adapter loads per minute per replica pass
                adapter_loads_per_min, no scale-down that would pass it (`adapter_demand`, below)

The forecast looks ahead by the lead time so a replica starts before the load needs it; only a rising
trend moves demand (a falling one waits for the measured level).

Adapter demand: a pool whose replicas thrash loading LoRA adapters asks for one more replica.

Each replica holds a bounded set of adapters (`max_loras` slots, and a pool's `lora_memory_budget_mb`);
when the adapters in demand outgrow what the replicas hold together, every replica keeps evicting one
adapter to load another, and each load stalls its batch for size / bandwidth (docs/adapters.md). The
token rates do not see it: the work is the same, its replicas are not busier, yet the requests wait
for loads. One more replica spreads the same adapters over more slots, and the adapter-aware router
(`policies/routing/lora.py`) sends each adapter where it is held.

The signal is the gateway's count of on-demand loads (`PoolSignals.adapter_loads_per_min`, per ready
replica over the last window; preloads are left out, so a starting replica preloading its adapters is
not read as thrash). Against `autoscale.adapter_loads_per_min` (0: off):

    rate > threshold               wanted = max(wanted, current + 1), within max_replicas (no surge),
                                   not within scale_up_cooldown_s of the last scale-up
    rate · current / wanted > it   a scale-down is held at current (the same loads on fewer replicas
                                   would thrash): the token planner's scale-down does not undo the
                                   replica the adapters asked for

A pure function of the plan the planner made, its signals and the memory it started from, as the
planners are (`tests/policies/autoscale/test_adapters.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from backends.autoscale.config import AutoscaleConfig
from policies.autoscale import forecast as scheduled
from policies.autoscale.types import PlannerMemory, PoolPlan, PoolSignals, RolePlan, RoleSignals

_EPSILON = 1e-9
HPA_TOLERANCE = 0.1


def plan_pool(signals: PoolSignals, policy: AutoscaleConfig, memory: PlannerMemory) -> PoolPlan:
    """The pool's wanted replicas per role before the device budget (`desired` = `wanted` here)."""
    before = memory
    now = signals.now_s
    lead_s = lead_time_s(signals, policy)
    opened = scheduled.in_force(signals.floors, now, lead_s, memory.floors)
    prefill_demand = max(signals.prefill.level, signals.prefill.ahead(lead_s))
    decode_demand = max(signals.decode.level, signals.decode.ahead(lead_s))
    busy = (
        signals.held > 0
        or signals.queued_requests > 0
        or signals.inflight > 0
        or now - signals.last_request_s < policy.idle_s
    )
    window_start = now - policy.stabilization_s
    history = tuple(entry for entry in memory.history if entry[0] >= window_start)
    past_down: dict[str, int] = {}
    for _at, needs in history:
        for name, value in needs:
            past_down[name] = max(past_down.get(name, 0), value)
    roles: list[RolePlan] = []
    reasons: list[str] = []
    downs: list[tuple[str, int]] = []
    scaled_up = scaled_down = False
    wanted_before = dict(memory.wanted)
    awake_reserve = (policy.warm_reserve or 0) if policy.sleep is None else 0
    asleep_reserve = policy.warm_reserve if policy.sleep is not None else None
    for role in signals.roles:
        load = replica_load(role, prefill_demand, decode_demand)
        backlog = _backlog(signals, role, lead_s)
        need_rate = load / policy.target_utilization + backlog
        need_kv = role.kv_usage * role.replicas.ready / policy.kv_target
        need = max(need_rate, need_kv)
        up = math.ceil(need - _EPSILON)
        down = math.ceil(load / (policy.target_utilization * (1 - policy.hysteresis)) + backlog - _EPSILON)
        down = max(down, math.ceil(need_kv - _EPSILON))
        low, cap = policy.bounds(role.role)
        high = policy.ceiling(role.role)
        in_use = 1 if busy and high > 0 and _serves(signals, role) else 0
        if awake_reserve and in_use:
            up, down = max(up, in_use) + awake_reserve, max(down, in_use) + awake_reserve
        booked, booking = scheduled.floor_at(signals.floors, role.role, now, lead_s, memory.floors)
        booked = min(booked, cap)
        floor = max(in_use, booked)
        current = role.replicas.active
        downs.append((role.role, max(down, floor)))
        why = _describe(role, prefill_demand, decode_demand, load, backlog, need_kv, policy)
        if awake_reserve and in_use:
            why += f", +{awake_reserve} warm"
        if booking is not None and booked and booked >= up:
            why += f", {scheduled.describe(booking, now)}"
        if up > current or (current < max(low, floor)):
            target = max(up, floor, low)
            if current > 0 and now - memory.last_up_s < policy.scale_up_cooldown_s:
                wanted, why = current, f"{why}; scale-up cooldown"
            else:
                wanted = target
        elif max(down, floor) < current:
            stable = max(down, floor, past_down.get(role.role, 0))
            since_event = now - max(memory.last_up_s, memory.last_down_s)
            if not busy and low == 0 and not booked:
                wanted, why = 0, f"idle {policy.idle_s:g} s"
            elif since_event < policy.scale_down_cooldown_s:
                wanted, why = current, f"{why}; scale-down cooldown"
            elif stable >= current:
                wanted, why = current, f"{why}; stabilising ({policy.stabilization_s:g} s window)"
            else:
                wanted = max(stable, current - policy.scale_down_step)
        else:
            wanted = current
        wanted = min(max(wanted, low), high)
        if wanted > cap:
            why += f", surge +{wanted - cap} over {cap} if devices are free"
        if wanted > current:
            scaled_up = scaled_up or wanted_before.get(role.role, current) < wanted
        elif wanted < current:
            scaled_down = True
        roles.append(RolePlan(role.role, current, round(need, 3), wanted, wanted, asleep_reserve))
        reasons.append(f"{role.role} {current}->{wanted}: {why}" if len(signals.roles) > 1 else why)
    history = (*history, (now, tuple(downs)))
    memory = PlannerMemory(
        last_up_s=now if scaled_up else memory.last_up_s,
        last_down_s=now if scaled_down else memory.last_down_s,
        history=history,
        wanted=tuple((r.role, r.wanted) for r in roles),
        floors=opened,
    )
    return adapter_demand(signals, policy, before, PoolPlan(signals.pool, tuple(roles), "; ".join(reasons), memory))


def lead_time_s(signals: PoolSignals, policy: AutoscaleConfig) -> float:
    """How long until a replica asked for now serves, plus the pass that asks for it: a wake when
    one sleeps, else a start (the HPA-shaped planner keeps a scheduled floor this early too)."""
    sleeping = sum(r.replicas.sleeping for r in signals.roles)
    ready_s = signals.wake_s if sleeping and signals.wake_s > 0 else signals.startup_s
    return ready_s + policy.interval_s


def replica_load(role: RoleSignals, prefill_demand: float, decode_demand: float) -> float:
    """Replica-equivalents of work these token rates give `role` at its SLO velocities."""
    prefill = prefill_demand / role.prefill_velocity if role.prefill_velocity > 0 else 0.0
    decode = decode_demand / role.decode_velocity if role.decode_velocity > 0 else 0.0
    if role.role == "prefill":
        return prefill
    if role.role == "decode":
        return decode
    return max(prefill, decode)


def _backlog(signals: PoolSignals, role: RoleSignals, lead_s: float) -> float:
    """Extra replicas that clear the queued prompt tokens within the lead time."""
    if role.role == "decode" or role.prefill_velocity <= 0 or signals.queued_tokens <= 0:
        return 0.0
    return signals.queued_tokens / (role.prefill_velocity * max(lead_s, 1.0))


def _serves(signals: PoolSignals, role: RoleSignals) -> bool:
    """Whether this role must run for the pool to serve at all (a PD pool needs its decoders)."""
    return role.role != "prefill" or signals.role("decode") is None


def _describe(
    role: RoleSignals,
    prefill_demand: float,
    decode_demand: float,
    load: float,
    backlog: float,
    need_kv: float,
    policy: AutoscaleConfig,
) -> str:
    parts = []
    if role.role != "decode":
        parts.append(f"prefill {prefill_demand:.0f}/{role.prefill_velocity:.0f} tok/s")
    if role.role != "prefill":
        parts.append(f"decode {decode_demand:.0f}/{role.decode_velocity:.0f} tok/s")
    text = " ".join(parts) + f" = {load:.2f} replicas at {policy.target_utilization:g}"
    if backlog > 0:
        text += f", queue +{backlog:.2f}"
    if need_kv > load / policy.target_utilization + backlog:
        text += f", KV {role.kv_usage:.0%} needs {need_kv:.2f}"
    return text


def plan_hpa(signals: PoolSignals, policy: AutoscaleConfig, memory: PlannerMemory) -> PoolPlan:
    """A baseline planner shaped like the Kubernetes Horizontal Pod Autoscaler, for comparison.

    The HPA's algorithm (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/) on one
    metric, here the engines' requests running and waiting per ready replica (vLLM's
    `num_requests_running` + `num_requests_waiting`) against a target:

        desired = ceil(current · metric / target), unchanged while |metric / target - 1| <= 0.1
        a scale-down goes only to the largest recommendation of the stabilisation window (the HPA's
        downscale stabilisation, 300 s by default; `stabilization_s` here); a scale-up is immediate

    It sees load only once it runs on the engines (no token rates, no forecast, no start-up lead) and
    cannot start from zero replicas on its own: a request held for a cold start activates it (one
    replica), as KEDA's activation does. A scheduled floor (`policies.autoscale.forecast`) raises the
    recommendation from a start-up before its window to its end, as KEDA's cron scaler beside the HPA's
    metric does (the HPA takes the largest of its metrics' recommendations). Same inputs and outputs as
    `plan_pool`.
    """
    now = signals.now_s
    lead_s = lead_time_s(signals, policy)  # a scheduled floor is kept this early
    opened = scheduled.in_force(signals.floors, now, lead_s, memory.floors)
    window_start = now - policy.stabilization_s
    history = tuple(entry for entry in memory.history if entry[0] >= window_start)
    roles, reasons, recommendations = [], [], []
    scaled_up = scaled_down = False
    for role in signals.roles:
        current = role.replicas.active
        ready = role.replicas.ready
        low, high = policy.bounds(role.role)
        metric = (role.engine_running + role.engine_waiting) / ready if ready else 0.0
        ratio = metric / policy.hpa_target_running
        if current == 0:
            recommended = 1 if signals.held or signals.queued_requests else 0
            why = "activation: requests held" if recommended else "at zero, nothing held"
        elif ready == 0 or abs(ratio - 1.0) <= HPA_TOLERANCE:
            recommended = current
            why = f"running {metric:.1f}/replica within tolerance of {policy.hpa_target_running:g}"
        else:
            recommended = math.ceil(current * ratio)
            why = f"running {metric:.1f}/replica vs target {policy.hpa_target_running:g}"
        booked, booking = scheduled.floor_at(signals.floors, role.role, now, lead_s, memory.floors)
        if booking is not None and booked > recommended:
            recommended, why = booked, f"{why}; {scheduled.describe(booking, now)}"
        recommended = min(max(recommended, low), high)
        recommendations.append((role.role, recommended))
        if recommended < current:
            past = [value for _at, entries in history for name, value in entries if name == role.role]
            wanted = min(current, max([recommended, *past]))
        else:
            wanted = recommended
        scaled_up |= wanted > current
        scaled_down |= wanted < current
        roles.append(
            RolePlan(role.role, current, round(metric / policy.hpa_target_running * max(ready, 1), 3), wanted, wanted)
        )
        reasons.append(why)
    plan = PoolPlan(
        signals.pool,
        tuple(roles),
        "hpa: " + "; ".join(reasons),
        PlannerMemory(
            last_up_s=now if scaled_up else memory.last_up_s,
            last_down_s=now if scaled_down else memory.last_down_s,
            history=(*history, (now, tuple(recommendations))),
            floors=opened,
        ),
    )
    return adapter_demand(signals, policy, memory, plan)


Planner = Callable[[PoolSignals, AutoscaleConfig, PlannerMemory], PoolPlan]

PLANNERS: Final[Mapping[str, Planner]] = MappingProxyType({"tokens": plan_pool, "hpa": plan_hpa})


def replay(
    inputs: Sequence[PoolSignals], policy: AutoscaleConfig, memory: PlannerMemory | None = None
) -> list[PoolPlan]:
    """Plan a recorded sequence of one pool's signals, carrying memory from pass to pass (the
    benchmark's and the tests' way to check decisions offline)."""
    memory = memory or PlannerMemory()
    plans = []
    for signals in inputs:
        plan = plan_pool(signals, policy, memory)
        memory = plan.memory
        plans.append(plan)
    return plans


SERVING_ROLES = ("both", "decode")  # the role whose replicas serve the adapters' requests


def adapter_demand(signals: PoolSignals, policy: AutoscaleConfig, before: PlannerMemory, plan: PoolPlan) -> PoolPlan:
    """`plan` with the adapter demand applied: one replica more for a pool that thrashes, or a
    scale-down held that would make it thrash (see the module's docstring)."""
    threshold = policy.adapter_loads_per_min
    rate = signals.adapter_loads_per_min
    if threshold <= 0 or rate <= 0:
        return plan
    role = next((r for name in SERVING_ROLES if (r := plan.role(name)) is not None), None)
    if role is None or role.current <= 0:
        return plan
    now = signals.now_s
    current = role.current
    cap = policy.bounds(role.role)[1]
    wanted = role.wanted
    memory = plan.memory
    if rate > threshold:
        target = min(current + 1, cap)
        if wanted >= target:
            return plan  # the planner asks for as much already, or the pool is at its max
        if now - before.last_up_s < policy.scale_up_cooldown_s:
            return _replace(plan, role.role, max(wanted, current), f"adapters {rate:.1f} loads/min; scale-up cooldown")
        why = f"adapters {rate:.1f} loads/min/replica > {threshold:g}: +1"
        if dict(before.wanted).get(role.role, current) < target:  # a new want, not one still awaiting devices
            memory = dataclasses.replace(memory, last_up_s=now)
        return _replace(plan, role.role, target, why, memory)
    if wanted < current and (wanted == 0 or rate * current / wanted > threshold):
        why = f"scale-down held: adapters {rate:.1f} loads/min/replica would pass {threshold:g} on {wanted}"
        memory = dataclasses.replace(memory, last_down_s=before.last_down_s)
        return _replace(plan, role.role, current, why, memory)
    return plan


def _replace(plan: PoolPlan, role: str, wanted: int, why: str, memory: PlannerMemory | None = None) -> PoolPlan:
    roles = tuple(dataclasses.replace(r, wanted=wanted, desired=wanted) if r.role == role else r for r in plan.roles)
    memory = memory or plan.memory
    memory = dataclasses.replace(memory, wanted=tuple((r.role, r.wanted) for r in roles))
    return dataclasses.replace(plan, roles=roles, reason=f"{plan.reason}; {why}", memory=memory)
