"""This replica's copy of the last state Redis reported for each bucket and budget it touched.

It serves three purposes without extra round trips: an early local rejection when a bucket is known to
be short (`precheck`: the local side may reject, it never admits), the seed of the fail-open buckets
(this replica's 1/N share of what was used, so an outage does not hand out a fresh full limit), and
the per-bucket gauges of /admin/status. Entries are corrected by this replica's own settlements;
other replicas' refunds are unseen, which is why a precheck only trusts an entry for `max_age_s`.

All times are on the store's clock (Redis TIME, estimated locally by `FailoverStore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.limits import buckets
from policies.limits.memory_store import bucket_row, budget_row
from policies.limits.types import BucketSpec, BudgetSpec, Charge, Outcome, Plan, Settlement


@dataclass(slots=True)
class _Seen:
    used: float
    at_s: float
    spec: BucketSpec


@dataclass(slots=True)
class _SeenBudget:
    period: int
    spent_usd: float
    at_s: float
    spec: BudgetSpec


class Mirror:
    def __init__(self, *, max_age_s: float = 1.0) -> None:
        self.max_age_s = max_age_s
        self._buckets: dict[str, _Seen] = {}
        self._budgets: dict[str, _SeenBudget] = {}

    def record(self, plan: Plan, charge: Charge, outcome: Outcome) -> None:
        now_s = outcome.now_s
        for spec, used, cost in zip(plan.buckets, outcome.bucket_used, charge.bucket_costs, strict=True):
            self._buckets[spec.key] = _Seen(used + cost if outcome.admitted else used, now_s, spec)
        for budget_spec, spent, pid in zip(plan.budgets, outcome.budget_spent, outcome.budget_periods, strict=True):
            total = spent + charge.cost_usd if outcome.admitted else spent
            self._budgets[budget_spec.key] = _SeenBudget(pid, total, now_s, budget_spec)

    def settled(self, plan: Plan, settlement: Settlement) -> None:
        for spec, delta in zip(plan.buckets, settlement.bucket_deltas, strict=True):
            seen = self._buckets.get(spec.key)
            if seen is not None:
                seen.used = max(0.0, seen.used + delta)
        for budget_spec, pid in zip(plan.budgets, settlement.budget_periods, strict=True):
            budget = self._budgets.get(budget_spec.key)
            if budget is not None and budget.period == pid:
                budget.spent_usd = max(0.0, budget.spent_usd + settlement.budget_delta_usd)

    def used_at(self, key: str, now_s: float) -> float | None:
        seen = self._buckets.get(key)
        if seen is None:
            return None
        return buckets.drained(seen.used, seen.at_s, now_s, seen.spec.rate_per_s)

    def precheck(self, plan: Plan, charge: Charge, now_s: float) -> Outcome | None:
        """A rejection decided from fresh mirror entries alone, or None to ask Redis."""
        short = False
        used: list[float] = []
        for spec, cost in zip(plan.buckets, charge.bucket_costs, strict=True):
            seen = self._buckets.get(spec.key)
            if seen is None or abs(now_s - seen.at_s) > self.max_age_s:
                used.append(0.0)
                continue
            u = buckets.drained(seen.used, seen.at_s, now_s, spec.rate_per_s)
            used.append(u)
            if not spec.shadow and u + cost > spec.capacity:
                short = True
        spent: list[float] = []
        periods: list[int] = []
        for budget_spec in plan.budgets:
            budget = self._budgets.get(budget_spec.key)
            pid = buckets.period_id(budget_spec.period, now_s)
            fresh = budget is not None and budget.period == pid and abs(now_s - budget.at_s) <= self.max_age_s
            s = budget.spent_usd if fresh and budget is not None else 0.0
            spent.append(s)
            periods.append(pid)
            if fresh and not budget_spec.shadow and s + charge.cost_usd > budget_spec.limit_usd:
                short = True
        if not short:
            return None
        return Outcome(False, now_s, used, [0] * len(plan.leases), spent, periods, "precheck")

    def seed(self, spec: BucketSpec | BudgetSpec, now_s: float) -> float | None:
        """The last known global amount, for a fail-open bucket or budget that has none yet."""
        if isinstance(spec, BucketSpec):
            return self.used_at(spec.key, now_s)
        budget = self._budgets.get(spec.key)
        if budget is None or budget.period != buckets.period_id(spec.period, now_s):
            return None
        return budget.spent_usd

    def sweep(self, now_s: float) -> None:
        for key, seen in list(self._buckets.items()):
            rate = seen.spec.rate_per_s
            if (rate <= 0.0 and now_s - seen.at_s > 3600.0) or buckets.drained(
                seen.used, seen.at_s, now_s, rate
            ) <= 0.0:
                del self._buckets[key]
        for key, budget in list(self._budgets.items()):
            if now_s - budget.at_s > 3600.0:
                del self._budgets[key]

    def snapshot(self, now_s: float) -> list[dict[str, Any]]:
        rows = [bucket_row(seen.spec, self.used_at(key, now_s) or 0.0, "redis") for key, seen in self._buckets.items()]
        rows += [budget_row(b.spec, b.spent_usd, "redis") for b in self._budgets.values()]
        return rows
