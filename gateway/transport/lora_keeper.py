"""The adapter keeper: preloads the adapters marked `preload: true` (and a pool's hottest) and
unloads idle ones.

Loading on first demand (`lora.py`) makes the first request for an adapter on a replica pay the
load; an adapter that is always wanted should not (`preload: true` in policies.yaml loads it on every
ready replica of its base model's pools, at start and whenever a replica comes back, and never unloads
it for idleness). A pool's `lora_preload_hottest: N` does the same for the N adapters of its model
with the most recent demand (requests, halving every 10 minutes: `AdapterLoader.hottest`), so a
replica that starts or comes back holds them before their next request; the set follows demand.

The opposite end: an adapter nobody asked for on a replica for `idle_unload_s` (the adapter's own,
else the pool's `lora_idle_unload_s`) is unloaded by the gateway (`/v1/unload_lora_adapter`), so the
engine's registered set, its CPU cache and the routing view shrink back to what is used ("scale an
adapter to zero"). Unset, the engine's LRU alone evicts. With `state: redis` idleness is the fleet's
(`lora_shared.py`): an adapter another gateway process used on that engine within `idle_unload_s`
stays; without it each process judges by its own requests (an unload another process did not expect
costs it one reload).

Only pairs the gateway holds are unloaded (registered by it, or served where the engine listed the
adapter), and never one with a request in flight. One pass every `tick_s`; every load or unload runs
as its own task, at most one per (endpoint, adapter). A preload the engine refuses is tried again
after `retry_s`, not every pass. The task set is bounded by the policy's adapters x the fleet's
endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from backends.fleet import Fleet
from backends.lora import LoraAdapter
from backends.lora_discovery import LISTING_ENGINES
from backends.types import Endpoint, EndpointState
from gateway.transport.lora import AdapterLoader, Held, LoadFailed

log = logging.getLogger("tokenway.lora")

TICK_S = 1.0
RETRY_S = 30.0
UNLOADABLE = frozenset({EndpointState.READY, EndpointState.DRAINING})  # an engine that can answer the unload


class AdapterKeeper:
    def __init__(
        self,
        fleet: Fleet,
        loader: AdapterLoader,
        *,
        tick_s: float = TICK_S,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.loader = loader
        self.tick_s = tick_s
        self.retry_s = retry_s
        self.clock = clock
        self._tasks: dict[tuple[str, str], asyncio.Task[Any]] = {}
        self._retry_at: dict[tuple[str, str], float] = {}  # preloads refused: not before this time

    def hot(self) -> dict[str, frozenset[str]]:
        """Per pool with `lora_preload_hottest: N`, the N adapters of its model most in demand lately."""
        out: dict[str, frozenset[str]] = {}
        adapters = self.fleet.adapters
        for name, pool in self.fleet.pools.items():
            count = pool.config.lora_preload_hottest
            if count:
                mine = [a.name for a in adapters.values() if a.base_model == pool.config.model]
                out[name] = frozenset(self.loader.hottest(mine, count))
        return out

    def hot_on(self, endpoint: Endpoint) -> frozenset[str]:
        """The adapters the keeper keeps on `endpoint` for demand (its pool's `lora_preload_hottest`)."""
        pool = self.fleet.pools.get(endpoint.pool)
        count = pool.config.lora_preload_hottest if pool is not None else 0
        if pool is None or not count:
            return frozenset()
        mine = [a.name for a in self.fleet.adapters.values() if a.base_model == pool.config.model]
        return frozenset(self.loader.hottest(mine, count))

    def idle_after_s(self, held: Held, hot: dict[str, frozenset[str]] | None = None) -> float | None:
        """How long `held` may go unused before it is unloaded; None: never (preloaded, among its pool's
        hottest, unset, unknown)."""
        adapter = self.fleet.adapter(held.adapter)
        if adapter is None or adapter.preload or held.adapter in (hot or {}).get(held.endpoint.pool, ()):
            return None
        if adapter.idle_unload_s is not None:
            return adapter.idle_unload_s
        pool = self.fleet.pools.get(held.endpoint.pool)
        return pool.config.lora_idle_unload_s if pool is not None else None

    def tick(self) -> None:
        """One pass: start the preloads and idle unloads that are due."""
        now = self.clock()
        adapters = self.fleet.adapters
        for adapter in adapters.values():
            if adapter.preload:
                for endpoint in self._replicas(adapter):
                    self._preload(endpoint, adapter, now)
        hot = self.hot()
        for pool_name, names in hot.items():
            for endpoint in self.fleet.pools[pool_name].endpoints:
                if endpoint.state is EndpointState.READY and endpoint.engine in LISTING_ENGINES:
                    for name in names:
                        self._preload(endpoint, adapters[name], now)
        for held in self.loader.held():
            after = self.idle_after_s(held, hot)
            if after is None or held.inflight or held.endpoint.state not in UNLOADABLE:
                continue
            if now - self.loader.last_used(held) >= after:
                self._start((held.endpoint.id, held.adapter), self._unload(held.endpoint, held.adapter))

    def _replicas(self, adapter: LoraAdapter) -> list[Endpoint]:
        return [
            endpoint
            for pool in self.fleet.pools_for_model(adapter.base_model)
            for endpoint in pool.endpoints
            if endpoint.state is EndpointState.READY and endpoint.engine in LISTING_ENGINES
        ]

    def _preload(self, endpoint: Endpoint, adapter: LoraAdapter, now: float) -> None:
        key = (endpoint.id, adapter.name)
        if self.loader.holds(endpoint, adapter.name) or self.loader.loading(endpoint, adapter.name):
            return
        if now < self._retry_at.get(key, 0.0):
            return
        self._start(key, self._load(endpoint, adapter))

    async def _load(self, endpoint: Endpoint, adapter: LoraAdapter) -> None:
        key = (endpoint.id, adapter.name)
        try:
            await self.loader.ensure(endpoint, adapter, reason="preload")
        except LoadFailed as exc:
            self._retry_at[key] = self.clock() + self.retry_s
            log.warning("preload: %s", exc.message)
        else:
            self._retry_at.pop(key, None)
            log.info("preloaded the adapter %s on %s", adapter.name, endpoint.id)

    async def _unload(self, endpoint: Endpoint, adapter: str) -> None:
        if await self.loader.unload(endpoint, adapter):
            log.info("unloaded the idle adapter %s from %s", adapter, endpoint.id)

    def _start(self, key: tuple[str, str], work: Coroutine[Any, Any, Any]) -> None:
        if key in self._tasks:
            work.close()
            return
        task = asyncio.create_task(work, name=f"lora {key[1]} on {key[0]}")
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._tasks.pop(key, None))

    async def settled(self) -> None:
        """Wait for the loads and unloads in flight (a pass's work, for callers that tick by hand)."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def run(self) -> None:
        """Passes every `tick_s` until cancelled; the loads and unloads in flight are cancelled with it."""
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.tick_s)
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task


@contextlib.asynccontextmanager
async def keeping(keeper: AdapterKeeper) -> AsyncIterator[AdapterKeeper]:
    """Run `keeper.run` for the body's duration."""
    task = asyncio.create_task(keeper.run(), name="lora-keeper")
    try:
        yield keeper
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
