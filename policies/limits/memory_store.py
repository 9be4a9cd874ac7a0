"""The in-process store and the bucket arithmetic every store shares: buckets, leases, budgets and the
index of live agent runs, in dictionaries for one gateway process.

The memory store decides and writes a whole reservation without an await; the Redis scripts
(reserve.lua, preamble.lua) implement the same bucket formulas, which the tests hold both to; the Redis
store and the mirror use the arithmetic below as well.

The in-process store
--------------------

The in-process store: every bucket, lease and budget in dictionaries, for one gateway process.

All of a reservation is decided and written without an await, so on one event loop it is atomic
with no lock. It is also the fail-open fallback of the Redis store, where it holds this replica's
share (`scale` = 1/replicas) seeded from the last state Redis reported.

Like the Redis store it keeps the open tickets: reserving a ticket twice charges it once, and a
settlement of a ticket it does not hold (never reserved, settled already, or reserved before a
`clear`) changes nothing. Open tickets are bounded by the requests in flight; one never settled
(a bug) is forgotten after the ticket TTL.

Bucket arithmetic
-----------------

Bucket arithmetic shared by the memory store, the Redis script's mirror and the headers.

A bucket holds `used` (tokens or requests consumed) that drains continuously at `rate_per_s`; a
request fits when `used + cost <= capacity`. Storing what is used rather than what is left keeps a
reload that changes the capacity meaningful (consumption is kept) and lets a reconciled charge push
`used` past capacity (debt), which then delays later requests by exactly the overrun. reserve.lua
implements the same formulas; the tests hold both to them.

The index of live agent runs
----------------------------

The index of live agent runs (policies/limits/standing.py): the runs whose calls were admitted last,
when, and by which key and model. The memory store keeps it here; reserve.lua keeps the same in Redis.
It only names runs: what each used stays in the run's own counters.
"""

from __future__ import annotations

import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from policies.limits.plan import (
    BucketSpec,
    BudgetSpec,
    Charge,
    LeaseSpec,
    Outcome,
    Plan,
    RunRef,
    Settlement,
    ticket_ttl_s,
)


def drained(used: float, updated_at_s: float, now_s: float, rate_per_s: float) -> float:
    """`used` after draining from `updated_at_s` to `now_s` (never below zero; a clock step back is ignored)."""
    if now_s <= updated_at_s:
        return used
    left = used - (now_s - updated_at_s) * rate_per_s
    return left if left > 0.0 else 0.0


# A counter that never drains or resets (an agent run's caps and budget) is forgotten this long after
# its last write: the Redis scripts' expiry, and the memory store's sweep.
IDLE_TTL_S = 32 * 86_400


def wait_s(used: float, cost: float, capacity: float, rate_per_s: float) -> float:
    """Seconds until `cost` fits, with no other traffic; inf when it exceeds the whole capacity or
    the bucket never drains."""
    if cost > capacity:
        return math.inf
    over = used + cost - capacity
    if over <= 0.0:
        return 0.0
    return over / rate_per_s if rate_per_s > 0.0 else math.inf


def reset_s(used: float, rate_per_s: float) -> float:
    """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-* meaning); inf for one that
    never drains."""
    if used <= 0.0:
        return 0.0
    return used / rate_per_s if rate_per_s > 0.0 else math.inf


def period_id(period: str, now_s: float) -> int:
    """Calendar period index (UTC): days since the epoch, months since year 0 (`y*12 + m-1`), or 0
    for an agent run's budget (one period that never ends)."""
    day = int(now_s // 86_400)
    if period == "day":
        return day
    if period == "run":
        return 0
    if period[0] == "b":  # billing:<anchor day>:<UTC offset s>
        anchor, offset = billing_of(period)
        moment = datetime.fromtimestamp(now_s + offset, UTC)  # the wall clock of the period's zone
        month = moment.year * 12 + moment.month - 1
        return month if moment.day >= anchor else month - 1
    if day != _month_of[0]:  # one calendar conversion per day, not one per budget per request
        moment = datetime.fromtimestamp(now_s, UTC)
        _month_of[:] = [day, moment.year * 12 + moment.month - 1]
    return _month_of[1]


_month_of: list[int] = [-1, 0]  # [day number, its month index]: period_id's cache of one day


def period_end_s(period: str, pid: int) -> float:
    """Epoch seconds at which period `pid` ends (when its budget resets); inf for a run's."""
    if period == "day":
        return (pid + 1) * 86_400.0
    if period == "run":
        return math.inf
    year, month0 = divmod(pid + 1, 12)
    if period[0] == "b":
        anchor, offset = billing_of(period)
        return datetime(year, month0 + 1, anchor, tzinfo=UTC).timestamp() - offset
    return datetime(year, month0 + 1, 1, tzinfo=UTC).timestamp()


@functools.cache
def billing_of(period: str) -> tuple[int, int]:
    """(anchor day, UTC offset in seconds) of a `billing:<day>:<offset>` period (policies' BillingPeriod):
    period `y*12 + m-1` starts on day `anchor` of month m at 00:00 in the zone, the Redis scripts alike."""
    _, day, offset = period.split(":")
    return int(day), int(offset)


def period_ttl_s(period: str) -> int:
    """How long a budget counter outlives its last write (longer than any period)."""
    return 2 * 86_400 if period == "day" else IDLE_TTL_S


INDEX_MAX = 10_000  # runs kept in the index, the least recently seen forgotten first
TRIM_SLACK = 64  # Redis trims the index once it is this far over its bound, in one batch
READ_MAX = 1_000  # newest index entries one listing reads (before its tenant filter)


@dataclass(frozen=True, slots=True)
class RunSeen:
    """One index entry: a run, when its last admitted call was, and the key and model that made it."""

    tenant: str
    program: str
    last_seen_s: float
    key_id: str
    model: str


def parse_entry(subject: str, last_seen_s: float, meta: str) -> RunSeen | None:
    """An entry as the Redis index stores it (`tenant/program`, and `key model`); None if malformed."""
    tenant, sep, program = subject.partition("/")
    key_id, _, model = meta.partition(" ")
    if not sep or not tenant or not program or not key_id:
        return None
    return RunSeen(tenant, program, last_seen_s, key_id, model)


class RunIndex:
    """The memory store's index: run subject -> (last seen, key, model), least recently seen first."""

    def __init__(self, max_runs: int = INDEX_MAX) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[str, tuple[float, RunRef, str]] = OrderedDict()

    def touch(self, run: RunRef, model: str, now_s: float) -> None:
        subject = run.subject
        self._runs[subject] = (now_s, run, model)
        self._runs.move_to_end(subject)
        while len(self._runs) > self.max_runs:
            self._runs.popitem(last=False)

    def recent(self, limit: int, now_s: float) -> list[RunSeen]:
        """The `limit` runs seen last, newest first, none idle past the counters' expiry."""
        out: list[RunSeen] = []
        for seen_s, run, model in reversed(self._runs.values()):
            if len(out) >= limit:
                break
            if now_s - seen_s <= IDLE_TTL_S:
                out.append(RunSeen(run.tenant, run.program, seen_s, run.key_id, model))
        return out

    def clear(self) -> None:
        self._runs.clear()

    def __len__(self) -> int:
        return len(self._runs)


# (spec, now_s) -> global `used` of a bucket / `spent` of a budget's current period, when known.
SeedFn = Callable[[BucketSpec | BudgetSpec, float], float | None]


class LeaseTable:
    """Concurrency leases that expire on their own, per key, in memory. O(active leases of one key)
    per acquire, which capacity bounds.

    A lease is (ticket id -> expiry). Counting only unexpired leases means a gateway that crashes
    between admit and settle leaks nothing for longer than the lease TTL; the Redis store keeps the
    same shape in a sorted set scored by expiry.
    """

    def __init__(self) -> None:
        self._leases: dict[str, dict[str, float]] = {}

    def active(self, key: str, now_s: float) -> int:
        """Unexpired leases of `key` (expired ones are dropped as a side effect)."""
        leases = self._leases.get(key)
        if not leases:
            return 0
        expired = [lease for lease, expires_at_s in leases.items() if expires_at_s <= now_s]
        for lease in expired:
            del leases[lease]
        return len(leases)

    def acquire(self, key: str, lease_id: str, expires_at_s: float) -> None:
        self._leases.setdefault(key, {})[lease_id] = expires_at_s

    def release(self, key: str, lease_id: str) -> None:
        leases = self._leases.get(key)
        if leases is not None:
            leases.pop(lease_id, None)
            if not leases:
                del self._leases[key]

    def sweep(self, now_s: float) -> None:
        for key in list(self._leases):
            if self.active(key, now_s) == 0:
                self._leases.pop(key, None)

    def items(self, now_s: float) -> list[tuple[str, int]]:
        return [(key, self.active(key, now_s)) for key in list(self._leases)]

    def clear(self) -> None:
        self._leases.clear()


@dataclass(slots=True)
class _Bucket:
    used: float
    updated_at_s: float
    spec: BucketSpec


@dataclass(slots=True)
class _Budget:
    period: int
    spent_usd: float
    spec: BudgetSpec
    touched_s: float = 0.0  # last reservation: an agent run's budget (one period) is forgotten when idle


class MemoryStore:
    """Continuous-refill buckets, expiring leases and calendar budgets in memory (microseconds a call)."""

    may_suspend = False  # no call awaits anything: atomic on the event loop

    def __init__(
        self,
        *,
        source: str = "memory",
        seed: SeedFn | None = None,
        clock: Callable[[], float] = time.time,
        sweep_every: int = 4096,
    ) -> None:
        self.source = source
        self.scale = 1.0  # fail-open: this replica's share of every limit (1/replicas)
        self.generation = 0  # bumped by clear(): settlements of older tickets are dropped
        self._seed = seed
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._budgets: dict[str, _Budget] = {}
        self._leases = LeaseTable()
        self._lease_specs: dict[str, LeaseSpec] = {}
        self._tickets: dict[str, float] = {}  # open ticket -> expiry (s)
        self.runs = RunIndex()  # the agent runs admitted last (policies/limits/standing.py)
        self._sweep_every = sweep_every
        self._ops = 0

    async def reserve(self, plan: Plan, charge: Charge, now_s: float | None = None) -> Outcome:
        return self.reserve_now(plan, charge, self._clock() if now_s is None else now_s)

    async def apply(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> bool:
        return self.apply_now(plan, settlement, self._clock() if now_s is None else now_s)

    def apply_soon(self, plan: Plan, settlement: Settlement, now_s: float | None = None, *, lazy: bool = True) -> None:
        """`Store.apply_soon`: done before it returns."""
        self.apply_now(plan, settlement, self._clock() if now_s is None else now_s)

    def reserve_now(self, plan: Plan, charge: Charge, now_s: float) -> Outcome:
        """All-or-nothing: check every bucket, lease and budget, then write all or none."""
        scale = self.scale
        self._ops += 1
        if self._ops % self._sweep_every == 0:
            self.sweep(now_s)
        again = charge.ticket_id in self._tickets
        ok = not again
        states: list[_Bucket] = []
        used: list[float] = []
        for spec, cost in zip(plan.buckets, charge.bucket_costs, strict=True):
            state = self._bucket(spec, now_s, scale)
            u = drained(state.used, state.updated_at_s, now_s, spec.rate_per_s * scale)
            state.used, state.updated_at_s = u, now_s
            states.append(state)
            used.append(u)
            # A fail-open share smaller than one request would block it forever: an empty share
            # still admits anything the whole limit could.
            share_exception = scale < 1.0 and u <= 0.0 and cost <= spec.capacity
            if not spec.shadow and u + cost > spec.capacity * scale and not share_exception:
                ok = False
        active: list[int] = []
        for lease in plan.leases:
            self._lease_specs[lease.key] = lease
            n = self._leases.active(lease.key, now_s)
            active.append(n)
            if not lease.shadow and n + 1 > max(1, math.ceil(lease.capacity * scale)):
                ok = False
        budget_states: list[_Budget] = []
        spent: list[float] = []
        periods: list[int] = []
        for budget_spec in plan.budgets:
            budget = self._budget(budget_spec, now_s, scale)
            budget_states.append(budget)
            spent.append(budget.spent_usd)
            periods.append(budget.period)
            if not budget_spec.shadow and budget.spent_usd + charge.cost_usd > budget_spec.limit_usd * scale:
                ok = False
        if again:  # reserved before: report the state, charge nothing
            return Outcome(True, now_s, used, active, spent, periods, self.source, scale)
        if ok:
            self._tickets[charge.ticket_id] = now_s + ticket_ttl_s(plan.settings.lease_ttl_s)
            for state, cost in zip(states, charge.bucket_costs, strict=True):
                state.used += cost
            expires_at_s = now_s + plan.settings.lease_ttl_s
            for lease in plan.leases:
                self._leases.acquire(lease.key, charge.ticket_id, expires_at_s)
            for budget in budget_states:
                budget.spent_usd += charge.cost_usd
                budget.touched_s = now_s
            if plan.run is not None:
                self.runs.touch(plan.run, plan.model, now_s)
        return Outcome(ok, now_s, used, active, spent, periods, self.source, scale)

    async def recent_runs(self, limit: int, now_s: float | None = None) -> list[RunSeen]:
        """The agent runs admitted last, newest first (at most `limit`)."""
        return self.runs.recent(limit, self._clock() if now_s is None else now_s)

    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome:
        return self.peek_now(plan, self._clock() if now_s is None else now_s)

    def peek_now(self, plan: Plan, now_s: float) -> Outcome:
        """The plan's state as it stands, creating and charging nothing."""
        scale = self.scale
        used = []
        for spec in plan.buckets:
            state = self._buckets.get(spec.key)
            used.append(
                0.0 if state is None else drained(state.used, state.updated_at_s, now_s, spec.rate_per_s * scale)
            )
        active = [self._leases.active(lease.key, now_s) for lease in plan.leases]
        spent, periods = [], []
        for budget_spec in plan.budgets:
            pid = period_id(budget_spec.period, now_s)
            budget = self._budgets.get(budget_spec.key)
            spent.append(budget.spent_usd if budget is not None and budget.period == pid else 0.0)
            periods.append(pid)
        return Outcome(True, now_s, used, active, spent, periods, self.source, scale)

    def apply_now(self, plan: Plan, settlement: Settlement, now_s: float) -> bool:
        """Settle an open ticket; False (and nothing changed) for a ticket this store does not hold."""
        if self._tickets.pop(settlement.ticket_id, None) is None:
            return False
        for spec, delta in zip(plan.buckets, settlement.bucket_deltas, strict=True):
            state = self._buckets.get(spec.key)
            if state is None:
                if delta <= 0.0:
                    continue
                state = self._buckets[spec.key] = _Bucket(0.0, now_s, spec)
            u = drained(state.used, state.updated_at_s, now_s, spec.rate_per_s * self.scale) + delta
            state.used, state.updated_at_s = (u if u > 0.0 else 0.0), now_s
        for lease in plan.leases:
            self._leases.release(lease.key, settlement.ticket_id)
        if settlement.budget_delta_usd:
            for budget_spec, pid in zip(plan.budgets, settlement.budget_periods, strict=True):
                budget = self._budgets.get(budget_spec.key)
                if budget is not None and budget.period == pid:
                    budget.spent_usd = max(0.0, budget.spent_usd + settlement.budget_delta_usd)
        return True

    def _bucket(self, spec: BucketSpec, now_s: float, scale: float) -> _Bucket:
        state = self._buckets.get(spec.key)
        if state is None:
            seeded = self._seed(spec, now_s) if self._seed is not None else None
            state = self._buckets[spec.key] = _Bucket((seeded or 0.0) * scale, now_s, spec)
        elif state.spec is not spec:
            state.spec = spec  # the policy was reloaded: keep what is used, take the new limit
        return state

    def _budget(self, spec: BudgetSpec, now_s: float, scale: float) -> _Budget:
        pid = period_id(spec.period, now_s)
        budget = self._budgets.get(spec.key)
        if budget is None or budget.period != pid:
            seeded = self._seed(spec, now_s) if self._seed is not None else None
            budget = self._budgets[spec.key] = _Budget(pid, (seeded or 0.0) * scale, spec, now_s)
        elif budget.spec is not spec:
            budget.spec = spec
        return budget

    def sweep(self, now_s: float) -> None:
        """Drop full buckets and past budgets so many short-lived subjects cannot grow memory."""
        for key, state in list(self._buckets.items()):
            rate = state.spec.rate_per_s * self.scale
            if rate <= 0.0:  # never drains (an agent run's cap): forgotten once idle long enough
                if now_s - state.updated_at_s > IDLE_TTL_S:
                    del self._buckets[key]
            elif drained(state.used, state.updated_at_s, now_s, rate) <= 0.0:
                del self._buckets[key]
        for key, budget in list(self._budgets.items()):
            if budget.period != period_id(budget.spec.period, now_s) or (
                budget.spec.period == "run" and now_s - budget.touched_s > IDLE_TTL_S
            ):
                del self._budgets[key]
        self._leases.sweep(now_s)
        for ticket in [t for t, expires_at_s in self._tickets.items() if expires_at_s <= now_s]:
            del self._tickets[ticket]
        for key in [k for k in self._lease_specs if self._leases.active(k, now_s) == 0]:
            del self._lease_specs[key]

    def clear(self) -> None:
        self.generation += 1
        self._buckets.clear()
        self._budgets.clear()
        self._leases.clear()
        self._lease_specs.clear()
        self._tickets.clear()
        self.runs.clear()

    def holds_state(self) -> bool:
        """Anything counted here (the fail-open store: an outage, however short, left numbers)."""
        return bool(self._buckets or self._budgets or self._tickets)

    def status(self) -> dict[str, Any]:
        return {"store": self.source, "buckets": len(self._buckets), "budgets": len(self._budgets)}

    async def close(self) -> None:
        return None

    def snapshot(self, now_s: float | None = None) -> list[dict[str, Any]]:
        """Rows for /admin/status and gauges: every bucket and budget this store holds."""
        now_s = self._clock() if now_s is None else now_s
        rows: list[dict[str, Any]] = []
        for state in self._buckets.values():
            spec = state.spec
            used = drained(state.used, state.updated_at_s, now_s, spec.rate_per_s * self.scale)
            rows.append(bucket_row(spec, used, self.source, self.scale))
        for key, active in self._leases.items(now_s):
            lease = self._lease_specs.get(key)
            if lease is not None:
                rows.append(lease_row(lease, active, self.source, self.scale))
        rows.extend(budget_row(b.spec, b.spent_usd, self.source, self.scale) for b in self._budgets.values())
        return rows


def bucket_row(spec: BucketSpec, used: float, store: str, scale: float = 1.0) -> dict[str, Any]:
    capacity = spec.capacity * scale
    return {
        "kind": "bucket",
        "rule": spec.rule_id,
        "scope": spec.scope,
        "subject": spec.subject,
        "dimension": spec.dimension,
        "capacity": capacity,
        "used": used,
        "remaining": max(0.0, capacity - used),
        "reset_s": reset_s(used, spec.rate_per_s * scale),
        "shadow": spec.shadow,
        "store": store,
    }


def lease_row(spec: LeaseSpec, active: int, store: str, scale: float = 1.0) -> dict[str, Any]:
    return {
        "kind": "concurrency",
        "rule": spec.rule_id,
        "scope": spec.scope,
        "subject": spec.subject,
        "dimension": "max_concurrent",
        "capacity": max(1, math.ceil(spec.capacity * scale)),
        "active": active,
        "shadow": spec.shadow,
        "store": store,
    }


def budget_row(spec: BudgetSpec, spent_usd: float, store: str, scale: float = 1.0) -> dict[str, Any]:
    limit_usd = spec.limit_usd * scale
    return {
        "kind": "budget",
        "rule": spec.rule_id,
        "scope": spec.scope,
        "subject": spec.subject,
        "period": spec.period,
        "limit_usd": limit_usd,
        "spent_usd": spent_usd,
        "remaining_usd": max(0.0, limit_usd - spent_usd),
        "shadow": spec.shadow,
        "store": store,
    }
