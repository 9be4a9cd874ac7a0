"""Sharing a device budget between pools: who gets the devices the planners want, by priority.

Pools whose replicas take devices from the same group (the host's free devices, or a list several
pools `share`) draw on that group's device slots (one per device, `max_awake` per shared device).
Per group, grants go in this order, each while slots remain:

    1. every pool's min_replicas, higher priority first;
    2. then per priority level, highest first:
       a. replicas woken less than `min_awake_s` ago that still serve (a switch is not undone at once),
       b. one replica for each pool that holds requests with none running (a cold start or a wake:
          it takes the place of the least recently used replica below),
       c. the replicas pools already run, most recently used pool first (so the least recently
          used one yields its place to b),
       d. growth, one replica at a time to the pool and role furthest below what it wants;
    3. last, the surge: what pools want above their `max_replicas` (`surge_replicas`), from the slots
       no pool's b-d took, by priority and then the same way as d.

Steps a-d stop at each pool's `max_replicas`, a running surge replica included, so another pool's
want takes its device back on the next pass (the surge replica drains).

A pool granted fewer than it runs is scaled down (drained, then stopped or put to sleep), which is
how a higher-priority pool or a held request takes devices from another. Pure: plans in, plans out.

The warm reserve of a pool that sleeps is settled here too, once `desired` is known. A step in load
(a 5x burst that ramps in seconds) outruns any trend forecast, and a cold start (the weights loaded,
the engine initialised) takes longer than the step. A replica asleep at vLLM's sleep level 1 (weights
offloaded to host memory, KV cache freed) wakes by copying its weights back over PCIe: about a
second. `autoscale.warm_reserve: K` in a pool with `sleep` keeps K replicas asleep beyond the awake
ones, so the first replicas a step needs come from a wake. Per role:

    reserve = min(K, max_replicas - desired), at least 0     sleeping replicas to keep

Without `warm_reserve` (None) every replica scaled down sleeps and stays asleep, and none is started
ahead. The executor carries the reserve out (`backends.autoscale.executor`: one start per pass on a
spare device slot, the surplus stopped, a drained replica asleep only while the reserve is short). A
sleeping replica keeps its process and its devices' CUDA context; docs/autoscaling.md says how the
benchmark counts its device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.autoscale.types import PoolPlan, PoolSignals, RolePlan


@dataclass(frozen=True, slots=True)
class Claim:
    """One pool's part in the budget: its plan (wanted per role), signals and standing."""

    plan: PoolPlan
    signals: PoolSignals
    priority: int = 0
    min_by_role: Mapping[str, int] | None = None
    min_awake_s: float = 0.0
    max_by_role: Mapping[str, int] | None = None  # max_replicas per role: above it is surge (None: no cap)


def share_budget(claims: Sequence[Claim], capacity: Mapping[str, int]) -> list[PoolPlan]:
    """The claims' plans with `desired` set within each group's `capacity` (device slots) and the warm
    reserve fitted beside it; pools of an unmanaged group (`""`, or a group absent from `capacity`) get
    what they want."""
    grants: dict[str, dict[str, int]] = {c.plan.pool: {r.role: 0 for r in c.plan.roles} for c in claims}
    groups: dict[str, list[Claim]] = {}
    for claim in claims:
        group = claim.signals.device_group
        if group and group in capacity:
            groups.setdefault(group, []).append(claim)
        else:
            for role in claim.plan.roles:
                grants[claim.plan.pool][role.role] = role.wanted
    notes: dict[str, str] = {}
    for group, members in groups.items():
        left = _allocate(members, capacity[group], grants)
        for claim in members:
            if sum(grants[claim.plan.pool].values()) < claim.plan.wanted:
                notes[claim.plan.pool] = (
                    f"device budget: {group} has {capacity[group]} slots, {left} free after higher claims"
                )
    out = []
    for claim in claims:
        plan = claim.plan
        roles = tuple(
            replace(
                r,
                desired=grants[plan.pool][r.role],
                reserve=reserve_target(r.reserve, (claim.max_by_role or {}).get(r.role), grants[plan.pool][r.role]),
            )
            for r in plan.roles
        )
        reason = plan.reason + (f"; {notes[plan.pool]}" if plan.pool in notes else "")
        out.append(replace(plan, roles=roles, reason=reason))
    return out


def _allocate(members: list[Claim], slots: int, grants: dict[str, dict[str, int]]) -> int:
    left = slots

    def grant(claim: Claim, role: RolePlan, upto: int) -> None:
        nonlocal left
        cost = max(claim.signals.devices_per_replica, 1)
        have = grants[claim.plan.pool][role.role]
        while have < upto and left >= cost:
            have += 1
            left -= cost
        grants[claim.plan.pool][role.role] = have

    def capped(claim: Claim, role: RolePlan, count: int) -> int:
        cap = (claim.max_by_role or {}).get(role.role)
        return count if cap is None else min(count, cap)

    by_priority = sorted(members, key=lambda c: -c.priority)
    for claim in by_priority:  # 1. minimums
        for role in claim.plan.roles:
            low = (claim.min_by_role or {}).get(role.role, 0)
            grant(claim, role, min(low, role.wanted))
    for level in sorted({c.priority for c in members}, reverse=True):
        tier = [c for c in members if c.priority == level]
        recent_first = sorted(tier, key=lambda c: -c.signals.last_request_s)
        for claim in recent_first:  # a. just woken and serving
            now = claim.signals.now_s
            if claim.plan.current and claim.signals.inflight and now - claim.signals.awake_since_s < claim.min_awake_s:
                for role in claim.plan.roles:
                    grant(claim, role, capped(claim, role, min(role.wanted, role.current)))
        for claim in tier:  # b. held requests, nothing running
            serving = _serving_role(claim.plan)
            if claim.signals.held and claim.plan.current == 0 and serving is not None and serving.wanted:
                grant(claim, serving, max(grants[claim.plan.pool][serving.role], 1))
        for claim in recent_first:  # c. incumbents, most recently used first
            for role in claim.plan.roles:
                grant(claim, role, capped(claim, role, min(role.wanted, role.current)))
        _grow(tier, grants, lambda claim, role: capped(claim, role, role.wanted), grant, lambda: left)  # d.
    _grow(by_priority, grants, lambda _claim, role: role.wanted, grant, lambda: left)  # 3. the surge
    return left


def _grow(
    claims: Sequence[Claim],
    grants: dict[str, dict[str, int]],
    want: Callable[[Claim, RolePlan], int],
    grant: Callable[[Claim, RolePlan, int], None],
    left: Callable[[], int],
) -> None:
    """One replica at a time to the pool and role furthest below `want`, while slots remain (the
    claims' priorities first: a surge goes to the higher-priority pool)."""
    for level in sorted({c.priority for c in claims}, reverse=True):
        tier = [c for c in claims if c.priority == level]
        while left() > 0:
            best: tuple[float, Claim, RolePlan] | None = None
            for claim in tier:
                cost = max(claim.signals.devices_per_replica, 1)
                for role in claim.plan.roles:
                    have, upto = grants[claim.plan.pool][role.role], want(claim, role)
                    if have < upto and cost <= left():
                        short = (upto - have) / upto
                        if best is None or short > best[0]:
                            best = (short, claim, role)
            if best is None:
                break
            _short, claim, role = best
            grant(claim, role, grants[claim.plan.pool][role.role] + 1)


def _serving_role(plan: PoolPlan) -> RolePlan | None:
    """The role a pool cannot serve without: decode in a PD pool, else its only role."""
    return plan.role("decode") or plan.role("both") or (plan.roles[0] if plan.roles else None)


def reserve_target(reserve: int | None, high: int | None, desired: int) -> int | None:
    """Sleeping replicas one role keeps beside its `desired` awake ones, under `high` (its
    max_replicas; None: no cap); None: no bound (every replica scaled down sleeps)."""
    if reserve is None:
        return None
    return reserve if high is None else max(min(reserve, high - desired), 0)
