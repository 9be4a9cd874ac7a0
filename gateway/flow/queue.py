"""The waiting room: one per pool, the only place a request waits in the gateway; and its vocabulary,
what a request brings to the room (`FlowRequest`) and what it gets back (a grant, `Blocked`,
`QueueRejected`), kept with the room that defines them.

The waiting room
----------------

A request asks `hold(pool, request, ready)`. `ready()` is the caller's gate: it returns a value (the
route to dispatch on, say) when the request may go now, or a `Blocked` saying why not. With nobody
waiting in the pool and `ready()` answering a value, the request goes at once (work-conserving: the
room costs one call then). Otherwise it waits, and each time capacity may have freed on the pool
(`notify`: a request ended, a first token, a replica became ready) the room offers the turn in flow
order (`policies.flow.order`: band, then virtual counter, then, for a tenant with program fairness,
its program's attained service (`policies/flow/order.py`), then arrival or predicted cost): the first
request whose `ready()` answers a value is dispatched; `Blocked.POOL` stops the round (the pool is
full for everyone), `Blocked.REQUEST` passes the turn to the next in order (a few per round),
`Blocked.TENANT` to the next tenant's (the slot reserve holds this one's back), `Blocked.PROGRAM` to
the next program's (the program slot reserve holds this program's back), and an exception
(the gate's "not here, instead") takes that request out with it. The
head of the room also rechecks every `recheck_s`, since load that is scraped and predictions move
with time too.

One grant at a time: a granted request dispatches when its task next runs, so the next round waits
until then (`call_soon` after it resumes), when its load is visible to the next `ready()`.

Bounds: a request leaves at its deadline (`QueueRejected` queue_timeout), when its client goes away
(the task is cancelled: it leaves at once, nothing stays held), or when a higher band needs its place
(queue_shed); a request that finds no room is refused (queue_full). Every exit carries a retry-after
from the room's drain rate.

`ready()` is the gate's (`gateway/flow/gate.py`): it asks every check (saturation and the slot
reserve, the SLO, batch spare capacity, a cold start) and routes again where one says so, so a
request for a pool at zero waits here too, until a replica is ready (`notify(pool)` when it is).

Flow control's vocabulary: what a request brings to the waiting room, what it gets back
---------------------------------------------------------------------------------------

`FlowRequest` is a request as the room sees it, `Blocked` why a waiting request cannot go now, and
`QueueRejected` how it leaves the room unserved (queue_full, queue_timeout, queue_shed).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Generic, TypeVar

from gateway.flow.activity import Activity, ProgramActivity
from policies.flow import order
from policies.flow.order import (
    BANDS,
    NO_PROGRAM,
    Counters,
    MemoryPrograms,
    ProgramService,
    ServiceWindow,
    band_name,
    fair_share_ratios,
)
from policies.flow.room import (
    REASON_QUEUE_FULL,
    REASON_QUEUE_TIMEOUT,
    REASON_SHED,
    DrainRate,
    Held,
    retry_after_s,
    shed_for,
)

T = TypeVar("T")

__all__ = ["REASON_QUEUE_FULL", "REASON_QUEUE_TIMEOUT", "REASON_SHED", "Blocked", "FlowRequest", "QueueRejected"]


class Blocked(Enum):
    """Why a waiting request cannot go now (what a `Ready` callable answers instead of a value)."""

    POOL = "pool"  # the pool is saturated: nobody waiting there can go
    REQUEST = "request"  # this request cannot (its SLO, say); the next one may
    TENANT = "tenant"  # no request of this tenant can (the slot reserve); another tenant's may
    PROGRAM = "program"  # no request of this program can (the program slot reserve); another program's may


Ready = Callable[[], "T | Blocked"]


@dataclass(slots=True)
class FlowRequest:
    """A request as the waiting room sees it.

    `cost_tokens`: uncached prompt + predicted output tokens (what its tenant's counter is charged);
    `deadline_s`: `time.monotonic()` past which it stops waiting; `tag`: a group whose waiting
    requests can be counted (`FlowQueue.waiting_with`), e.g. its SLO class; `resumed`: a stream
    flow control cut to free its slot, waiting to continue (it was admitted before any of its
    tenant's that wait, so it goes first of them); `batch`: a batch line (not counted among the
    interactive requests waiting, `FlowQueue.interactive_depth`); `program`: the agent program it
    belongs to (gateway/request/intake.py; None: it names none), what program-fair queueing orders
    a tenant's requests by. Not frozen: one is built per request (a frozen one pays a
    `object.__setattr__` per field), and only the gate that built it sets its deadline, before it
    enters the room; treat it as read-only after."""

    request_id: str
    tenant: str
    band: int
    cost_tokens: float
    weight: float
    deadline_s: float
    body_bytes: int = 0
    tag: str = ""
    resumed: bool = False  # a preempted stream waiting again: first of its tenant's, as the earliest arrival
    batch: bool = False
    program: str | None = None


class QueueRejected(Exception):
    """The request leaves the waiting room without being dispatched.

    `reason`: queue_full | queue_timeout | queue_shed; `blocked`: what held it last (None when it was
    never tried); `retry_after_s`: from the room's recent drain rate."""

    def __init__(self, reason: str, *, waited_s: float, retry_after_s: int, blocked: Blocked | None) -> None:
        super().__init__(f"{reason} after {waited_s * 1000:.0f} ms")
        self.reason = reason
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s
        self.blocked = blocked


_TRIES_PER_ROUND: Final = 4  # requests offered the turn per round before waiting for the next event
_GRANT_TIMEOUT_S: Final = 1.0  # a grant whose task never resumed stops blocking the room after this
_CREDITS_KEPT: Final = 4096  # held-back refunds, one per (pool, band, tenant); beyond it they land at once

WaitObserver = Callable[[str, int, str, float], None]  # (pool, band, tenant, seconds waited)


@dataclass(slots=True, eq=False)
class _Entry(Generic[T]):
    seq: int
    request: FlowRequest
    ready: Ready[T]
    future: asyncio.Future[T]
    enqueued_s: float
    blocked: Blocked | None = None
    floor: float | None = None  # the band's floor it was lifted to on arrival (None: its tenant was waiting)
    watched: bool = False  # counted in its room's `programs` (its tenant had program fairness on arrival)

    @property
    def band(self) -> int:
        return self.request.band

    @property
    def cost_tokens(self) -> float:
        return self.request.cost_tokens


@dataclass(slots=True, eq=False)
class _Room:
    pool: str
    bands: dict[int, dict[str, list[_Entry[Any]]]] = field(default_factory=dict)
    entries: dict[int, _Entry[Any]] = field(default_factory=dict)
    body_bytes: int = 0
    granted: _Entry[Any] | None = None
    granted_s: float = 0.0
    recheck: asyncio.TimerHandle | None = None
    programs: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, program) -> waiting here
    drain: DrainRate = field(default_factory=DrainRate)
    tags: dict[str, int] = field(default_factory=dict)
    batch: int = 0  # batch lines among `entries`
    dispatched: int = 0
    waited: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    preempted: int = 0  # streams cut to free a slot for a request under its share (`Saturation`)


@dataclass(slots=True)
class Lease:
    """A dispatched request's fairness account: `finished` corrects its tenant's counter with the real
    cost (once) and tells the room capacity may have freed. An overrun is charged at once; a refund is
    held back until the tenant's next dispatch (`FlowQueue.hold_credit`): it ends as a slot frees.
    With program fairness (`half_life_s` set), its program's attained service is corrected too."""

    queue: FlowQueue
    pool: str
    band: int
    tenant: str
    weight: float
    cost_tokens: float
    queued_s: float  # time it waited in the room (0: it went at once)
    program: str = NO_PROGRAM
    half_life_s: float | None = None  # its tenant's program fairness (None: off)
    _done: bool = False

    def finished(self, actual_cost_tokens: float | None) -> None:
        """The request ended; `actual_cost_tokens` None when unknown (the prediction stands)."""
        if self._done:
            return
        self._done = True
        self.queue.activity.inflight(self.pool, self.tenant, self.band, self.weight, -1)
        if actual_cost_tokens is not None:
            delta = order.correction(self.cost_tokens, actual_cost_tokens, self.weight)
            if delta > 0:
                self.queue.counters.charge(self.pool, self.band, self.tenant, delta, dispatch=False)
            elif delta < 0:
                self.queue.hold_credit(self.pool, self.band, self.tenant, delta)
            if delta:
                self.queue.share(self.pool).add(self.tenant, delta * self.weight, self.queue.now())
            if self.half_life_s is not None:
                tokens = max(actual_cost_tokens, 0.0) - max(self.cost_tokens, 0.0)
                if tokens:
                    self.queue.programs.charge(self.tenant, self.program, tokens, self.half_life_s)
        if self.half_life_s is not None:
            self.queue.program_activity.inflight(self.pool, self.tenant, self.program, -1)
        self.queue.notify(self.pool)


class FlowQueue:
    def __init__(
        self,
        counters: Counters,
        *,
        room_size: Callable[[str], tuple[int, int]] = lambda pool: (1024, 64 * 1024 * 1024),
        shortest_job_first: Callable[[], bool] = lambda: False,
        fair: Callable[[], bool] = lambda: True,
        weights: Callable[[str], float] = lambda tenant: 1.0,
        recheck_s: float = 0.05,
        share_window_s: float = 60.0,
        active_s: float = 60.0,
        on_wait: WaitObserver | None = None,
        now: Callable[[], float] = time.monotonic,
        programs: ProgramService | None = None,
        program_half_life: Callable[[str], float | None] = lambda tenant: None,
        program_active_s: float = 10.0,
    ) -> None:
        self.counters = counters
        self.room_size = room_size
        self.shortest_job_first = shortest_job_first
        self.fair = fair
        self.weights = weights
        self.recheck_s = recheck_s
        self.share_window_s = share_window_s
        self.on_wait = on_wait
        self.now = now
        self.programs: ProgramService = programs if programs is not None else MemoryPrograms(now=now)
        self.program_half_life = program_half_life  # tenant -> its program fairness's half-life, or None
        self.activity = Activity(active_s, now=now)
        # the programs of tenants with program fairness, per pool: what the program reserve reads
        self.program_activity = ProgramActivity(program_active_s, now=now)
        self._rooms: dict[str, _Room] = {}
        self._shares: dict[str, ServiceWindow] = {}
        self._credits: dict[tuple[str, int, str], float] = {}  # refunds waiting for the tenant's next dispatch
        self._seq = itertools.count(1)

    # --- entry ------------------------------------------------------------------------------------

    async def hold(self, pool: str, request: FlowRequest, ready: Ready[T]) -> tuple[T, Lease]:
        """Wait until `ready()` answers a value in flow order; (that value, the dispatch's lease).
        Raises `QueueRejected` (full, timed out, shed); a cancelled caller leaves at once."""
        found = self.hold_now(pool, request, ready)
        if found is None or isinstance(found, Blocked):
            return await self.hold_waiting(pool, request, ready, found)
        return found

    def hold_now(self, pool: str, request: FlowRequest, ready: Ready[T]) -> tuple[T, Lease] | Blocked | None:
        """`hold`'s first step, without a coroutine (the common case of a request that goes at once
        costs one call): with nobody waiting in the pool, `ready()` is asked once; (its value, the
        lease) when it goes, its `Blocked` when not; None when others wait (it waits its turn). Any
        answer but the first goes on with `hold_waiting`."""
        room = self._rooms.get(pool)
        if room is None:
            room = self._room(pool)
        if room.entries or room.granted is not None:
            return None
        verdict = ready()
        if isinstance(verdict, Blocked):
            return verdict
        self._observe_wait(pool, request, 0.0)
        floor = self.counters.last_served(pool, request.band)  # nothing of its tenant waits
        return verdict, self._dispatch(room, request, queued_s=0.0, floor=floor)

    async def hold_waiting(
        self, pool: str, request: FlowRequest, ready: Ready[T], blocked: Blocked | None
    ) -> tuple[T, Lease]:
        """The rest of `hold` after `hold_now` did not let the request go: it waits in the room
        (`blocked`: what `ready()` answered on arrival, None when it was not asked)."""
        room = self._room(pool)
        now = self.now()
        entry = self._enter(room, request, ready, now, blocked)
        try:
            async with asyncio.timeout(max(request.deadline_s - now, 0.0)):
                value = await entry.future
        except TimeoutError:
            future = entry.future
            if not (future.done() and not future.cancelled()):
                self._leave(room, entry)
                raise self._rejection(room, entry, REASON_QUEUE_TIMEOUT) from None
            if future.exception() is not None:  # shed as the deadline struck
                raise future.exception() from None  # type: ignore[misc]
            value = future.result()  # granted as the deadline struck: it goes
        except asyncio.CancelledError:
            if room.granted is entry:
                self._ungrant(room)
            else:
                self._leave(room, entry)
            raise
        waited_s = self.now() - entry.enqueued_s
        asyncio.get_running_loop().call_soon(self._resumed, room, entry)
        self._observe_wait(pool, request, waited_s)
        return value, self._dispatch(room, request, queued_s=waited_s, floor=entry.floor)

    def notify(self, pool: str) -> None:
        """Capacity may have freed on `pool` (a request ended, a first token, a replica is ready)."""
        room = self._rooms.get(pool)
        if room is not None and room.entries:
            self._round(room)

    def count_preemption(self, pool: str) -> None:
        """A stream of `pool` was cut so that a waiting request could start (`/admin/status`)."""
        self._room(pool).preempted += 1

    def waiting_with(self, pool: str, tag: str) -> int:
        """Requests of `tag` waiting in `pool` now."""
        room = self._rooms.get(pool)
        return room.tags.get(tag, 0) if room is not None else 0

    def interactive_depth(self, pool: str) -> int:
        """Requests other than batch lines waiting in `pool` now (what batch work yields to)."""
        room = self._rooms.get(pool)
        return len(room.entries) - room.batch if room is not None else 0

    def depth(self, pool: str, band: int | None = None) -> int:
        room = self._rooms.get(pool)
        if room is None:
            return 0
        if band is None:
            return len(room.entries)
        return sum(len(v) for v in room.bands.get(band, {}).values())

    def hold_credit(self, pool: str, band: int, tenant: str, credit: float) -> None:
        """Keep a refund (≤ 0, ÷ weight) for the tenant's next dispatch in (pool, band). Tenants come
        from configuration; the bound only keeps a misconfiguration from growing the table."""
        key = (pool, band, tenant)
        if key not in self._credits and len(self._credits) >= _CREDITS_KEPT:
            self.counters.charge(pool, band, tenant, credit, dispatch=False)
            return
        self._credits[key] = self._credits.get(key, 0.0) + credit

    def held_credit(self, pool: str, band: int, tenant: str) -> float:
        return self._credits.get((pool, band, tenant), 0.0)

    def share(self, pool: str) -> ServiceWindow:
        found = self._shares.get(pool)
        if found is None:
            found = self._shares[pool] = ServiceWindow(self.share_window_s)
        return found

    def fair_share_ratios(self, pool: str, among: Collection[str] | None = None) -> dict[str, float]:
        """Each tenant's recent service over its weighted share; `among`: only these tenants (one
        band's), each counted even with nothing served."""
        service = self.share(pool).totals(self.now())
        if among is not None:
            service = {t: service.get(t, 0.0) for t in among}
        return fair_share_ratios(service, {t: self.weights(t) for t in service})

    # --- waiting ------------------------------------------------------------------------------------

    def _room(self, pool: str) -> _Room:
        found = self._rooms.get(pool)
        if found is None:
            found = self._rooms[pool] = _Room(pool)
        return found

    def _counter(self, pool: str) -> Callable[[int, str], float]:
        counters = self.counters
        return lambda band, tenant: counters.value(pool, band, tenant)

    def _enter(
        self, room: _Room, request: FlowRequest, ready: Ready[T], now: float, blocked: Blocked | None
    ) -> _Entry[T]:
        if request.deadline_s <= now:
            self._count_rejection(room, REASON_QUEUE_TIMEOUT)
            self._observe_wait(room.pool, request, 0.0)
            retry_s = self._retry_after(room, request, 1.0)
            raise QueueRejected(REASON_QUEUE_TIMEOUT, waited_s=0.0, retry_after_s=retry_s, blocked=blocked)
        max_queued, max_bytes = self.room_size(room.pool)
        held = [Held(e.seq, e.request.band, e.request.tenant, e.request.body_bytes) for e in room.entries.values()]
        shed = shed_for(
            held,
            self._counter(room.pool),
            band=request.band,
            body_bytes=request.body_bytes,
            max_queued=max_queued,
            max_queued_bytes=max_bytes,
        )
        if shed is None:
            self._count_rejection(room, REASON_QUEUE_FULL)
            self._observe_wait(room.pool, request, 0.0)
            raise QueueRejected(
                REASON_QUEUE_FULL, waited_s=0.0, retry_after_s=self._retry_after(room, request, 1.0), blocked=None
            )
        for seq in shed:
            victim = room.entries[seq]
            self._leave(room, victim)
            if not victim.future.done():
                victim.future.set_exception(self._rejection(room, victim, REASON_SHED))
        tenants = room.bands.setdefault(request.band, {})
        own = tenants.get(request.tenant)
        floor: float | None = None
        if not own:  # returning after idling in this band: no banked credit
            floor = order.band_floor(
                {t: self.counters.value(room.pool, request.band, t) for t, w in tenants.items() if w},
                (t for t, w in tenants.items() if w),
                self.counters.last_served(room.pool, request.band),
            )
            self.counters.lift(room.pool, request.band, request.tenant, floor)
            own = tenants[request.tenant] = []
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        # a resumed stream was admitted before anything waiting: first of its tenant's, earliest in ties
        seq = -next(self._seq) if request.resumed else next(self._seq)
        entry: _Entry[T] = _Entry(seq, request, ready, future, now, blocked, floor)
        others = bool(room.entries)
        if request.resumed:
            own.insert(0, entry)
        else:
            own.append(entry)
        room.entries[entry.seq] = entry
        room.body_bytes += request.body_bytes
        if request.tag:
            room.tags[request.tag] = room.tags.get(request.tag, 0) + 1
        room.batch += request.batch
        room.waited += 1
        if self.program_half_life(request.tenant) is not None:
            entry.watched = True
            self._watch(room, request, 1)
        self.activity.waiting(room.pool, request.tenant, request.band, request.weight, 1)
        self.counters.watch(room.pool, request.band, True)
        if others:
            self._round(room)  # it may go before those already waiting
        else:
            self._arm_recheck(room)  # alone, and `ready()` just said no
        return entry

    def _leave(self, room: _Room, entry: _Entry[Any]) -> None:
        """Take `entry` out of the room (idempotent); the turn passes on if it was the head."""
        if room.entries.pop(entry.seq, None) is None:
            return
        request = entry.request
        room.body_bytes -= request.body_bytes
        room.batch -= request.batch
        if entry.watched:
            self._watch(room, request, -1)
        if request.tag:
            left = room.tags.get(request.tag, 0) - 1
            if left > 0:
                room.tags[request.tag] = left
            else:
                room.tags.pop(request.tag, None)
        tenants = room.bands.get(request.band, {})
        own = tenants.get(request.tenant)
        if own is not None:
            own.remove(entry)
            if not own:
                del tenants[request.tenant]
        self.activity.waiting(room.pool, request.tenant, request.band, request.weight, -1)
        if not tenants:
            room.bands.pop(request.band, None)
            self.counters.watch(room.pool, request.band, False)
        if not room.entries and room.recheck is not None:
            room.recheck.cancel()
            room.recheck = None
        if room.entries and room.granted is None:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._round, room)

    def _round(self, room: _Room) -> None:
        """Offer the turn in flow order until one goes, the pool is full, or the round's tries are spent."""
        if room.granted is not None:
            if self.now() - room.granted_s < _GRANT_TIMEOUT_S:
                return
            room.granted = None  # its task never resumed (a stuck loop?): stop waiting on it
        counter = self._counter(room.pool)
        sjf, fair = self.shortest_job_first(), self.fair()
        skip: set[int] = set()
        skip_tenants: set[str] = set()
        programs = self._ranks()
        for _ in range(_TRIES_PER_ROUND):
            entry = order.pick(
                room.bands.items(),
                counter,
                sjf=sjf,
                skip=skip,
                fair=fair,
                skip_tenants=skip_tenants,
                programs=programs,
            )
            if entry is None:
                break
            if entry.future.done():  # cancelled (its client left, its deadline struck) before its task ran
                self._leave(room, entry)
                continue
            try:
                verdict = entry.ready()
            except Exception as exc:  # the gate's own "no, instead" (a detour): it leaves with it
                self._leave(room, entry)
                if not entry.future.done():
                    entry.future.set_exception(exc)
                continue
            if isinstance(verdict, Blocked):
                entry.blocked = verdict
                if verdict is Blocked.POOL:
                    break
                if verdict is Blocked.TENANT:
                    skip_tenants.add(entry.request.tenant)
                    continue
                if verdict is Blocked.PROGRAM:
                    skip.update(self._program_entries(room, entry))
                    continue
                skip.add(entry.seq)
                continue
            self._leave(room, entry)
            room.granted, room.granted_s = entry, self.now()
            room.drain.record(room.granted_s)
            entry.future.set_result(verdict)
            return
        self._arm_recheck(room)

    @staticmethod
    def _program_entries(room: _Room, entry: _Entry[Any]) -> list[int]:
        """The waiting requests of `entry`'s program (its tenant's, in its band): none of them can go
        now (the program slot reserve holds it back); another program's may."""
        request = entry.request
        program = request.program or NO_PROGRAM
        own = room.bands.get(request.band, {}).get(request.tenant, ())
        return [e.seq for e in own if (e.request.program or NO_PROGRAM) == program] or [entry.seq]

    def _ranks(self) -> Callable[[str], Callable[[_Entry[Any]], float] | None]:
        """Per tenant, how one round ranks its waiting requests: their program's attained service
        (read once per program in the round), or None where the tenant has no program fairness."""
        found: dict[str, Callable[[_Entry[Any]], float] | None] = {}
        store = self.programs

        def ranks(tenant: str) -> Callable[[_Entry[Any]], float] | None:
            if tenant in found:
                return found[tenant]
            half_life_s = self.program_half_life(tenant)
            rank: Callable[[_Entry[Any]], float] | None = None
            if half_life_s is not None:
                seen: dict[str, float] = {}

                def rank(entry: _Entry[Any]) -> float:
                    program = entry.request.program or NO_PROGRAM
                    value = seen.get(program)
                    if value is None:
                        value = seen[program] = store.value(tenant, program, half_life_s)
                    return value

            found[tenant] = rank
            return rank

        return ranks

    def _watch(self, room: _Room, request: FlowRequest, delta: int) -> None:
        """Count the requests of a program waiting in the room; a shared store is told when the first
        arrives and the last leaves."""
        key = (request.tenant, request.program or NO_PROGRAM)
        self.program_activity.waiting(room.pool, key[0], key[1], delta)
        count = room.programs.get(key, 0) + delta
        if count > 0:
            room.programs[key] = count
            if count == 1 and delta > 0:
                self.programs.watch(key[0], key[1], True)
        else:
            room.programs.pop(key, None)
            self.programs.watch(key[0], key[1], False)

    def _arm_recheck(self, room: _Room) -> None:
        if room.recheck is None and room.entries:
            loop = asyncio.get_running_loop()
            room.recheck = loop.call_later(self.recheck_s, self._recheck, room)

    def _recheck(self, room: _Room) -> None:
        room.recheck = None
        if room.entries:
            self._round(room)

    def _resumed(self, room: _Room, entry: _Entry[Any]) -> None:
        """A granted request's task ran (it dispatched): the next round may begin."""
        if room.granted is entry:
            room.granted = None
        if room.entries:
            self._round(room)

    def _ungrant(self, room: _Room) -> None:
        """A granted request was cancelled before it ran: its turn goes to the next one."""
        room.granted = None
        if room.entries:
            asyncio.get_running_loop().call_soon(self._round, room)

    # --- dispatch and exits ---------------------------------------------------------------------------

    def _dispatch(self, room: _Room, request: FlowRequest, *, queued_s: float, floor: float | None) -> Lease:
        """Charge the dispatch to its tenant's counter, less the refunds held back since the tenant's
        last dispatch. A tenant coming back (`floor`: nothing of it was waiting when this request
        came) is lifted to the band's floor, and its refunds never take it below that floor."""
        pool, band, tenant = room.pool, request.band, request.tenant
        credit = self._credits.pop((pool, band, tenant), 0.0) if self._credits else 0.0
        cost = order.charge(request.cost_tokens, request.weight)
        self.counters.charge(pool, band, tenant, cost, dispatch=True, credit=credit, floor=floor)
        share = self._shares.get(pool)
        if share is None:
            share = self.share(pool)
        share.add(tenant, request.cost_tokens, self.now())
        program = request.program or NO_PROGRAM
        half_life_s = self.program_half_life(tenant)
        if half_life_s is not None:
            self.programs.charge(tenant, program, max(request.cost_tokens, 0.0), half_life_s)
            self.program_activity.inflight(pool, tenant, program, 1)
        room.dispatched += 1
        self.activity.inflight(pool, tenant, band, request.weight, 1)
        return Lease(self, pool, band, tenant, request.weight, request.cost_tokens, queued_s, program, half_life_s)

    def _rejection(self, room: _Room, entry: _Entry[Any], reason: str) -> QueueRejected:
        waited_s = self.now() - entry.enqueued_s
        self._count_rejection(room, reason)
        self._observe_wait(room.pool, entry.request, waited_s)
        return QueueRejected(
            reason,
            waited_s=waited_s,
            retry_after_s=self._retry_after(room, entry.request, max(waited_s, 1.0)),
            blocked=entry.blocked,
        )

    def predicted_wait_s(self, pool: str, band: int, *, held: bool) -> float | None:
        """How long a request of `band` should still wait in `pool`'s room: the requests waiting at its
        band or a better one (itself included once it waits), at least one when `held` (a check told it
        to wait), divided by the room's drain rate. 0.0 when nobody is ahead and it is not held (it
        goes now); None when nothing left the room lately (no rate to go by)."""
        room = self._rooms.get(pool)
        ahead = (
            0
            if room is None
            else sum(len(es) for b, tenants in room.bands.items() if b <= band for es in tenants.values())
        )
        if ahead == 0 and not held:
            return 0.0
        rate = room.drain.per_s(self.now()) if room is not None else 0.0
        return max(ahead, 1) / rate if rate > 1e-9 else None

    def _retry_after(self, room: _Room, request: FlowRequest, unknown_s: float) -> int:
        ahead = sum(len(es) for band, tenants in room.bands.items() if band <= request.band for es in tenants.values())
        return retry_after_s(ahead, room.drain.per_s(self.now()), unknown_s=unknown_s)

    def _count_rejection(self, room: _Room, reason: str) -> None:
        room.rejected[reason] = room.rejected.get(reason, 0) + 1

    def _observe_wait(self, pool: str, request: FlowRequest, seconds: float) -> None:
        if self.on_wait is not None:
            self.on_wait(pool, request.band, request.tenant, seconds)

    # --- status -------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Per pool: who waits (per band and tenant), the oldest wait, drain rate, the counters."""
        now = self.now()
        pools: dict[str, Any] = {}
        for pool, room in self._rooms.items():
            bands: dict[str, Any] = {}
            for band in range(len(BANDS)):
                tenants = room.bands.get(band, {})
                bands[band_name(band)] = {
                    "waiting": {t: len(es) for t, es in tenants.items()},
                    "counters_age_s": _finite(self.counters.age_s(pool, band)),
                }
            oldest = min((e.enqueued_s for e in room.entries.values()), default=None)
            pools[pool] = {
                "waiting": len(room.entries),
                "waiting_bytes": room.body_bytes,
                "oldest_wait_ms": round((now - oldest) * 1000.0, 1) if oldest is not None else None,
                "drain_per_s": round(room.drain.per_s(now), 3),
                "dispatched": room.dispatched,
                "waited": room.waited,
                "rejected": dict(room.rejected),
                "preempted": room.preempted,
                "bands": bands,
                "fair_share_ratio": {t: round(r, 4) for t, r in self.fair_share_ratios(pool).items()},
            }
        return {
            "counters": self.counters.status(),
            "programs": self.programs.status(),
            "programs_active": self.program_activity.status(),
            "pools": pools,
        }


def _finite(value: float) -> float | None:
    return None if value == float("inf") else round(value, 4)
