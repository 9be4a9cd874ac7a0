"""Who is active in each pool, as the slot reserves read it: per tenant (the slot reserve) and, for a
tenant with program fairness, per agent program (the program slot reserve); with several replicas
the others' too. One module because both are the same bookkeeping at two grains, fed by the same
room events and shared over the same replicas bus.

Tenants: who is active in each pool
-----------------------------------

Requests waiting and in flight per tenant, their recent peak, and when each was last seen; with
several replicas, the others' too.

The slot reserve (`policies.flow.saturation`) reads it: a tenant stays active `active_s` after its last
request left, so a light tenant between two requests keeps its claim on the reserve, and its `peak`
(most requests in flight and waiting at once over the last `active_s`, in `_PEAK_BUCKETS` buckets)
sizes a reserve that follows demand. Bounded: idle tenants are dropped once their `active_s` has
passed, and at most `max_tenants` are kept per pool (the longest idle go first).

Several replicas: each replica's record holds only the requests it saw, so alone it would judge the
reserve on part of the picture (a light tenant's requests spread over two replicas look half as
many on each). The replicas bus (`gateway.replicas`) publishes `report()` with its load report and
hands every peer's rows to `set_remote`; `active()` adds them to the local counts (the peers' peaks
are summed: at least the tenant's fleet-wide peak). A peer's rows are as old as its last batch
(its publish interval after a change) and go when the peer expires (`drop_remote`).

Claims: a slot preemption cut for a tenant's request is kept for that tenant until one of its
requests takes it or `claim_s` passes (`claim`, `take_claim`); `claimed_by_other` tells every
replica's flow control to pass over other tenants meanwhile, so a flood's requests on another replica
do not take the slot either. A peer's claims travel in its rows and lapse with its next report.

Programs: which programs of a tenant are active in a pool, as counts the program slot reserve reads in O(1)
-----------------------------------------------------------------------------------------------------------

The program reserve (`policies/flow/saturation.py`) asks, for one request: how many requests
does its program hold in flight in the pool, how many does its tenant, how many of the tenant's
programs are active there, and how many of them are light (nothing waiting). A walk over the
tenant's programs per request would cost as much as the tenant has programs; here each change
(a dispatch, an end, a request entering or leaving the room) updates the per-tenant totals, and a
question reads them.

A program is active while it has requests in flight or waiting, and `active_s` after its last one
(an agent between two turns runs a tool: it comes back). Only tenants with program fairness are
counted (the room and the lease say so). Expiry is lazy: programs sit in least-recently-changed
order, and each read forgets a few idle ones past `active_s` from the front; a busy one found there
goes to the back (it is active whatever its age), so a read does bounded work.

Bounded: at most `max_groups` (pool, tenant) groups, and `max_programs` programs per group; a
program forgotten to make room takes its counts with it (its later end is ignored: counts never go
below zero).

Several replicas: each gateway counts the requests it dispatched and the ones waiting in its own
room; alone it would judge a program whose calls are spread over replicas on its part of it, and see
the other replicas' calls only as the endpoints' load, a report late. The replicas bus
(`gateway.replicas`) publishes `report()` (each active program's requests in flight and waiting)
with its load report and hands every peer's rows to `set_remote`, the way the tenants' activity
(above) is shared: batched, in the background, nothing per request touches Redis. A peer's rows
replace its previous ones, are merged per (pool, tenant) when they arrive, and go when the peer
expires (`drop_remote`); `standing` adds the merged counts to the local ones: a program is active if
it is on any replica, waiting if it waits on any. The overlap of the local and the remote programs
is kept as counts updated on each change, so a read stays O(1). Bounded: at most `_MAX_PROGRAM_PEERS`
peers and `_MAX_REPORT_ROWS` rows of each.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from gateway.replicas.wire import ProgramLoad
from gateway.replicas.wire import TenantLoad as TenantRow
from policies.flow.saturation import Active, Standing

_MAX_TENANTS: Final = 4096
_MAX_PEERS: Final = 1024
_PEAK_BUCKETS: Final = 12  # the peak window in this many buckets: O(12) memory and reading per tenant


@dataclass(slots=True)
class _Seen:
    band: int
    weight: float
    waiting: int = 0
    inflight: int = 0
    last_s: float = 0.0
    peaks: deque[list[float]] = field(default_factory=deque)  # [bucket start, most in flight + waiting]
    claimed: int = 0  # slots cut for this tenant not yet taken
    claim_until: float = 0.0

    def record(self, now_s: float, bucket_s: float) -> None:
        demand = float(self.inflight + self.waiting)
        start = now_s - now_s % bucket_s
        peaks = self.peaks
        last = peaks[-1] if peaks else None
        if last is not None and last[0] == start:
            if demand > last[1]:
                last[1] = demand
        else:
            peaks.append([start, demand])
            while len(peaks) > _PEAK_BUCKETS + 1:
                peaks.popleft()

    def peak(self, now_s: float, window_s: float) -> int:
        oldest = now_s - window_s
        most = self.inflight + self.waiting
        for start, demand in self.peaks:
            if start >= oldest - window_s / _PEAK_BUCKETS and demand > most:
                most = int(demand)
        return most


@dataclass(slots=True)
class Activity:
    active_s: float = 60.0
    max_tenants: int = _MAX_TENANTS
    claim_s: float = 1.0  # a cut slot is kept for its tenant this long (the engine frees it late)
    now: Callable[[], float] = field(default=time.monotonic)
    _pools: dict[str, dict[str, _Seen]] = field(default_factory=dict)
    _remote: dict[str, dict[str, dict[str, Active]]] = field(default_factory=dict)  # replica -> pool -> tenant
    # the last `report()` and (changes counted, when built): the bus asks every publish interval, and
    # between two changes only a peak bucket's turn or an expiry moves it, one bucket apart at most
    _changes: int = 0
    _claims: int = 0  # local claims held, so that a pool without any is passed at no cost
    _claiming_peers: set[str] = field(default_factory=set)  # peers whose last report holds a claim
    _report: tuple[list[TenantRow], int, float] | None = None

    def waiting(self, pool: str, tenant: str, band: int, weight: float, delta: int) -> None:
        seen = self._seen(pool, tenant, band, weight)
        count = seen.waiting + delta
        seen.waiting = count if count > 0 else 0
        seen.record(seen.last_s, self.active_s / _PEAK_BUCKETS)

    def inflight(self, pool: str, tenant: str, band: int, weight: float, delta: int) -> None:
        seen = self._seen(pool, tenant, band, weight)
        count = seen.inflight + delta
        seen.inflight = count if count > 0 else 0
        seen.record(seen.last_s, self.active_s / _PEAK_BUCKETS)

    def claim(self, pool: str, tenant: str, band: int, weight: float) -> None:
        """A slot was cut for a request of `tenant`: keep it for that tenant (`claim_s` at most)."""
        seen = self._seen(pool, tenant, band, weight)
        seen.claimed += 1
        self._claims += 1
        seen.claim_until = self.now() + self.claim_s

    def take_claim(self, pool: str, tenant: str) -> None:
        """A request of `tenant` dispatched: a slot cut for it, if any, is taken."""
        if not self._claims:  # no local claim held (the common case): nothing to look up
            return
        seen = self._pools.get(pool, {}).get(tenant)
        if seen is not None and seen.claimed:
            seen.claimed -= 1
            self._claims -= 1
            self._changes += 1

    def claimed_by_other(self, pool: str, tenant: str) -> bool:
        """Whether a slot cut for another tenant's request, on any replica, is still kept for it."""
        if not self._claims and not self._claiming_peers:
            return False
        now = self.now()
        for other, seen in self._pools.get(pool, {}).items():
            if seen.claimed and self._lapse(seen, now) and other != tenant:
                return True
        for pools in self._remote.values():
            for other, theirs in pools.get(pool, {}).items():
                if theirs.claimed and other != tenant:
                    return True
        return False

    def _lapse(self, seen: _Seen, now: float) -> int:
        """The tenant's claims still kept (a claim past `claim_until` lapses: the engine freed the slot
        late, or the request left)."""
        if seen.claimed and seen.claim_until <= now:
            self._claims -= seen.claimed
            seen.claimed = 0
            self._changes += 1
        return seen.claimed

    def active(self, pool: str) -> dict[str, Active]:
        """Tenant -> what the reserve reads, for the tenants active in `pool` now (every replica's)."""
        out = self._local(pool)
        for pools in self._remote.values():
            for tenant, theirs in pools.get(pool, {}).items():
                mine = out.get(tenant)
                if mine is None:
                    out[tenant] = theirs
                else:
                    out[tenant] = Active(
                        mine.band,
                        mine.weight,
                        mine.inflight + theirs.inflight,
                        mine.waiting + theirs.waiting,
                        mine.peak + theirs.peak,
                        mine.claimed + theirs.claimed,
                    )
        return out

    def report(self) -> list[TenantRow]:
        """This replica's own active tenants in every pool, for the other replicas (the same list
        while nothing changed and less than a peak bucket has passed)."""
        now = self.now()
        cached = self._report
        if (
            cached is not None
            and cached[1] == self._changes
            and now - cached[2] < self.active_s / _PEAK_BUCKETS
            and not any(row[7] for row in cached[0])  # a claim lapses by time: rebuilt while one is held
        ):
            return cached[0]
        rows: list[TenantRow] = []
        for pool in sorted(self._pools):
            for tenant, seen in sorted(self._local(pool).items()):
                rows.append(
                    (pool, tenant, seen.band, seen.weight, seen.inflight, seen.waiting, seen.peak, seen.claimed)
                )
        self._report = (rows, self._changes, now)
        return rows

    def set_remote(self, replica: str, rows: Iterable[TenantRow]) -> None:
        """Replace what `replica` reported (at most `max_tenants` per pool are kept of it)."""
        if replica not in self._remote and len(self._remote) >= _MAX_PEERS:
            first = next(iter(self._remote))  # bounded: the peer reported first goes
            del self._remote[first]
            self._claiming_peers.discard(first)
        pools: dict[str, dict[str, Active]] = {}
        for pool, tenant, band, weight, inflight, waiting, peak, claimed in rows:
            tenants = pools.setdefault(pool, {})
            if len(tenants) < self.max_tenants:
                tenants[tenant] = Active(band, weight, inflight, waiting, peak, claimed)
        self._remote[replica] = pools
        if any(seen.claimed for tenants in pools.values() for seen in tenants.values()):
            self._claiming_peers.add(replica)
        else:
            self._claiming_peers.discard(replica)

    def drop_remote(self, replica: str | None = None) -> None:
        """Forget what `replica` reported (None: every replica)."""
        if replica is None:
            self._remote.clear()
            self._claiming_peers.clear()
        else:
            self._remote.pop(replica, None)
            self._claiming_peers.discard(replica)

    def _local(self, pool: str) -> dict[str, Active]:
        tenants = self._pools.get(pool)
        if not tenants:
            return {}
        now = self.now()
        cutoff = now - self.active_s
        out: dict[str, Active] = {}
        for tenant, seen in list(tenants.items()):
            claimed = self._lapse(seen, now)
            if seen.waiting or seen.inflight or claimed or seen.last_s >= cutoff:
                peak = seen.peak(now, self.active_s)
                out[tenant] = Active(seen.band, seen.weight, seen.inflight, seen.waiting, peak, claimed)
            else:
                del tenants[tenant]
        return out

    def _seen(self, pool: str, tenant: str, band: int, weight: float) -> _Seen:
        tenants = self._pools.get(pool)
        if tenants is None:
            tenants = self._pools[pool] = {}
        seen = tenants.get(tenant)
        if seen is None:
            if len(tenants) >= self.max_tenants:
                self._evict(tenants)
            seen = tenants[tenant] = _Seen(band, weight)
        seen.band, seen.weight, seen.last_s = band, weight, self.now()
        self._changes += 1
        return seen

    def _evict(self, tenants: dict[str, _Seen]) -> None:
        idle = [(s.last_s, t) for t, s in tenants.items() if not s.waiting and not s.inflight]
        # every one busy: the least recently seen goes (its counts come back with its next request)
        gone = min(idle)[1] if idle else min((s.last_s, t) for t, s in tenants.items())[1]
        self._claims -= tenants.pop(gone).claimed


_MAX_GROUPS: Final = 4096
_MAX_PROGRAMS: Final = 4096
_EXPIRE_PER_READ: Final = 8  # idle programs forgotten (or busy ones passed) per read, at most
_MAX_PROGRAM_PEERS: Final = 1024
_MAX_REPORT_ROWS: Final = 4096  # rows a replica publishes, and keeps of each peer
_REPORT_EVERY: Final = 12  # an unchanged report is rebuilt after active_s / this (idle programs expire)


@dataclass(slots=True)
class _Program:
    inflight: int = 0
    waiting: int = 0
    last_s: float = 0.0


@dataclass(slots=True)
class _Group:
    key: tuple[str, str]  # (pool, tenant)
    programs: OrderedDict[str, _Program] = field(default_factory=OrderedDict)
    inflight: int = 0  # the programs' requests in flight, summed
    waiting_programs: int = 0  # programs with a request waiting
    shared: int = 0  # programs also active on another replica (in the merged remote group)
    both_waiting: int = 0  # programs waiting here and on another replica


@dataclass(slots=True)
class _Remote:
    """The other replicas' programs of one (pool, tenant), summed over the replicas."""

    programs: dict[str, tuple[int, int]] = field(default_factory=dict)  # program -> (in flight, waiting)
    inflight: int = 0
    waiting_programs: int = 0


@dataclass(slots=True)
class ProgramActivity:
    active_s: float = 10.0
    max_groups: int = _MAX_GROUPS
    max_programs: int = _MAX_PROGRAMS
    now: Callable[[], float] = field(default=time.monotonic)
    _groups: dict[tuple[str, str], _Group] = field(default_factory=dict)
    _peers: dict[str, dict[tuple[str, str], dict[str, tuple[int, int]]]] = field(default_factory=dict)
    _remote: dict[tuple[str, str], _Remote] = field(default_factory=dict)  # merged over `_peers`
    _changes: int = 0
    _report: tuple[list[ProgramLoad], int, float] | None = None

    def inflight(self, pool: str, tenant: str, program: str, delta: int) -> None:
        """A request of `program` was dispatched (+1) or ended (-1) in `pool`."""
        group, seen = self._touch(pool, tenant, program, create=delta > 0)
        if seen is None or group is None:
            return
        before = seen.inflight
        seen.inflight = max(before + delta, 0)
        group.inflight = max(group.inflight + seen.inflight - before, 0)

    def waiting(self, pool: str, tenant: str, program: str, delta: int) -> None:
        """A request of `program` entered (+1) or left (-1) `pool`'s waiting room."""
        group, seen = self._touch(pool, tenant, program, create=delta > 0)
        if seen is None or group is None:
            return
        before = seen.waiting
        seen.waiting = max(before + delta, 0)
        if (before == 0) == (seen.waiting == 0):
            return
        remote = self._remote.get((pool, tenant))
        waits_there = remote is not None and remote.programs.get(program, (0, 0))[1] > 0
        step = 1 if before == 0 else -1
        group.waiting_programs = max(group.waiting_programs + step, 0)
        if waits_there:
            group.both_waiting = max(group.both_waiting + step, 0)

    def standing(self, pool: str, tenant: str, program: str) -> Standing:
        """The program's standing in its tenant now, every replica's counts added (a program never
        seen counts as active, with nothing in flight or waiting: it is asking)."""
        key = (pool, tenant)
        group = self._groups.get(key)
        remote = self._remote.get(key)
        if group is None and remote is None:
            return Standing(0, 0, 1, 0)
        inflight = tenant_inflight = active = waiting = 0
        seen: _Program | None = None
        if group is not None:
            self._expire(group)
            seen = group.programs.get(program)
            tenant_inflight, active, waiting = group.inflight, len(group.programs), group.waiting_programs
            if seen is not None:
                inflight = seen.inflight
        there = (0, 0)
        known = seen is not None
        if remote is not None:
            found = remote.programs.get(program)
            if found is not None:
                there, known = found, True
            overlap = (group.shared, group.both_waiting) if group is not None else (0, 0)
            tenant_inflight += remote.inflight
            active += len(remote.programs) - overlap[0]
            waiting += remote.waiting_programs - overlap[1]
        light = active - waiting
        if not known:
            return Standing(0, tenant_inflight, active + 1, light)
        if not (seen is not None and seen.waiting) and not there[1]:
            light -= 1  # itself
        return Standing(inflight + there[0], tenant_inflight, active, light)

    # --- several replicas -------------------------------------------------------------------------

    def report(self) -> list[ProgramLoad]:
        """This replica's own active programs, for the other replicas: (pool, tenant, program, in
        flight, waiting), at most `_MAX_REPORT_ROWS` (the same list while nothing changed and less
        than `active_s / _REPORT_EVERY` has passed)."""
        now = self.now()
        cached = self._report
        if cached is not None and cached[1] == self._changes and now - cached[2] < self.active_s / _REPORT_EVERY:
            return cached[0]
        rows: list[ProgramLoad] = []
        for (pool, tenant), group in sorted(self._groups.items()):
            self._expire(group, every=True)
            for program, seen in group.programs.items():
                if len(rows) >= _MAX_REPORT_ROWS:
                    break
                rows.append((pool, tenant, program, seen.inflight, seen.waiting))
        self._report = (rows, self._changes, now)
        return rows

    def set_remote(self, replica: str, rows: Iterable[ProgramLoad]) -> None:
        """Replace what `replica` reported (at most `_MAX_REPORT_ROWS` rows of it are kept)."""
        if replica not in self._peers and len(self._peers) >= _MAX_PROGRAM_PEERS:
            self.drop_remote(next(iter(self._peers)))  # bounded: the peer reported first goes
        groups: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
        for kept, (pool, tenant, program, inflight, waiting) in enumerate(rows):
            if kept >= _MAX_REPORT_ROWS:
                break
            groups.setdefault((pool, tenant), {})[program] = (inflight, waiting)
        before = self._peers.get(replica, {})
        self._peers[replica] = groups
        for key in before.keys() | groups.keys():
            self._merge(key)

    def drop_remote(self, replica: str | None = None) -> None:
        """Forget what `replica` reported (None: every replica)."""
        if replica is None:
            self._peers.clear()
            for key in list(self._remote):
                self._merge(key)
            return
        gone = self._peers.pop(replica, None)
        for key in gone or ():
            self._merge(key)

    def _merge(self, key: tuple[str, str]) -> None:
        """Re-add the peers' rows of one (pool, tenant) and the local group's overlap with them."""
        merged = _Remote()
        for groups in self._peers.values():
            for program, (inflight, waiting) in groups.get(key, {}).items():
                was = merged.programs.get(program, (0, 0))
                merged.programs[program] = (was[0] + inflight, was[1] + waiting)
                merged.inflight += inflight
        merged.waiting_programs = sum(1 for _, waiting in merged.programs.values() if waiting)
        if merged.programs:
            self._remote[key] = merged
        else:
            self._remote.pop(key, None)
        group = self._groups.get(key)
        if group is not None:
            self._overlap(group, merged)

    @staticmethod
    def _overlap(group: _Group, remote: _Remote | None) -> None:
        group.shared = group.both_waiting = 0
        if remote is None:
            return
        for program, seen in group.programs.items():
            there = remote.programs.get(program)
            if there is not None:
                group.shared += 1
                if seen.waiting and there[1]:
                    group.both_waiting += 1

    def status(self) -> dict[str, object]:
        """Per pool and tenant: programs active, requests in flight, programs waiting (`/admin/status`),
        this replica's; with other replicas' reports merged in, `cluster` adds theirs, a program
        counted once whichever replicas carry its calls (the figures `standing` decides on)."""
        out: dict[str, object] = {}
        for key in sorted(self._groups.keys() | self._remote.keys()):
            group = self._groups.get(key)
            if group is not None:
                self._expire(group)
            local = (len(group.programs), group.inflight, group.waiting_programs) if group is not None else (0, 0, 0)
            row: dict[str, object] = {"programs": local[0], "inflight": local[1], "waiting_programs": local[2]}
            remote = self._remote.get(key)
            if remote is not None:
                shared, both = (group.shared, group.both_waiting) if group is not None else (0, 0)
                row["cluster"] = {
                    "programs": local[0] + len(remote.programs) - shared,
                    "inflight": local[1] + remote.inflight,
                    "waiting_programs": local[2] + remote.waiting_programs - both,
                }
            out[f"{key[0]}/{key[1]}"] = row
        return out

    # --- parts ------------------------------------------------------------------------------------

    def _touch(self, pool: str, tenant: str, program: str, *, create: bool) -> tuple[_Group | None, _Program | None]:
        key = (pool, tenant)
        group = self._groups.get(key)
        if group is None:
            if not create:
                return None, None
            if len(self._groups) >= self.max_groups:
                self._drop_a_group()
            group = self._groups[key] = _Group(key)
        seen = group.programs.get(program)
        if seen is None:
            if not create:
                return group, None
            if len(group.programs) >= self.max_programs:
                self._forget(group, next(iter(group.programs)))
            seen = group.programs[program] = _Program()
            remote = self._remote.get(key)
            if remote is not None and program in remote.programs:
                group.shared += 1
        else:
            group.programs.move_to_end(program)
        seen.last_s = self.now()
        self._changes += 1
        return group, seen

    def _expire(self, group: _Group, *, every: bool = False) -> None:
        """Forget idle programs past `active_s` from the front (`_EXPIRE_PER_READ` looked at, or with
        `every` as many as there are: the report's walk)."""
        programs = group.programs
        cutoff = self.now() - self.active_s
        for _ in range(len(programs) if every else min(_EXPIRE_PER_READ, len(programs))):
            name, seen = next(iter(programs.items()))
            if seen.last_s >= cutoff:
                return  # the rest changed later still
            if seen.inflight or seen.waiting:
                programs.move_to_end(name)  # busy: active whatever its age
                continue
            self._forget(group, name)

    def _forget(self, group: _Group, program: str) -> None:
        seen = group.programs.pop(program)
        self._changes += 1
        group.inflight = max(group.inflight - seen.inflight, 0)
        if seen.waiting:
            group.waiting_programs = max(group.waiting_programs - 1, 0)
        remote = self._remote.get(group.key) if group.shared else None
        there = remote.programs.get(program) if remote is not None else None
        if there is not None:
            group.shared = max(group.shared - 1, 0)
            if seen.waiting and there[1]:
                group.both_waiting = max(group.both_waiting - 1, 0)

    def _drop_a_group(self) -> None:
        """Room for a new group: one with nothing in flight or waiting goes, else the oldest."""
        for key, group in self._groups.items():
            if not group.inflight and not group.waiting_programs:
                del self._groups[key]
                self._changes += 1
                return
        del self._groups[next(iter(self._groups))]
        self._changes += 1
