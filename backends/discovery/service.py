"""Discovery for the fleet's lifetime: one EndpointSlice watch per pool that asks for it, folded
into the pool on the event loop.

The watch thread only delivers events; everything that touches the fleet runs here, on the loop,
between two awaits (routing reads the fleet synchronously and sees either the old set or the new).
Events that arrive together are applied together: one reconcile per burst, not per slice.
`on_change(pool)` runs after every change of a pool's endpoint list, so the gateway can drop
routing state of endpoints that left and admit new ones' metric labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from backends.discovery.config import KubernetesDiscoveryConfig
from backends.discovery.reconcile import reconcile, remove
from backends.discovery.slices import (
    Delete,
    Failure,
    NodeRacks,
    Reset,
    Upsert,
    WatchEvent,
    desired_addresses,
    slice_name,
)
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, EndpointState

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class Watch(Protocol):
    def start(self) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


WatchFactory = Callable[[KubernetesDiscoveryConfig, Callable[[WatchEvent], None], str], Watch]


def kubernetes_watch(config: KubernetesDiscoveryConfig, deliver: Callable[[WatchEvent], None], name: str) -> Watch:
    try:
        from backends.discovery.kubernetes import SliceWatch  # the optional client, only when asked for
    except ImportError as exc:
        raise RuntimeError(
            f"pool {name!r} discovers endpoints in Kubernetes, which needs the kubernetes client: "
            "pip install 'tokenway[k8s]'"
        ) from exc

    return SliceWatch(config, deliver, name=name)


class PoolDiscovery:
    def __init__(
        self,
        pool: Pool,
        config: KubernetesDiscoveryConfig,
        on_change: Callable[[Pool], None],
        watch_factory: WatchFactory = kubernetes_watch,
    ) -> None:
        self.pool = pool
        self.config = config
        self.on_change = on_change
        self._watch_factory = watch_factory
        self.slices: dict[str, dict[str, Any]] = {}
        self.discovered: dict[str, Endpoint] = {}  # URL -> endpoint this discovery added
        self.racks: dict[str, str | None] = {}  # node -> rack label (`rack_label`), as the watch read it
        self.synced = False  # a first list arrived
        self.resets = 0
        self.last_failure: str | None = None
        self.last_failure_unix_s: float | None = None
        self._queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None
        self._drains: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def deliver(event: WatchEvent) -> None:  # called from the watch thread
            with contextlib.suppress(RuntimeError):  # the loop closed while the thread was reading
                loop.call_soon_threadsafe(self._queue.put_nowait, event)

        self._watch = self._watch_factory(self.config, deliver, self.pool.name)
        self._watch.start()
        self._task = loop.create_task(self._consume(), name=f"discovery {self.pool.name}")

    async def stop(self) -> None:
        if self._watch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._watch.stop)
        tasks = [t for t in (self._task, *self._drains.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _consume(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            touched = False
            for event in batch:
                if isinstance(event, Reset):
                    self.slices = {slice_name(s): s for s in event.slices}
                    self.synced, touched = True, True
                    self.resets += 1
                elif isinstance(event, Upsert):
                    self.slices[slice_name(event.slice)] = event.slice
                    touched = True
                elif isinstance(event, Delete):
                    touched = self.slices.pop(event.name, None) is not None or touched
                elif isinstance(event, NodeRacks):
                    self.racks.update(event.racks)
                    touched = True
                elif isinstance(event, Failure):
                    self.last_failure, self.last_failure_unix_s = event.reason, time.time()
            if touched and self.synced:
                self._apply()

    def _apply(self) -> None:
        wanted = desired_addresses(self.slices.values(), self.config)
        changes = reconcile(self.pool, self.discovered, wanted, self.config, self.racks)
        for endpoint in changes.draining:
            url = endpoint.base_url
            if url not in self._drains:
                self._drains[url] = asyncio.get_running_loop().create_task(self._drain(url, endpoint))
        for endpoint in changes.added:
            drain = self._drains.pop(endpoint.base_url, None)
            if drain is not None:
                drain.cancel()
        if changes:
            self.on_change(self.pool)

    async def _drain(self, url: str, endpoint: Endpoint) -> None:
        """Wait for the requests this gateway has on it to finish (bounded; other replicas drain their
        own), then let it go."""
        deadline_s = time.monotonic() + self.config.drain_timeout_s
        try:
            while endpoint.inflight.local_requests > 0 and time.monotonic() < deadline_s:  # noqa: ASYNC110
                await asyncio.sleep(DRAIN_POLL_S)
        finally:
            self._drains.pop(url, None)
        if self.discovered.get(url) is endpoint and endpoint.state is EndpointState.DRAINING:
            remove(self.pool, self.discovered, url)
            log.info("discovery: %s drained and removed", endpoint.id)
            self.on_change(self.pool)

    def status(self) -> dict[str, Any]:
        return {
            "pool": self.pool.name,
            "namespace": getattr(self._watch, "namespace", self.config.namespace),
            "selector": self.config.selector,
            "synced": self.synced,
            "slices": len(self.slices),
            "endpoints": {e.id: e.state.value for e in self.discovered.values()},
            "relists": max(self.resets - 1, 0),
            "last_failure": self.last_failure,
            "last_failure_unix_s": self.last_failure_unix_s,
        }


class Discovery:
    """Every pool's discovery; `start` / `stop` with the fleet."""

    def __init__(self, pools: list[PoolDiscovery]) -> None:
        self.pools = pools

    @classmethod
    def for_fleet(
        cls, fleet: Fleet, on_change: Callable[[Pool], None], watch_factory: WatchFactory = kubernetes_watch
    ) -> Discovery:
        found = []
        for pool in fleet.pools.values():
            discovery = pool.config.discovery
            if discovery is not None:
                found.append(PoolDiscovery(pool, discovery.kubernetes, on_change, watch_factory))
        return cls(found)

    async def start(self) -> None:
        for pool in self.pools:
            await pool.start()

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.pools), return_exceptions=True)

    def status(self) -> list[dict[str, Any]]:
        return [p.status() for p in self.pools]
