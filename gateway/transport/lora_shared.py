"""LoRA adapter activity shared by the gateway processes of one fleet (`state: redis`): replicas, and
the workers of `--workers N`.

Each process otherwise judges adapters by its own requests alone (`lora.py`): behind a balancer,
gateway B would unload an adapter from an engine as idle while gateway A keeps sending it requests
there (each unload costing A a reload), would preload for `lora_preload_hottest` and weigh the
router's eviction victims from its own share of the demand, and its autoscaler would see its own
share of the pool's adapter loads. Shared per pool, in one Redis hash (`lora_share.lua`):

- **last use** of each adapter on each shared endpoint: the keeper's idle unload waits for the
  fleet-wide idle time (`AdapterLoader.last_used`), and so does the memory budget's LRU order. An
  adapter with a request in flight here is stamped as used at every flush, so a long stream keeps it
  in use for every process;
- **demand**: requests per adapter, as running totals. What the others added since the last read is
  folded into this process's decayed counts as requests heard now (`AdapterLoader.add_demand`, the
  router's `AdapterResidency.add_demand`): the counts keep their own half-lives (10 min, 60 s), a read
  late by one flush against them;
- **on-demand loads** of the pool, likewise a running total: `pool_loads` is what the autoscaler reads
  (`autoscale.adapter_loads_per_min`), every process's loads;
- **per replica, what the gateways did there** (loads, preloads, evictions for the budget, idle
  unloads, failed loads: the loader's `ReplicaActivity`), running totals of every process since the
  hash began, for the console's adapter view (`fleet_activity`): the growth of this process's counters
  since its last call is added at each flush.

Only what happens on endpoints that are the same engine for every process is shared (static and
discovered ones, not those a replica launched itself: `Endpoint.launched`), as the replicas' routing
state is: replicas that each launch their own engines share nothing here, since another's uses,
demand and loads are on other engines.

Nothing per request touches Redis: a request changes a dict here (`begun`, `ended`, `loaded`), and
every `flush_s` one script call per pool sends what changed and reads the fleet's (`BatchedFlush`, at
most one flush in flight); a process with nothing to send still reads every `flush_s`, so an idle
gateway sees another's use within about two of its keeper's passes. Processes send ages rather than
times, so their clocks never need to agree: Redis stamps each use on its own clock.

Bounded: fields per pool are the policy's adapters (demand) and adapters x shared endpoints (last
use), at most `max_fields` per pool in Redis (a field past that is not shared) and the same in each
view; a last use older than `keep_s` is dropped; the hash expires `ttl_s` after its last write. When
a call fails (counted and logged) each process judges by its own requests, as without sharing: its
uses go out with the next call, its counts stay its own (sent again, they could count twice). A
running total that shrinks (the hash expired, or was flushed) restarts the count from what Redis holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from backends.fleet import Fleet
from backends.types import Endpoint
from gateway.transport.lora import ACTIVITY_KINDS, AdapterLoader, ReplicaActivity
from policies.flow.redis_counters import BatchedFlush
from policies.limits.scriptpipe import load_script, script_pipeline

log = logging.getLogger("tokenway.lora")

FLUSH_S = 1.0  # the keeper's pass is 1 s: another process's use reaches it within about two
KEEP_S = 86_400.0  # a last use older than a day is dropped (longer than any sensible idle_unload_s)
TTL_S = 86_400.0  # a pool's hash expires a day after its last write
MAX_FIELDS = 16_384  # per pool, in Redis and in each view
SEP = "\x1f"  # between an endpoint id and an adapter name in a last-use field


class Demand(Protocol):
    """Where the others' requests are folded in (the router's `AdapterResidency`)."""

    def add_demand(self, adapter: str, count: float, now_s: float) -> None: ...


@dataclass(slots=True)
class _Pool:
    """One pool's part: what this process has to send, and what it last read."""

    uses: dict[str, float] = field(default_factory=dict)  # 'u|' field -> when used (monotonic), unsent
    demand: dict[str, int] = field(default_factory=dict)  # adapter -> requests begun here, unsent
    loads: int = 0  # on-demand loads here, unsent
    sent: bool | None = None  # a call in flight (BatchedFlush clears it when answered)
    sending: tuple[dict[str, float], dict[str, int], int] = ({}, {}, 0)  # what that call carries
    totals: dict[str, int] | None = None  # 'd|' / 'l' totals as last read (None: never read)
    remote_loads: int = 0  # the others' loads heard since this process started
    heard: dict[tuple[str, str], float] = field(default_factory=dict)  # (endpoint, adapter) -> last use (monotonic)
    activity: dict[str, list[int]] = field(default_factory=dict)  # endpoint -> every process's counters, as read

    def due(self) -> bool:
        return bool(self.uses or self.demand or self.loads)


class SharedAdapters(BatchedFlush):
    def __init__(
        self,
        client: Redis,
        loader: AdapterLoader,
        fleet: Fleet,
        *,
        prefix: str = "tokenway",
        residency: Demand | None = None,
        flush_s: float = FLUSH_S,
        keep_s: float = KEEP_S,
        ttl_s: float = TTL_S,
        max_fields: int = MAX_FIELDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.loader = loader
        self.fleet = fleet
        self.residency = residency
        self.flush_s = flush_s
        self.keep_s = keep_s
        self.ttl_s = ttl_s
        self.max_fields = max_fields
        self.clock = clock
        self.redis_clock: Callable[[], float] | None = None  # the script's time (tests); None: Redis's own
        self._tag = "{" + prefix + "}:lora:"
        self._script = load_script("gateway.transport", "lora_share.lua")
        self.pipeline = script_pipeline(client, (self._script,))
        self._pools: dict[str, _Pool] = {}
        self._counted: dict[str, tuple[int, ...]] = {}  # endpoint -> the loader's counters as last sent
        self._init_flush()
        self.calls = 0
        self.errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        loader: AdapterLoader,
        fleet: Fleet,
        *,
        prefix: str = "tokenway",
        residency: Demand | None = None,
        flush_s: float = FLUSH_S,
        timeout_s: float = 2.0,
    ) -> SharedAdapters:
        client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, loader, fleet, prefix=prefix, residency=residency, flush_s=flush_s)

    async def sync(self) -> None:
        """One flush now, waiting for any in flight first (tests, and a caller that must see the fleet)."""
        if self._flushing is not None:
            await asyncio.wait([self._flushing])
        await self._flush()

    def key(self, pool: str) -> str:
        return self._tag + pool

    def start(self) -> None:
        """Read the fleet's every `flush_s` (sending what changed), until `close`."""
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(), name="lora share")

    # --- what the loader tells (the hot path: dict updates only) ----------------------------------

    def begun(self, endpoint: Endpoint, adapter: str) -> None:
        if endpoint.launched:  # this process's own engine: its requests are nobody else's business
            return
        view = self._pool(endpoint.pool)
        if adapter in view.demand or len(view.demand) < self.max_fields:
            view.demand[adapter] = view.demand.get(adapter, 0) + 1
        self._used(view, endpoint, adapter)
        self._changed()

    def ended(self, endpoint: Endpoint, adapter: str) -> None:
        if endpoint.launched:
            return
        self._used(self._pool(endpoint.pool), endpoint, adapter)
        self._changed()

    def loaded(self, endpoint: Endpoint) -> None:
        if endpoint.launched:
            return
        self._pool(endpoint.pool).loads += 1
        self._changed()

    # --- what the fleet's readers ask -------------------------------------------------------------

    def last_used_s(self, endpoint: Endpoint, adapter: str) -> float | None:
        """When any process last used `adapter` on `endpoint`, on this process's monotonic clock, as of
        the last read (None: nobody that this process heard of, or the endpoint is not shared)."""
        view = self._pools.get(endpoint.pool)
        return view.heard.get((endpoint.id, adapter)) if view is not None else None

    def pool_loads(self, pool: str) -> int:
        """On-demand adapter loads on `pool` since this process started: its own and the others' (the
        autoscaler's adapter demand reads the difference between two passes)."""
        view = self._pools.get(pool)
        return self.loader.pool_loads(pool) + (view.remote_loads if view is not None else 0)

    def fleet_activity(self, endpoint: Endpoint) -> ReplicaActivity | None:
        """What every gateway process did with adapters on `endpoint` (a shared one) since the pool's
        hash began, as of the last read; None when not shared or not read yet."""
        view = self._pools.get(endpoint.pool)
        counts = view.activity.get(endpoint.id) if view is not None and not endpoint.launched else None
        return ReplicaActivity(endpoint.pool, *counts) if counts is not None else None

    def status(self) -> dict[str, object]:
        return {"store": "redis", "pools": len(self._pools), "calls": self.calls, "errors": self.errors}

    # --- Redis ------------------------------------------------------------------------------------

    def _pool(self, pool: str) -> _Pool:
        found = self._pools.get(pool)
        if found is None:
            found = self._pools[pool] = _Pool()  # the fleet's pools: bounded by the configuration
        return found

    def _used(self, view: _Pool, endpoint: Endpoint, adapter: str) -> None:
        if endpoint.launched:  # this process's own engine: nobody else sends there
            return
        name = "u|" + endpoint.id + SEP + adapter
        if name in view.uses or len(view.uses) < self.max_fields:
            view.uses[name] = self.clock()

    def _serving(self) -> list[str]:
        """The pools that serve some adapter's base model on a shared endpoint (the others have nothing
        to share)."""
        bases = {adapter.base_model for adapter in self.fleet.adapters.values()}
        return [
            name
            for name, pool in self.fleet.pools.items()
            if pool.config.model in bases and any(not e.launched for e in pool.endpoints)
        ]

    def _due(self) -> bool:
        return any(view.due() for view in self._pools.values())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            if self._flushing is None:
                if self._flush_timer is not None:
                    self._flush_timer.cancel()
                    self._flush_timer = None
                self._flushing = asyncio.get_running_loop().create_task(self._flush())
                self._flushing.add_done_callback(self._flushed)

    async def _flush(self) -> None:
        """One call per pool that serves adapters: its changes, and a read of the whole pool."""
        for held in self.loader.held():  # in flight here: in use now, for every process
            if held.inflight:
                self._used(self._pool(held.endpoint.pool), held.endpoint, held.adapter)
        now = self.clock()
        names = dict.fromkeys([*self._serving(), *(name for name, view in self._pools.items() if view.due())])
        batch = [(pool, self._pool(pool)) for pool in names]
        calls = []
        for pool, view in batch:
            view.sent, view.sending = True, (view.uses, view.demand, view.loads)
            uses, demand, loads = view.sending
            view.uses, view.demand, view.loads = {}, {}, 0
            stamp = "" if self.redis_clock is None else repr(self.redis_clock())
            args: list[Any] = [int(self.ttl_s * 1000), self.max_fields, self.keep_s, stamp, len(uses)]
            for name, at in uses.items():
                args += [name, max(now - at, 0.0)]
            for adapter, count in demand.items():
                args += ["d|" + adapter, count]
            if loads:
                args += ["l", loads]
            args += self._activity_growth(pool)
            calls.append(self.pipeline.call(self._script, (self.key(pool),), args))
        await self._answered(batch, calls)

    def _activity_growth(self, pool: str) -> list[Any]:
        """'a|' endpoint SEP kind, count: how much the loader's counters on the pool's shared endpoints
        grew since the last call (sent once: a call that fails loses them from the fleet's totals only)."""
        args: list[Any] = []
        for endpoint_id, counts in self.loader.activity.items():
            endpoint = self.fleet.endpoint(endpoint_id)
            if counts.pool != pool or endpoint is None or endpoint.launched:
                continue
            now = tuple(getattr(counts, kind) for kind in ACTIVITY_KINDS)
            before = self._counted.get(endpoint_id, (0,) * len(ACTIVITY_KINDS))
            for kind, value, old in zip(ACTIVITY_KINDS, now, before, strict=True):
                if value > old:
                    args += ["a|" + endpoint_id + SEP + kind, value - old]
            self._counted[endpoint_id] = now
        return args

    def _failed(self, view: _Pool, exc: BaseException) -> None:
        """Redis did not answer: the uses go out with the next call (the latest of each kept); the
        counts stay this process's own (sending them again could count them twice)."""
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("LoRA adapter sharing: Redis call failed (%d so far): %s", self.errors, exc)
        view.sent = None
        for name, at in view.sending[0].items():
            if view.uses.get(name, float("-inf")) < at and (name in view.uses or len(view.uses) < self.max_fields):
                view.uses[name] = at
        view.sending = ({}, {}, 0)

    def _apply(self, view: _Pool, reply: Any) -> None:
        """The pool as Redis holds it now: last uses replace the view's; what the running totals grew by,
        less this process's own part of the call, is the others' demand and loads."""
        _uses, demand, loads = view.sending
        view.sending = ({}, {}, 0)
        now = self.clock()
        heard: dict[tuple[str, str], float] = {}
        totals: dict[str, int] = {}
        activity: dict[str, list[int]] = {}
        for raw_name, raw_value in zip(reply[::2], reply[1::2], strict=True):
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            if name.startswith("u|"):
                endpoint, _, adapter = name[2:].partition(SEP)
                if len(heard) < self.max_fields:
                    heard[(endpoint, adapter)] = now - float(raw_value)
            elif name.startswith("a|"):
                endpoint, _, kind = name[2:].partition(SEP)
                if kind in ACTIVITY_KINDS and (endpoint in activity or len(activity) < self.max_fields):
                    activity.setdefault(endpoint, [0] * len(ACTIVITY_KINDS))[ACTIVITY_KINDS.index(kind)] = int(
                        raw_value
                    )
            elif len(totals) < self.max_fields:
                totals[name] = int(raw_value)
        view.heard = heard
        view.activity = activity
        before, view.totals = view.totals, totals
        if before is None:  # the first read: what came before this process is history, not new demand
            return
        for name, total in totals.items():
            if not name.startswith("d|"):
                continue
            adapter = name[2:]
            grown = total - before.get(name, 0)
            others = (grown if grown >= 0 else total) - demand.get(adapter, 0)
            if others > 0:
                self.loader.add_demand(adapter, others)
                if self.residency is not None:
                    self.residency.add_demand(adapter, float(others), now)
        total = totals.get("l", 0)
        grown = total - before.get("l", 0)
        view.remote_loads += max((grown if grown >= 0 else total) - loads, 0)


@contextlib.asynccontextmanager
async def sharing(shared: SharedAdapters | None) -> AsyncIterator[SharedAdapters | None]:
    """Run `shared` (None: nothing) for the body's duration; its last changes go out at the end."""
    if shared is None:
        yield None
        return
    shared.start()
    try:
        yield shared
    finally:
        await shared.close()
