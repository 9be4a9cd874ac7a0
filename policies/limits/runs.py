"""Live agent runs: which runs called lately, so that an operator can see what each has spent.

A run's counters (`calls_per_run`, `tokens_per_run`, `usd_per_run`, its clock) live under keys named
by rule and subject; listing them would mean scanning the store. Instead every admitted call of a
plan that counts a run (`Plan.run`) notes the run in a small index in the same step as its
reservation: in memory (`run_index.RunIndex`), in Redis by reserve.lua (a sorted set of runs by their last
admitted call, and a hash of the key and model that made it). The console reads the newest entries
and then the runs' own counters, exactly as `GET /v1/key?program=` reads them (`run_standing`), from
whichever replica it asks.

Bounded: the index keeps the `INDEX_MAX` runs seen last (Redis trims in batches of `TRIM_SLACK`); an
entry older than the counters' idle expiry (32 days) is skipped when read. A run without a run rule
(or run header) has no counters and is never indexed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from policies.limits.compile import SPEND_RULE_ID
from policies.limits.run_index import RunSeen
from policies.limits.standing import budget_dimension, run_clock
from policies.limits.types import Outcome, Plan


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
