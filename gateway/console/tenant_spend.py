"""Each tenant's own spend this UTC day and month, for the tenant list's spend column
(`GET /admin/tenants?spend=1`), derived from the ledger rather than counted at admission.

Why not a counter: a tenant-wide counter that every tenant has would be one more budget (a day and a
month hash) reserved and settled on every request, and Redis's CPU per admission grows with each
budget a request carries (docs/governance.md, bench/results/overhead-hierarchy.md). The ledger
already holds every finished request's dollars and tenant, so the figure costs the request path
nothing; it is exact for what the ledger holds (every replica's records with `ledger.redis_stream`,
else this replica's directory) and up to `ttl_s` old.

One scan from the start of the UTC month (the calendar of a `usd_per_day`/`usd_per_month` budget)
sums each tenant's `cost_usd`, the records since the start of the day apart. The totals are kept
`ttl_s` and computed by one caller at a time in a worker thread, so a console refreshing the list
costs at most one scan per `ttl_s`, never blocks the event loop, and concurrent callers share it.
Memory: one pair of floats per tenant seen, at most `MAX_TENANTS` (records of further names are not
summed: the list asks only for tenants that exist).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.app.schema import RedisStreamConfig
from gateway.console.usage import ledger_entries

TTL_S = 30.0
MAX_TENANTS = 100_000


@dataclass(slots=True)
class SpendTotals:
    """One scan's answer: per tenant [day, month] in USD, and what the scan covered."""

    computed_at: float
    day_start: float
    month_start: float
    by_tenant: dict[str, list[float]] = field(default_factory=dict)
    source: str = "files"
    covers_since: float | None = None  # the stream was trimmed after the month began


def period_starts(now_s: float) -> tuple[float, float]:
    """The start of the UTC day and of the UTC month holding `now_s` (unix seconds)."""
    now = datetime.fromtimestamp(now_s, UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return day.timestamp(), day.replace(day=1).timestamp()


def scan(directory: Path, stream: RedisStreamConfig | None, now_s: float) -> SpendTotals:
    """Sum the ledger's request records of this month per tenant (blocking: a worker thread's)."""
    day_start, month_start = period_starts(now_s)
    totals = SpendTotals(now_s, day_start, month_start)
    found: dict[str, Any] = {"source": "files"}
    by_tenant = totals.by_tenant
    for entry in ledger_entries(directory, stream, month_start, None, found):
        if entry.get("kind") not in (None, "request"):  # a program's outcome, not a request
            continue
        tenant = entry.get("tenant")
        cost = entry.get("cost_usd")
        if not isinstance(tenant, str) or not isinstance(cost, int | float) or not cost:
            continue
        pair = by_tenant.get(tenant)
        if pair is None:
            if len(by_tenant) >= MAX_TENANTS:
                continue
            pair = by_tenant[tenant] = [0.0, 0.0]
        pair[1] += cost
        ts = entry.get("ts")
        if isinstance(ts, int | float) and ts >= day_start:
            pair[0] += cost
    totals.source = str(found.get("source", "files"))
    covers = found.get("covers_since")
    totals.covers_since = float(covers) if isinstance(covers, int | float) else None
    return totals


class TenantSpend:
    """The ledger-derived spend of every tenant, kept `ttl_s` (one per gateway process)."""

    def __init__(
        self,
        directory: str | Path,
        stream: RedisStreamConfig | None,
        *,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.stream = stream
        self.ttl_s = ttl_s
        self._clock = clock
        self._totals: SpendTotals | None = None
        self._lock = asyncio.Lock()

    def _fresh(self, now_s: float) -> SpendTotals | None:
        totals = self._totals
        if totals is None or now_s - totals.computed_at >= self.ttl_s:
            return None
        if now_s >= totals.day_start + 86_400.0:  # a new day (or month) began: the totals are last period's
            return None
        return totals

    async def totals(self) -> SpendTotals:
        """This month's totals, at most `ttl_s` old; one scan at a time, shared by its waiters.
        Raises what the ledger's read raises (the stream unreachable)."""
        found = self._fresh(self._clock())
        if found is not None:
            return found
        async with self._lock:
            found = self._fresh(self._clock())
            if found is None:
                found = await asyncio.to_thread(scan, self.directory, self.stream, self._clock())
                self._totals = found
            return found

    async def of(self, tenants: Collection[str]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
        """`{tenant: {day, month}}` for the tenants asked (0 for one with no record), and what the
        figures cover (`source`, `as_of`, `covers_since` when the stream was trimmed)."""
        totals = await self.totals()
        spend = {}
        for name in tenants:
            day, month = totals.by_tenant.get(name, (0.0, 0.0))
            spend[name] = {"day": round(day, 6), "month": round(month, 6)}
        about: dict[str, Any] = {"source": "ledger-" + totals.source, "as_of": round(totals.computed_at, 3)}
        if totals.covers_since is not None:
            about["covers_since"] = totals.covers_since
        return spend, about
