"""A baseline planner shaped like the Kubernetes Horizontal Pod Autoscaler, for comparison.

The HPA's algorithm (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/) on one
metric, here the engines' requests running and waiting per ready replica (vLLM's
`num_requests_running` + `num_requests_waiting`) against a target:

    desired = ceil(current · metric / target), unchanged while |metric / target - 1| <= 0.1
    a scale-down goes only to the largest recommendation of the stabilisation window (the HPA's
    downscale stabilisation, 300 s by default; `stabilization_s` here); a scale-up is immediate

It sees load only once it runs on the engines (no token rates, no forecast, no start-up lead) and
cannot start from zero replicas on its own: a request held for a cold start activates it (one
replica), as KEDA's activation does. A scheduled floor (`backends.autoscale.floors`) raises the
recommendation from a start-up before its window to its end, as KEDA's cron scaler beside the HPA's
metric does (the HPA takes the largest of its metrics' recommendations). Same inputs and outputs as
`plan_pool`.
"""

from __future__ import annotations

import math

from backends.autoscale import floors as scheduled
from backends.autoscale.config import AutoscaleConfig
from backends.autoscale.planner import lead_time_s
from backends.autoscale.types import PlannerMemory, PoolPlan, PoolSignals, RolePlan

TOLERANCE = 0.1


def plan_hpa(signals: PoolSignals, policy: AutoscaleConfig, memory: PlannerMemory) -> PoolPlan:
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
        elif ready == 0 or abs(ratio - 1.0) <= TOLERANCE:
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
    return PoolPlan(
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
