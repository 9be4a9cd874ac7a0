"""Flow control's counters shared by several gateway replicas through Redis: the tenants' virtual counters
and the programs' attained service, each a local view changed at once and reconciled with Redis in
batched script calls.

Ordering reads a local view and never waits on Redis; what changed goes out in one script call per group
every few milliseconds (`BatchedFlush`, first below), and each reply brings the other replicas' changes
back. A failed call degrades fairness to per replica; requests never fail on it.

Batched flushes
---------------

Changes batched for Redis: what the tenants' virtual counters and the programs' attained
service (both below) share.

Each keeps a local view per key group that ordering reads at once, and sends what changed as one
script call per group every `flush_s`, at most one flush in flight: a change arms a timer, the timer
starts a flush when something is due, the flush's end re-arms the timer if more is pending. At
close, a last flush sends what is left (bounded by a second). The stores say what is due (`_due`),
what must still go out at close (`_pending`), and how a flush runs (`_flush`).

Tenants' virtual counters
-------------------------

Virtual counters shared by several gateway replicas through Redis.

Each replica orders its own waiting room from a local view of every (pool, band) it serves; the view
is changed at once by the replica's own dispatches and completions, so ordering never waits on
Redis. The changes are not sent one by one: they gather per (pool, band) and tenant for `flush_s`
and then go out as one atomic script call per band (`vtc_batch.lua`), at most one flush in flight
at a time. A tenant's lifts, credits and charges fold into one map v -> max(v + add, floor) (a lift
is a floor, a charge an add, a dispatch's credit both, and such maps compose), so the batch leaves
Redis exactly where the calls one by one would have. The reply carries the band's counters as
Redis holds them and the view is rebuilt from it, so every reply also brings in the other
replicas' charges. While requests wait in a band the view is re-read every `refresh_s` as well, so
an idle replica's changes arrive even when this one dispatches nothing. `age_s` is the time since
the view last heard from Redis: the staleness of the shared part. The other replicas see this
one's changes at most `flush_s` plus one round trip late (plus their own `refresh_s` when they
dispatch nothing).

Why batched: one call per change (a dispatch, its lift, its end-of-request correction) cost two or
three Redis calls per request through redis-py, the largest Redis-specific cost on the request
path after the admission reservation itself. The calls go over the limiter's raw pipe
(`policies/limits/scriptpipe.py`) for the same reason.

Changes that Redis has not acknowledged stay in the view on top of the last reply. A failed call
keeps its changes locally (the other replicas will not see them) and is counted; fairness degrades
to per replica, requests never fail on it. Keys carry the `{prefix}` hash tag, like the limiter's,
so one Redis Cluster slot holds them. Counters expire after a day without changes. Tables are keyed
by configured pools and tenants only, so they are bounded by configuration.

Programs' attained service
--------------------------

Programs' attained service shared by several gateway replicas through Redis (program-fair
queueing, `order.py`), the way `RedisCounters` above shares the tenants' virtual counters.

Each replica orders its own waiting room from a local view, changed at once by its own dispatches
and corrections, so ordering never waits on Redis. Changes gather per tenant for `flush_s` and go
out as one atomic script call per tenant (`program_batch.lua`), at most one flush in flight. A
change is an add (tokens), and adds commute with each other and with the decay (the decay is a
multiplication of the whole value), so a batch leaves Redis where the calls one by one would have,
up to the decay of `flush_s` (a 5 ms flush against a 60 s half-life: 6e-5 of a value).

The reply carries, decayed to Redis's clock now, every program the call changed and every program
with requests waiting in this replica (`watch`): the only values ordering reads. While programs
wait, they are re-read every `refresh_s`, so the other replicas' charges arrive even when this one
dispatches nothing. The view decays a value from the moment it heard it, on its own clock; Redis
decays from its clock: both halve at the same rate, so they differ only by the round trip.

A failed call keeps its changes in this replica's view only (counted; fairness among programs
degrades to per replica, requests never fail on it). Keys carry the `{prefix}` hash tag; a tenant's
programs expire after a day without changes and at most `max_programs` are kept per tenant in Redis
and in each view, least recently changed forgotten first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from backends.tasks import cancel_and_wait
from policies.flow.order import MAX_PROGRAMS_PER_TENANT, decayed
from policies.limits.scriptpipe import ScriptPipe, load_script, script_pipeline, stored_number


class BatchedFlush(ABC):
    """The timer and the one flush in flight of a Redis-shared view (see the module docstring)."""

    client: Any
    pipeline: Any
    flush_s: float
    calls: int  # script calls made (the subclass starts it at 0)

    def _init_flush(self) -> None:
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None

    @abstractmethod
    def _due(self) -> bool:
        """Some group has changes (or reads) to send now."""

    def _pending(self) -> bool:
        """Some group has changes that must still reach Redis (at close)."""
        return self._due()

    @abstractmethod
    async def _flush(self) -> None:
        """One script call per due group (then `_answered`)."""

    @abstractmethod
    def _failed(self, view: Any, exc: BaseException) -> None:
        """A group's call failed: its sent changes stay in this replica's view."""

    @abstractmethod
    def _apply(self, view: Any, reply: Any) -> None:
        """A group's call answered: the values Redis holds now."""

    async def _answered(self, batch: Sequence[tuple[Any, Any]], calls: Sequence[Awaitable[Any]]) -> None:
        """Wait for a flush's calls, one per (key, view) of `batch`, and apply each answer or failure."""
        self.calls += len(calls)
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for (_, view), reply in zip(batch, replies, strict=True):
            if isinstance(reply, BaseException):
                self._failed(view, reply)
            else:
                view.sent = None
                self._apply(view, reply)

    def _idle(self) -> bool:
        """No flush armed or running (the refresh loop starts one of its own only then)."""
        return self._flush_timer is None and self._flushing is None

    def _changed(self) -> None:
        if self._idle():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller in a test): it stays queued
                return
            self._flush_timer = loop.call_later(self.flush_s, self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        if self._flushing is None and self._due():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
            self._flushing.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task[None]) -> None:
        if self._flushing is task:
            self._flushing = None
        if self._flush_timer is None and self._pending():
            self._flush_timer = asyncio.get_running_loop().call_later(self.flush_s, self._start_flush)

    async def close(self) -> None:
        if self._refresher is not None:
            await cancel_and_wait([self._refresher], what="flow counters refresher")
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._flushing is not None:
            await asyncio.wait([self._flushing], timeout=1.0)
        if self._pending():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())  # the last changes
            await asyncio.wait([self._flushing], timeout=1.0)
        if isinstance(self.pipeline, ScriptPipe):
            await self.pipeline.close()
        await self.client.aclose()


log = logging.getLogger("tokenway.flow.counters")

_TTL_MS = 86_400_000
_NO_FLOOR = float("-inf")


def _finite(value: Any) -> float:
    """A counter Redis returned, 0 where it is none (NaN would break every comparison of fair shares)."""
    return stored_number(value) or 0.0


@dataclass(slots=True)
class _Map:
    """v -> max(v + add, floor): every tenant's changes since the batch began."""

    add: float = 0.0
    floor: float = _NO_FLOOR

    def of(self, value: float) -> float:
        value += self.add
        return value if value >= self.floor else self.floor


def _floor_arg(floor: float) -> str:
    return "" if floor == _NO_FLOOR else repr(floor)


@dataclass(slots=True)
class _View:
    snapshot: dict[str, float] = field(default_factory=dict)  # the band as the last reply had it
    last_served: float = 0.0
    sent: dict[str, _Map] | None = None  # in flight, not yet answered
    queued: dict[str, _Map] = field(default_factory=dict)  # not sent yet
    queued_dispatch: tuple[str, float, float] | None = None  # the queued batch's last dispatch
    read: bool = False  # a refresh asked for the band's counters
    local: dict[str, float] = field(default_factory=dict)  # failed to reach Redis: ours alone
    heard_at_s: float = 0.0
    watched: bool = False

    def value(self, tenant: str) -> float:
        value = self.snapshot.get(tenant, 0.0)
        if self.sent is not None:
            sent = self.sent.get(tenant)
            if sent is not None:
                value = sent.of(value)
        queued = self.queued.get(tenant)
        if queued is not None:
            value = queued.of(value)
        return value + self.local.get(tenant, 0.0)

    def due(self) -> bool:
        return bool(self.queued) or self.read


class RedisCounters(BatchedFlush):
    source = "redis"

    def __init__(
        self, client: Redis, *, prefix: str = "tokenway", refresh_s: float = 0.1, flush_s: float = 0.005
    ) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.flush_s = flush_s
        self._tag = "{" + prefix + "}:flow:"
        self._script = load_script("policies.flow", "vtc_batch.lua")
        self.pipeline = script_pipeline(client, (self._script,))  # the limiter's raw pipe, a connection of its own
        self._views: dict[tuple[str, int], _View] = {}
        self._init_flush()
        self.calls = 0
        self.changes = 0
        self.errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "tokenway",
        refresh_s: float = 0.1,
        flush_s: float = 0.005,
        timeout_s: float = 0.2,
    ) -> RedisCounters:
        client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, prefix=prefix, refresh_s=refresh_s, flush_s=flush_s)

    def keys(self, pool: str, band: int) -> tuple[str, str]:
        base = f"{self._tag}{pool}:{band}"
        return base, base + ":last"

    def _view(self, pool: str, band: int) -> _View:
        found = self._views.get((pool, band))
        if found is None:
            found = self._views[(pool, band)] = _View()
        return found

    # --- the Counters contract ------------------------------------------------------------------

    def value(self, pool: str, band: int, tenant: str) -> float:
        found = self._views.get((pool, band))
        return found.value(tenant) if found is not None else 0.0

    def last_served(self, pool: str, band: int) -> float:
        found = self._views.get((pool, band))
        return found.last_served if found is not None else 0.0

    def lift(self, pool: str, band: int, tenant: str, floor: float) -> None:
        view = self._view(pool, band)
        if view.value(tenant) >= floor:
            return
        change = view.queued.get(tenant)
        if change is None:
            change = view.queued[tenant] = _Map()
        if floor > change.floor:
            change.floor = floor
        self._changed()

    def charge(
        self,
        pool: str,
        band: int,
        tenant: str,
        delta: float,
        *,
        dispatch: bool,
        credit: float = 0.0,
        floor: float | None = None,
    ) -> None:
        view = self._view(pool, band)
        change = view.queued.get(tenant)
        if change is None:
            change = view.queued[tenant] = _Map()
        if credit or floor is not None:
            # order.credited as a map: max(max(v, F) + c, F) = max(v + c, F + max(c, 0))
            lifted = _NO_FLOOR if floor is None else floor + max(credit, 0.0)
            change.add += credit
            change.floor = max(change.floor + credit, lifted)
        if dispatch:
            view.last_served = view.value(tenant)
            view.queued_dispatch = (tenant, change.add, change.floor)
        change.add += delta
        if change.floor != _NO_FLOOR:
            change.floor += delta
        self._changed()

    def watch(self, pool: str, band: int, waiting: bool) -> None:
        self._view(pool, band).watched = waiting
        if waiting and self._refresher is None:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to refresh from
                self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    def age_s(self, pool: str, band: int) -> float:
        found = self._views.get((pool, band))
        if found is None or not found.heard_at_s:
            return float("inf")
        return time.monotonic() - found.heard_at_s

    def status(self) -> dict[str, object]:
        return {
            "store": self.source,
            "calls": self.calls,  # script calls: one per band per flush
            "changes": self.changes,  # lifts and charges they carried
            "errors": self.errors,
            # bands with changes Redis has not acknowledged (queued or in flight)
            "pending": sum(1 for view in self._views.values() if view.sent is not None or view.due()),
        }

    # --- Redis ---------------------------------------------------------------------------------

    def _due(self) -> bool:
        return any(view.due() for view in self._views.values())

    def _changed(self) -> None:
        self.changes += 1
        super()._changed()

    async def _flush(self) -> None:
        """Send every band's queued changes (or a read of a watched band), one call per band."""
        batch = [(key, view) for key, view in self._views.items() if view.due()]
        calls = []
        for (pool, band), view in batch:
            view.sent, view.queued = view.queued, {}
            dispatch, view.queued_dispatch, view.read = view.queued_dispatch, None, False
            args = [str(_TTL_MS)]
            if dispatch is None:
                args += ["", "0", ""]
            else:
                args += [dispatch[0], repr(dispatch[1]), _floor_arg(dispatch[2])]
            for tenant, change in view.sent.items():
                args += [tenant, repr(change.add), _floor_arg(change.floor)]
            calls.append(self.pipeline.call(self._script, self.keys(pool, band), args))
        await self._answered(batch, calls)

    def _failed(self, view: _View, exc: BaseException) -> None:
        """Changes Redis never got: they stay in this replica's view only."""
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("flow counters: Redis call failed (%d so far): %s", self.errors, exc)
        sent = view.sent or {}
        before = {tenant: view.value(tenant) for tenant in sent}
        view.sent = None
        for tenant, value in before.items():
            view.local[tenant] = view.local.get(tenant, 0.0) + value - view.value(tenant)

    def _apply(self, view: _View, reply: Any) -> None:
        view.heard_at_s = time.monotonic()
        last, flat = reply
        if view.queued_dispatch is None:  # else a dispatch not sent yet is the band's latest
            view.last_served = _finite(last)
        pairs = zip(flat[::2], flat[1::2], strict=True)
        view.snapshot = {
            (k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)): _finite(v) for k, v in pairs
        }

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            asked = False
            for view in self._views.values():
                if view.watched:
                    view.read = asked = True
            if asked and self._flush_timer is None and self._flushing is None:
                self._start_flush()


programs_log = logging.getLogger("tokenway.flow.programs")


@dataclass(slots=True)
class _Tenant:
    heard: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # value, when (ours)
    sent: dict[str, float] | None = None  # adds in flight, not yet answered
    queued: dict[str, float] = field(default_factory=dict)  # adds not sent yet
    watched: set[str] = field(default_factory=set)  # programs with requests waiting in this replica
    read: bool = False  # a refresh asked for the watched programs
    half_life_s: float = 60.0  # the tenant's, as last given

    def value(self, program: str, now: float) -> float:
        found = self.heard.get(program)
        value = decayed(found[0], now - found[1], self.half_life_s) if found is not None else 0.0
        if self.sent is not None:
            value += self.sent.get(program, 0.0)
        value += self.queued.get(program, 0.0)
        return value if value > 0.0 else 0.0

    def due(self) -> bool:
        return bool(self.queued) or (self.read and bool(self.watched))


class RedisPrograms(BatchedFlush):
    source = "redis"

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "tokenway",
        refresh_s: float = 0.1,
        flush_s: float = 0.005,
        max_programs: int = MAX_PROGRAMS_PER_TENANT,
    ) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.flush_s = flush_s
        self.max_programs = max_programs
        self._tag = "{" + prefix + "}:flow:programs:"
        self._script = load_script("policies.flow", "program_batch.lua")
        self.pipeline = script_pipeline(client, (self._script,))
        self._tenants: dict[str, _Tenant] = {}
        self._init_flush()
        self.calls = 0
        self.errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "tokenway",
        refresh_s: float = 0.1,
        flush_s: float = 0.005,
        timeout_s: float = 0.2,
        max_programs: int = MAX_PROGRAMS_PER_TENANT,
    ) -> RedisPrograms:
        client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, prefix=prefix, refresh_s=refresh_s, flush_s=flush_s, max_programs=max_programs)

    def keys(self, tenant: str) -> tuple[str, str]:
        base = self._tag + tenant
        return base, base + ":at"

    def _tenant(self, tenant: str, half_life_s: float) -> _Tenant:
        found = self._tenants.get(tenant)
        if found is None:
            found = self._tenants[tenant] = _Tenant()
        found.half_life_s = half_life_s
        return found

    # --- the ProgramService contract ---------------------------------------------------------------

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        found = self._tenants.get(tenant)
        if found is None:
            return 0.0
        found.half_life_s = half_life_s
        return found.value(program, time.monotonic())

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        view = self._tenant(tenant, half_life_s)
        view.queued[program] = view.queued.get(program, 0.0) + tokens
        self._changed()

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        found = self._tenants.get(tenant)
        if found is None:
            if not waiting:
                return
            found = self._tenants[tenant] = _Tenant()
        if waiting:
            found.watched.add(program)
            if self._refresher is None:
                with contextlib.suppress(RuntimeError):  # no running loop: nothing to refresh from
                    self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        else:
            found.watched.discard(program)

    def programs(self, tenant: str) -> int:
        found = self._tenants.get(tenant)
        return len(found.heard) if found is not None else 0

    def status(self) -> dict[str, object]:
        return {
            "store": self.source,
            "programs": sum(len(view.heard) for view in self._tenants.values()),
            "calls": self.calls,  # script calls: one per tenant per flush
            "errors": self.errors,
            "pending": sum(1 for view in self._tenants.values() if view.sent is not None or view.queued),
        }

    # --- Redis ---------------------------------------------------------------------------------

    def _due(self) -> bool:
        return any(view.due() for view in self._tenants.values())

    def _pending(self) -> bool:
        return any(view.queued for view in self._tenants.values())

    async def _flush(self) -> None:
        """Send every tenant's queued adds and a read of its watched programs, one call per tenant."""
        batch = [(tenant, view) for tenant, view in self._tenants.items() if view.due()]
        calls = []
        for tenant, view in batch:
            view.sent, view.queued, view.read = view.queued, {}, False
            args = [str(_TTL_MS), repr(view.half_life_s), str(self.max_programs), str(len(view.sent))]
            for program, tokens in view.sent.items():
                args += [program, repr(tokens)]
            args += [program for program in view.watched if program not in view.sent]
            calls.append(self.pipeline.call(self._script, self.keys(tenant), args))
        await self._answered(batch, calls)

    def _failed(self, view: _Tenant, exc: BaseException) -> None:
        """Adds Redis never got: they stay in this replica's view only."""
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            programs_log.warning("flow programs: Redis call failed (%d so far): %s", self.errors, exc)
        sent, view.sent = view.sent or {}, None
        now = time.monotonic()
        for program, tokens in sent.items():
            found = view.heard.pop(program, None)
            value = decayed(found[0], now - found[1], view.half_life_s) if found is not None else 0.0
            self._heard(view, program, max(value + tokens, 0.0), now)

    def _apply(self, view: _Tenant, reply: Any) -> None:
        now = time.monotonic()
        for program, value in zip(reply[::2], reply[1::2], strict=True):
            name = program.decode("utf-8", "replace") if isinstance(program, bytes) else str(program)
            view.heard.pop(name, None)
            self._heard(view, name, _finite(value), now)

    def _heard(self, view: _Tenant, program: str, value: float, now: float) -> None:
        view.heard[program] = (value, now)
        if len(view.heard) > self.max_programs:
            view.heard.popitem(last=False)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            asked = False
            for view in self._tenants.values():
                if view.watched:
                    view.read = asked = True
            if asked and self._flush_timer is None and self._flushing is None:
                self._start_flush()
