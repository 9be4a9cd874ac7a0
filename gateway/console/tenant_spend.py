"""Each tenant's own spend this UTC day and month, for the tenant list's spend column
(`GET /admin/tenants?spend=1`), derived from the ledger rather than counted at admission.

Why not a counter: a tenant-wide counter that every tenant has would be one more budget (a day and a
month hash) reserved and settled on every request, and Redis's CPU per admission grows with each
budget a request carries (docs/governance.md, bench/results/overhead-hierarchy.md). The ledger
already holds every finished request's dollars and tenant, so the figure costs the request path
nothing; it is exact for what the ledger holds (every replica's records with its Redis stream, the
default with `state: redis`, else this replica's directory) and up to `ttl_s` old. Once a process has
read the month, a stream trimmed by its cap no longer matters: only entries added since are read.

The first scan reads from the start of the UTC month (the calendar of a `usd_per_day`/`usd_per_month`
budget) and sums each tenant's `cost_usd`, the records since the start of the day apart; every later
one reads only what was added since, from where the last stopped (each file's byte offset, or the
stream's last entry id), so a refresh costs the records of the last `ttl_s`, not the month's. A new
UTC day zeroes the day's sums and goes on; a new month, or a file that shrank (replaced), starts over
with a whole scan. The totals are kept `ttl_s` and computed by one caller at a time in a worker
thread, so a console refreshing the list never blocks the event loop and concurrent callers share
one read. Memory: one pair of floats per tenant seen, at most `MAX_TENANTS` (records of further names
are not summed: the list asks only for tenants that exist), one offset per ledger file of the month,
and with the stream the last `DEDUPE_WINDOW` request ids (a record delivered twice is counted once).

The same pass sums each agent run's calls, tokens and dollars this month (`RunTotals`, per tenant and
program id as the ledger stores it) for the console's Programs page: a run no run rule counts has no
counters (docs/agents.md#live-programs-in-the-console), so its spend comes from here. At most
`MAX_RUNS` runs are kept, those with the latest records (a run idle longest goes first).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.app.settings import RedisStreamConfig
from gateway.console.usage import stream_entries
from gateway.ledger.reader import bounded_lines, files_in_window
from gateway.ledger.writer import decode

TTL_S = 30.0
MAX_TENANTS = 100_000
MAX_RUNS = 10_000


@dataclass(slots=True)
class RunTotals:
    """One agent run's calls (records not rejected at admission), tokens (input + output) and dollars
    this month as the ledger holds them, its first and last record's time, the key and model of its
    last call."""

    tenant: str
    program: str
    calls: int = 0
    tokens: int = 0
    usd: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    key_id: str | None = None
    model: str | None = None


@dataclass(slots=True)
class SpendTotals:
    """One scan's answer: per tenant [day, month] in USD, what the scan covered, and where the next
    one goes on from (`offsets`: file name → bytes read; `last_id` and `seen`: the stream's)."""

    computed_at: float
    day_start: float
    month_start: float
    by_tenant: dict[str, list[float]] = field(default_factory=dict)
    source: str = "files"
    covers_since: float | None = None  # the stream was trimmed past records not read
    offsets: dict[str, int] = field(default_factory=dict)
    last_id: str | None = None
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    runs: OrderedDict[tuple[str, str], RunTotals] = field(default_factory=OrderedDict)  # by last record


def period_starts(now_s: float) -> tuple[float, float]:
    """The start of the UTC day and of the UTC month holding `now_s` (unix seconds)."""
    now = datetime.fromtimestamp(now_s, UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return day.timestamp(), day.replace(day=1).timestamp()


class _Rewound(Exception):
    """A ledger file is shorter than the offset read before: it was replaced, start over."""


def scan(
    directory: Path, stream: RedisStreamConfig | None, now_s: float, previous: SpendTotals | None = None
) -> SpendTotals:
    """This month's request records summed per tenant (blocking: a worker thread's): those added since
    `previous` on top of its sums when it is of the same UTC month and source (a new day only zeroes
    the day's sums: a record read before it finished before it), else all of them. Going on across
    days keeps the month whole once read, however far the stream's cap has trimmed it since.
    `previous` is never changed (its readers may still be reading it)."""
    day_start, month_start = period_starts(now_s)
    source = "files" if stream is None else "redis-stream"
    if previous is not None and (previous.month_start != month_start or previous.source != source):
        previous = None
    if previous is not None:
        try:
            return _scan(directory, stream, now_s, previous, day_start)
        except _Rewound:
            pass  # a file replaced or the stream rewound: the month is read again from its start
    return _scan(directory, stream, now_s, SpendTotals(now_s, day_start, month_start, source=source), day_start)


def _scan(
    directory: Path, stream: RedisStreamConfig | None, now_s: float, base: SpendTotals, day_start: float
) -> SpendTotals:
    same_day = base.day_start == day_start
    totals = SpendTotals(
        now_s,
        day_start,
        base.month_start,
        {name: [day if same_day else 0.0, month] for name, (day, month) in base.by_tenant.items()},
        base.source,
        base.covers_since,
        dict(base.offsets),
        base.last_id,
        base.seen,  # only this scan's thread touches it; a failed scan discards its owner (TenantSpend)
        OrderedDict((name, replace(run)) for name, run in base.runs.items()),  # readers may hold `base`
    )
    if stream is not None:
        found: dict[str, Any] = {}
        entries = stream_entries(stream, base.month_start, None, found, after=base.last_id, seen=totals.seen)
    else:
        entries = _new_file_entries(directory, base.month_start, totals.offsets)
    by_tenant, day_start = totals.by_tenant, totals.day_start
    for entry in entries:
        if entry.get("kind") not in (None, "request"):  # a program's outcome, not a request
            continue
        tenant = entry.get("tenant")
        cost = entry.get("cost_usd")
        ts = entry.get("ts")
        if not isinstance(tenant, str) or not isinstance(ts, int | float) or ts < totals.month_start:
            continue
        program = entry.get("program")
        if isinstance(program, str):
            _add_run(totals.runs, tenant, program, entry, float(ts))
        if not isinstance(cost, int | float) or not cost:
            continue
        pair = by_tenant.get(tenant)
        if pair is None:
            if len(by_tenant) >= MAX_TENANTS:
                continue
            pair = by_tenant[tenant] = [0.0, 0.0]
        pair[1] += cost
        if ts >= day_start:
            pair[0] += cost
    if stream is not None:
        totals.last_id = found.get("last_id", totals.last_id)
        covers = found.get("covers_since")
        if isinstance(covers, int | float):
            totals.covers_since = float(covers)
    return totals


def _add_run(
    runs: OrderedDict[tuple[str, str], RunTotals], tenant: str, program: str, entry: dict[str, Any], ts: float
) -> None:
    """Count one request record of run `tenant/program` (a record rejected at admission is no call)."""
    if entry.get("status") == "rejected":
        return
    name = (tenant, program)
    run = runs.get(name)
    if run is None:
        run = runs[name] = RunTotals(tenant, program, first_s=ts)
        while len(runs) > MAX_RUNS:
            runs.popitem(last=False)
    run.calls += 1
    for field_name in ("input_tokens", "output_tokens"):
        tokens = entry.get(field_name)
        if isinstance(tokens, int):
            run.tokens += tokens
    cost = entry.get("cost_usd")
    if isinstance(cost, int | float):
        run.usd += cost
    run.first_s = min(run.first_s, ts)
    if ts >= run.last_s:
        run.last_s = ts
        key_id, model = entry.get("key_id"), entry.get("model")
        run.key_id = key_id if isinstance(key_id, str) else run.key_id
        run.model = model if isinstance(model, str) else run.model
    runs.move_to_end(name)


def _new_file_entries(directory: Path, month_start: float, offsets: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The whole records written to this month's ledger files past `offsets` (updated as they are
    read). A last line without its newline is a group still being written unless it is a whole JSON
    object (no proper prefix of one is): it is left for the next scan."""
    if not directory.is_dir():
        return
    present = set()
    for path in files_in_window(directory, month_start):
        name = path.name
        present.add(name)
        start = offsets.get(name, 0)
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # deleted (retention) since it was listed
            continue
        if size < start:
            raise _Rewound(name)
        if size == start:
            continue
        try:
            f = path.open("rb")
        except OSError:  # unreadable: the reader's warning is the report's
            continue
        with f:
            f.seek(start)
            position = start
            for line in bounded_lines(f):
                if isinstance(line, int):  # longer than any record: not one, and never held whole
                    position += line
                    continue
                try:
                    entry = decode(line) if line.strip() else None
                except ValueError:  # torn (still being written) or corrupt: the reader's warning is the report's
                    if not line.endswith(b"\n"):
                        break
                    entry = None
                position += len(line)
                if isinstance(entry, dict):
                    yield entry
            offsets[name] = position
    for name in [n for n in offsets if n not in present]:  # files of past months, or deleted
        del offsets[name]


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
                previous, self._totals = self._totals, None  # a scan that fails leaves no half-read state
                found = await asyncio.to_thread(scan, self.directory, self.stream, self._clock(), previous)
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
        return spend, _about(totals)

    async def runs(self) -> tuple[list[RunTotals], dict[str, Any]]:
        """Every agent run with a record this month (at most `MAX_RUNS`, the latest), and what the
        figures cover, as `of` says it."""
        totals = await self.totals()
        return list(totals.runs.values()), _about(totals)

    async def run(self, tenant: str, program: str) -> tuple[RunTotals | None, dict[str, Any]]:
        """One run's figures (None: no record of it this month, or it was dropped past `MAX_RUNS`)."""
        totals = await self.totals()
        return totals.runs.get((tenant, program)), _about(totals)


def _about(totals: SpendTotals) -> dict[str, Any]:
    about: dict[str, Any] = {"source": "ledger-" + totals.source, "as_of": round(totals.computed_at, 3)}
    if totals.covers_since is not None:
        about["covers_since"] = totals.covers_since
    return about
