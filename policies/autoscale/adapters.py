"""Adapter demand: a pool whose replicas thrash loading LoRA adapters asks for one more replica.

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

from backends.autoscale.config import AutoscaleConfig
from policies.autoscale.types import PlannerMemory, PoolPlan, PoolSignals

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
