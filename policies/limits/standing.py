"""A caller's standing: every bucket, concurrency limit and budget that applies to its key, as they
stand now (charging nothing), with its spend this day and month and the budget it has left.

Shown to the caller (`GET /v1/key`) and to operators (`/admin/keys/{id}`, the console). A bucket
shared by several models (a key's own limit) is listed once, with the models it covers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from policies.limits import buckets
from policies.limits.compile import SPEND_RULE_ID
from policies.limits.types import BudgetSpec, Outcome, Plan
from policies.policy import Policy
from policies.types import NO_SUBJECTS, Principal, RequestSubjects


class Peekable(Protocol):
    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome: ...


async def standing(
    store: Peekable,
    policy: Policy,
    principal: Principal,
    models: Iterable[str],
    subjects: RequestSubjects = NO_SUBJECTS,
    now_s: float | None = None,
) -> dict[str, Any]:
    """`subjects`: also the limits of an end user, tags or an agent run the caller names (`/v1/key?program=`).
    `now_s` overrides the store's clock (tests)."""
    rows: dict[str, dict[str, Any]] = {}
    spend: dict[str, float | None] = {"day": None, "month": None}
    left: dict[str, float | None] = {"day": None, "month": None}
    for model in models:
        if not principal.may_use(model):
            continue
        plan = policy.admission_plan(principal, model, subjects)
        if not (plan.buckets or plan.leases or plan.budgets):
            continue
        outcome = await store.peek(plan, now_s)
        scale = outcome.capacity_scale
        for spec, used in zip(plan.buckets, outcome.bucket_used, strict=True):
            capacity = spec.capacity * scale
            row = rows.get(spec.key)
            if row is None:
                row = rows[spec.key] = {
                    "kind": "bucket",
                    "scope": spec.scope,
                    "rule": spec.rule_id,
                    "subject": spec.subject,
                    "dimension": spec.dimension,
                    "limit": capacity,
                    "used": round(used, 3),
                    "remaining": round(max(0.0, capacity - used), 3),
                    # a run's caps never refill: no reset
                    "reset_s": round(buckets.reset_s(used, spec.rate_per_s * scale), 3)
                    if spec.rate_per_s > 0
                    else None,
                    "shadow": spec.shadow,
                    "models": [],
                }
                if spec.kind == "seconds":  # its use and cap scale alike: the whole cap, the run's age
                    row["limit"] = spec.capacity
                    row.update(run_clock(used / scale if scale else used, spec.capacity, outcome.now_s))
            row["models"].append(model)
        for lease, active in zip(plan.leases, outcome.lease_active, strict=True):
            row = rows.get(lease.key)
            if row is None:
                row = rows[lease.key] = {
                    "kind": "concurrency",
                    "scope": lease.scope,
                    "rule": lease.rule_id,
                    "subject": lease.subject,
                    "dimension": "max_concurrent",
                    "limit": lease.capacity,
                    "used": active,
                    "remaining": max(0, lease.capacity - active),
                    "shadow": lease.shadow,
                    "models": [],
                }
            row["models"].append(model)
        for budget, spent in zip(plan.budgets, outcome.budget_spent, strict=True):
            if budget.scope == "key" and budget.subject == principal.key_id and budget.period in spend:
                spend[budget.period] = spent
            if budget.rule_id == SPEND_RULE_ID:
                continue
            remaining = max(0.0, budget.limit_usd * scale - spent)
            if not budget.shadow and budget.period in left:
                current = left[budget.period]
                left[budget.period] = remaining if current is None else min(current, remaining)
            row = rows.get(budget.key)
            if row is None:
                row = rows[budget.key] = {
                    "kind": "budget",
                    "scope": budget.scope,
                    "rule": budget.rule_id,
                    "subject": budget.subject,
                    "dimension": budget_dimension(budget.period),
                    "limit": budget.limit_usd * scale,
                    "used": round(spent, 6),
                    "remaining": round(remaining, 6),
                    "shadow": budget.shadow,
                    "models": [],
                }
            row["models"].append(model)
    return {
        "spend_usd": {"day": _round(spend["day"]), "month": _round(spend["month"])},
        "budget_left_usd": {"day": _round(left["day"]), "month": _round(left["month"])},
        "limits": list(rows.values()),
    }


async def key_spend(
    store: Peekable, policy: Policy, principal: Principal, models: Iterable[str]
) -> dict[str, float | None]:
    """A key's spend this day and month, as its standing shows them, for one row of a long list.

    A key's spend counters (its own day/month budgets, else the shadow `@spend` trackers the
    compiler adds) are the same store keys whichever model it calls, so one plan of a model it may
    use names them, and one peek of those budgets alone reads them: no bucket, lease or other rule's
    budget is read. None for a period no counter tracks (a file key without `track_key_spend`).
    """
    plan = next((policy.admission_plan(principal, m) for m in models if principal.may_use(m)), None)
    if plan is None:
        return {"day": None, "month": None}
    counters = spend_counters(plan, principal.key_id)
    if not counters:
        return {"day": None, "month": None}
    only = Plan(plan.model, (), (), tuple(counters.values()), plan.price, plan.default_max_tokens, plan.settings)
    outcome = await store.peek(only)
    spent = dict(zip(counters, outcome.budget_spent, strict=True))
    return {"day": _round(spent.get("day")), "month": _round(spent.get("month"))}


def spend_counters(plan: Plan, key_id: str) -> dict[str, BudgetSpec]:
    """The budget that counts a key's spend per period (day, month) in `plan`: the `@spend` tracker
    when there is one, else the key's own budget of that period (what `standing` reports)."""
    found: dict[str, BudgetSpec] = {}
    for budget in plan.budgets:
        if budget.scope != "key" or budget.subject != key_id or budget.period not in ("day", "month"):
            continue
        if budget.period not in found or budget.rule_id == SPEND_RULE_ID:
            found[budget.period] = budget
    return found


def run_clock(elapsed_s: float, cap_s: float, now_s: float) -> dict[str, Any]:
    """A run's wall-clock cap as a standing row shows it: when its first admitted call started it (None:
    no call yet) and the seconds it has left. The clock's `used` is the run's age in seconds."""
    started = elapsed_s > 0.0
    return {
        "used": round(elapsed_s, 3),
        "remaining": round(max(0.0, cap_s - elapsed_s), 3),
        "started_at": round(now_s - elapsed_s, 3) if started else None,
        "seconds_left": round(max(0.0, cap_s - elapsed_s), 3) if started else round(cap_s, 3),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def budget_dimension(period: str) -> str:
    """A budget's dimension as policies.yaml names it: usd_per_day / _month / _run, or usd_per_period."""
    return "usd_per_period" if period.startswith("billing:") else f"usd_per_{period}"
