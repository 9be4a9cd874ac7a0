"""Virtual counters shared by several gateway replicas through Redis.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policies.flow.flusher import BatchedFlush
from policies.limits.resp import load_script
from policies.limits.scriptpipe import script_pipeline

log = logging.getLogger("tokenway.flow.counters")

_TTL_MS = 86_400_000
_NO_FLOOR = float("-inf")


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
            # vtc.credited as a map: max(max(v, F) + c, F) = max(v + c, F + max(c, 0))
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
            view.last_served = float(last)
        pairs = zip(flat[::2], flat[1::2], strict=True)
        view.snapshot = {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in pairs}

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            asked = False
            for view in self._views.values():
                if view.watched:
                    view.read = asked = True
            if asked and self._flush_timer is None and self._flushing is None:
                self._start_flush()
