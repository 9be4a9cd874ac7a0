"""Virtual counters shared by several gateway replicas through Redis.

Each replica orders its own waiting room from a local view of every (pool, band) it serves; the view
is changed at once by the replica's own dispatches and completions, so ordering never waits on
Redis. Each change is also one small atomic script call (`vtc.lua`: lift, take off held-back
refunds, remember the last served, add) whose reply carries the band's counters as Redis holds
them: the view is rebuilt from it, so every reply also brings in the other replicas' charges.
While requests wait in a band the view is re-read every `refresh_s` as well, so an idle replica's
changes arrive even when this one dispatches nothing. `age_s` is the time since the view last
heard from Redis: the staleness of the shared part.

Changes that Redis has not acknowledged stay in the view as pending deltas (and lifts) on top of the
last reply; a reply older than one already applied is ignored. A failed call keeps its delta locally
(the other replicas will not see it) and is counted; fairness degrades to per replica, requests never
fail on it. Keys carry the `{prefix}` hash tag, like the limiter's, so one Redis Cluster slot holds
them. Counters expire after a day without changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies.flow import vtc
from policies.limits.autopipeline import AutoPipeline, Script

log = logging.getLogger("tokenway.flow.counters")

_TTL_MS = 86_400_000
_MAX_PENDING_CALLS = 10_000  # beyond this many unanswered calls, changes stay local (counted)
_READ_ONLY = ("", "", "0", "0", str(_TTL_MS), "0")  # the script's arguments that change nothing


def _args(tenant: str, floor: float | None, delta: float, dispatch: bool, credit: float) -> list[str]:
    """`vtc.lua`'s arguments."""
    return [
        tenant,
        "" if floor is None else repr(floor),
        repr(delta),
        "1" if dispatch else "0",
        str(_TTL_MS),
        repr(credit),
    ]


@dataclass(slots=True)
class _View:
    snapshot: dict[str, float] = field(default_factory=dict)
    last_served: float = 0.0
    pending: dict[str, float] = field(default_factory=dict)  # sent, not yet answered
    local: dict[str, float] = field(default_factory=dict)  # failed to reach Redis: ours alone
    lifts: dict[str, float] = field(default_factory=dict)  # floors sent, not yet answered
    applied_seq: int = 0
    heard_at_s: float = 0.0
    watched: bool = False

    def value(self, tenant: str) -> float:
        value = self.snapshot.get(tenant, 0.0)
        lift = self.lifts.get(tenant)
        if lift is not None and lift > value:
            value = lift
        return value + self.pending.get(tenant, 0.0) + self.local.get(tenant, 0.0)


class RedisCounters:
    source = "redis"

    def __init__(self, client: Redis, *, prefix: str = "tokenway", refresh_s: float = 0.1) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self._tag = "{" + prefix + "}:flow:"
        self._script = Script(resources.files("policies.flow").joinpath("vtc.lua").read_text(encoding="utf-8"))
        self.pipeline = AutoPipeline(client, (self._script,))
        self._views: dict[tuple[str, int], _View] = {}
        self._seq = 0
        self._calls: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self.calls = 0
        self.errors = 0
        self.dropped = 0

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str = "tokenway", refresh_s: float = 0.1, timeout_s: float = 0.2
    ) -> RedisCounters:
        client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, prefix=prefix, refresh_s=refresh_s)

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
        view.lifts[tenant] = max(view.lifts.get(tenant, floor), floor)
        self._send(pool, band, view, tenant, lift=floor, delta=0.0, args=_args(tenant, floor, 0.0, False, 0.0))

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
        before = view.value(tenant)
        lift = floor if floor is not None and floor > before else None
        if lift is not None:
            view.lifts[tenant] = max(view.lifts.get(tenant, lift), lift)
        credited = vtc.credited(before, credit, floor)
        if dispatch:
            view.last_served = credited
        # the view's guess at what Redis will do (it clamps against its own counter, and its reply wins)
        change = credited - view.value(tenant) + delta
        view.pending[tenant] = view.pending.get(tenant, 0.0) + change
        args = _args(tenant, floor, delta, dispatch, credit)
        self._send(pool, band, view, tenant, lift=lift, delta=change, args=args)

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
            "calls": self.calls,
            "errors": self.errors,
            "dropped": self.dropped,
            "pending": len(self._calls),  # Redis calls sent and not yet answered
        }

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=1.0)
        await self.client.aclose()

    # --- Redis ---------------------------------------------------------------------------------

    def _send(
        self, pool: str, band: int, view: _View, tenant: str, *, lift: float | None, delta: float, args: list[str]
    ) -> None:
        """Send one script call; `lift` and `delta` are what the view holds pending until it answers."""
        if len(self._calls) >= _MAX_PENDING_CALLS:
            self.dropped += 1
            self._settle_locally(view, tenant, lift, delta)
            return
        self._seq += 1
        call = self._call(pool, band, view, tenant, lift, delta, args, self._seq)
        try:
            task = asyncio.get_running_loop().create_task(call)
        except RuntimeError:  # no loop (a synchronous caller in a test): keep it local
            call.close()
            self._settle_locally(view, tenant, lift, delta)
            return
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(
        self,
        pool: str,
        band: int,
        view: _View,
        tenant: str,
        lift: float | None,
        delta: float,
        args: Sequence[str],
        seq: int,
    ) -> None:
        self.calls += 1
        try:
            reply = await self.pipeline.call(self._script, self.keys(pool, band), args)
        except Exception as exc:
            self.errors += 1
            if self.errors == 1 or self.errors % 1000 == 0:
                log.warning("flow counters: Redis call failed (%d so far): %s", self.errors, exc)
            self._settle_locally(view, tenant, lift, delta)
            return
        self._unpend(view, tenant, lift, delta)
        self._apply(view, reply, seq)

    def _settle_locally(self, view: _View, tenant: str, lift: float | None, delta: float) -> None:
        """A change Redis never got: it stays in this replica's view only."""
        before = view.value(tenant)
        self._unpend(view, tenant, lift, delta)
        view.local[tenant] = view.local.get(tenant, 0.0) + before - view.value(tenant)

    @staticmethod
    def _unpend(view: _View, tenant: str, lift: float | None, delta: float) -> None:
        if delta:
            left = view.pending.get(tenant, 0.0) - delta
            if abs(left) < 1e-9:
                view.pending.pop(tenant, None)
            else:
                view.pending[tenant] = left
        if lift is not None and view.lifts.get(tenant) == lift:
            del view.lifts[tenant]

    def _apply(self, view: _View, reply: Any, seq: int) -> None:
        view.heard_at_s = time.monotonic()
        if seq < view.applied_seq:
            return  # an older picture than the one we hold
        view.applied_seq = seq
        last, flat = reply
        view.last_served = float(last)
        pairs = zip(flat[::2], flat[1::2], strict=True)
        view.snapshot = {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in pairs}

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            watched = [(key, view) for key, view in self._views.items() if view.watched]
            if not watched:
                continue
            for (pool, band), view in watched:
                self._seq += 1
                seq = self._seq
                try:
                    reply = await self.pipeline.call(self._script, self.keys(pool, band), _READ_ONLY)
                except Exception:
                    self.errors += 1
                    continue
                self._apply(view, reply, seq)
