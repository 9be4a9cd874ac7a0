"""Who is active in each pool: requests waiting and in flight per tenant, their recent peak, and when
each was last seen; with several replicas, the others' too.

The slot reserve (`policies.flow.reserve`) reads it: a tenant stays active `active_s` after its last
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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from gateway.replicas.wire import TenantLoad as TenantRow
from policies.flow.reserve import Active

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
        if peaks and peaks[-1][0] == start:
            if demand > peaks[-1][1]:
                peaks[-1][1] = demand
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
        seen.waiting = max(seen.waiting + delta, 0)
        seen.record(seen.last_s, self.active_s / _PEAK_BUCKETS)

    def inflight(self, pool: str, tenant: str, band: int, weight: float, delta: int) -> None:
        seen = self._seen(pool, tenant, band, weight)
        seen.inflight = max(seen.inflight + delta, 0)
        seen.record(seen.last_s, self.active_s / _PEAK_BUCKETS)

    def claim(self, pool: str, tenant: str, band: int, weight: float) -> None:
        """A slot was cut for a request of `tenant`: keep it for that tenant (`claim_s` at most)."""
        seen = self._seen(pool, tenant, band, weight)
        seen.claimed += 1
        self._claims += 1
        seen.claim_until = self.now() + self.claim_s

    def take_claim(self, pool: str, tenant: str) -> None:
        """A request of `tenant` dispatched: a slot cut for it, if any, is taken."""
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
        tenants = self._pools.setdefault(pool, {})
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
