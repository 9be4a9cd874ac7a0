"""Standings, charging nothing: every limit and budget that applies to a caller as it stands now, and the
live agent runs with what each has used.

A live run's standing is a caller's standing narrowed to one run's counters, read the same way.

A caller's standing
-------------------

A caller's standing: every bucket, concurrency limit and budget that applies to its key, as they
stand now (charging nothing), with its spend this day and month and the budget it has left.

Shown to the caller (`GET /v1/key`) and to operators (`/admin/keys/{id}`, the console). A bucket
shared by several models (a key's own limit) is listed once, with the models it covers.

Live agent runs
---------------

Live agent runs: which runs called lately, so that an operator can see what each has spent.

A run's counters (`calls_per_run`, `tokens_per_run`, `usd_per_run`, its clock) live under keys named
by rule and subject; listing them would mean scanning the store. Instead every admitted call of a
plan that counts a run (`Plan.run`) notes the run in a small index in the same step as its
reservation: in memory (`memory_store.RunIndex`), in Redis by reserve.lua (a sorted set of runs by their last
admitted call, and a hash of the key and model that made it). The console reads the newest entries
and then the runs' own counters, exactly as `GET /v1/key?program=` reads them (`run_standing`), from
whichever replica it asks.

Bounded: the index keeps the `INDEX_MAX` runs seen last (Redis trims in batches of `TRIM_SLACK`); an
entry older than the counters' idle expiry (32 days) is skipped when read. A run without a run rule
(or run header) has no counters and is never indexed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from policies.limits import memory_store
from policies.limits.memory_store import RunSeen
from policies.limits.plan import SPEND_RULE_ID, BudgetSpec, Outcome, Plan
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
                    "reset_s": round(memory_store.reset_s(used, spec.rate_per_s * scale), 3)
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


class RunReader(Protocol):
    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome: ...

    async def recent_runs(self, limit: int, now_s: float | None = None) -> list[RunSeen]: ...


def run_only(plan: Plan) -> Plan:
    """`plan` narrowed to the run's own counters (scope program): one peek reads nothing else."""
    return Plan(
        plan.model,
        tuple(b for b in plan.buckets if b.scope == "program"),
        tuple(lease for lease in plan.leases if lease.scope == "program"),
        tuple(b for b in plan.budgets if b.scope == "program" and b.rule_id != SPEND_RULE_ID),
        plan.price,
        plan.default_max_tokens,
        plan.settings,
        plan.run,
    )


async def run_standing(store: RunReader, plan: Plan, now_s: float | None = None) -> dict[str, Any]:
    """What one run used of each of its caps, from the counters `GET /v1/key?program=` reads: `calls`,
    `tokens`, `spent_usd` (None where no rule counts them), its clock, and every cap with what is left."""
    only = run_only(plan)
    outcome = await store.peek(only, now_s)
    scale = outcome.capacity_scale or 1.0
    row: dict[str, Any] = {"calls": None, "tokens": None, "spent_usd": None, "started_at": None, "seconds_left": None}
    caps: list[dict[str, Any]] = []
    for spec, used in zip(only.buckets, outcome.bucket_used, strict=True):
        cap: dict[str, Any] = {
            "dimension": spec.dimension,
            "rule": spec.rule_id,
            "limit": spec.capacity,
            "used": round(used / scale, 3),
            "remaining": round(max(0.0, spec.capacity - used / scale), 3),
            "shadow": spec.shadow,
        }
        if spec.kind == "seconds":
            cap.update(run_clock(used / scale, spec.capacity, outcome.now_s))
            row["started_at"], row["seconds_left"] = cap["started_at"], cap["seconds_left"]
        elif spec.dimension == "calls_per_run":
            row["calls"] = _larger(row["calls"], cap["used"])
        elif spec.dimension == "tokens_per_run":
            row["tokens"] = _larger(row["tokens"], cap["used"])
        if spec.rate_per_s <= 0:  # a minute's rate (rpm, tpm of the run) is not what the run used
            caps.append(cap)
    for lease, active in zip(only.leases, outcome.lease_active, strict=True):
        caps.append(
            {
                "dimension": "max_concurrent",
                "rule": lease.rule_id,
                "limit": lease.capacity,
                "used": active,
                "remaining": max(0, lease.capacity - active),
                "shadow": lease.shadow,
            }
        )
    for budget, spent in zip(only.budgets, outcome.budget_spent, strict=True):
        if budget.period != "run":
            continue
        spent_usd = spent / scale
        caps.append(
            {
                "dimension": budget_dimension(budget.period),
                "rule": budget.rule_id,
                "limit": budget.limit_usd,
                "used": round(spent_usd, 6),
                "remaining": round(max(0.0, budget.limit_usd - spent_usd), 6),
                "shadow": budget.shadow,
            }
        )
        row["spent_usd"] = _larger(row["spent_usd"], round(spent_usd, 6))
    row["caps"] = caps
    return row


def _larger(current: float | None, value: float) -> float:
    """Two rules counting the same thing for one run (neither more specific): the larger count."""
    return value if current is None else max(current, value)


def order(rows: Sequence[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Rows by spend (then calls, then tokens; unknown last) or by their last call, largest first."""
    if by == "recent":
        return sorted(rows, key=lambda r: -float(r["last_seen"]))

    def spend(row: dict[str, Any]) -> tuple[float, float, float, float]:
        def value(name: str) -> float:
            v = row.get(name)
            return -math.inf if v is None else float(v)

        return (value("spent_usd"), value("calls"), value("tokens"), float(row["last_seen"]))

    return sorted(rows, key=spend, reverse=True)
