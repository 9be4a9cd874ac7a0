"""Discovery for the fleet's lifetime: one EndpointSlice watch per pool that asks for it, and each
burst of its events reconciled into the pool's endpoints on the event loop.

Reconciling a pool
------------------
Bring a pool's discovered endpoints in line with the addresses Kubernetes lists now.

An address that appears becomes an endpoint in STARTING: the active health check probes it and
only a passing probe makes it READY (nothing is routed to an endpoint that has not answered). An
address that goes away, or whose pod stops being ready, becomes DRAINING: routing skips it, the
requests already on it finish, and it leaves the pool once none is left (or after
`drain_timeout_s`). An address that comes back while draining starts over from STARTING.

Endpoint ids are `<pool>/<pod name>`, the same on every gateway replica (shared routing state is
keyed by them). A pod name seen again at a new address (a StatefulSet pod rescheduled) replaces
the draining old one in the pool at once; requests in flight on the old object still finish.

The service
-----------
Discovery for the fleet's lifetime: one EndpointSlice watch per pool that asks for it, folded
into the pool on the event loop.

The watch thread only delivers events; everything that touches the fleet runs here, on the loop,
between two awaits (routing reads the fleet synchronously and sees either the old set or the new).
Events that arrive together are applied together: one reconcile per burst, not per slice.
The slices held between bursts are bounded: only slices with a usable address are kept, and at
most HELD_PER_ENDPOINT (4) x `max_endpoints` addresses across them (a slice that would pass it is
left out, logged and counted in `slices_refused`). A burst that fails to apply (a bug) is logged
and the task goes on: discovery never ends while the gateway runs.
`on_change(pool)` runs after every change of a pool's endpoint list, so the gateway can drop
routing state of endpoints that left and admit new ones' metric labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.config import PoolConfig
from backends.discovery.slices import (
    Address,
    Delete,
    Failure,
    KubernetesDiscoveryConfig,
    NodeRacks,
    Reset,
    Slice,
    Upsert,
    WatchEvent,
    desired_addresses,
)
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, EndpointState, Topology

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Changes:
    added: list[Endpoint] = field(default_factory=list)
    draining: list[Endpoint] = field(default_factory=list)
    removed: list[Endpoint] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.draining or self.removed)


def topology_of(address: Address, racks: Mapping[str, str | None]) -> Topology:
    """The endpoint's labels: node and zone from its slice, the rack from its node's label."""
    rack = racks.get(address.node) if address.node is not None else None
    return Topology(node=address.node, rack=rack, zone=address.zone)


def endpoint_for(
    pool: PoolConfig, address: Address, config: KubernetesDiscoveryConfig, racks: Mapping[str, str | None] = {}
) -> Endpoint:
    kv_events = None
    if config.kv_events_port is not None:
        host = f"[{address.host}]" if ":" in address.host else address.host
        kv_events = f"tcp://{host}:{config.kv_events_port}"
    return Endpoint(
        id=f"{pool.name}/{address.name}",
        pool=pool.name,
        base_url=address.url,
        engine=pool.engine,
        served_model=pool.upstream_model,
        state=EndpointState.STARTING,
        api_key=pool.api_key,
        max_model_len=pool.max_model_len,
        kv_events_endpoint=kv_events,
        state_reason="discovered: waiting for its first health check",
        topology=topology_of(address, racks),
    )


def reconcile(
    pool: Pool,
    discovered: dict[str, Endpoint],
    wanted: dict[str, Address],
    config: KubernetesDiscoveryConfig,
    racks: Mapping[str, str | None] = {},
) -> Changes:
    """Apply `wanted` (by URL) to the pool. `discovered` (URL -> endpoint) is the reconciler's own
    record of what it added, updated in place; static and launched endpoints are never touched."""
    changes = Changes()
    for url, endpoint in discovered.items():
        if url not in wanted and endpoint.state is not EndpointState.DRAINING:
            endpoint.state = EndpointState.DRAINING
            endpoint.state_reason = "draining: no longer a ready address of its EndpointSlices"
            changes.draining.append(endpoint)
            log.info("discovery: %s (%s) left; draining", endpoint.id, url)
    for url, address in wanted.items():
        current = discovered.get(url)
        if current is not None:
            current.topology = topology_of(address, racks)  # a node's rack may be learnt after its pod
            if current.state is EndpointState.DRAINING:  # back before its drain ended
                current.state = EndpointState.STARTING
                current.state_reason = "discovered again: waiting for a health check"
                changes.added.append(current)
            continue
        endpoint = endpoint_for(pool.config, address, config, racks)
        for other_url, other in list(discovered.items()):
            if other.id == endpoint.id:  # same pod, new address: the old one is gone for good
                remove(pool, discovered, other_url)
                changes.removed.append(other)
        discovered[url] = endpoint
        pool.endpoints.append(endpoint)
        changes.added.append(endpoint)
        log.info("discovery: %s appeared at %s; health-checking before use", endpoint.id, url)
    return changes


def remove(pool: Pool, discovered: dict[str, Endpoint], url: str) -> Endpoint | None:
    endpoint = discovered.pop(url, None)
    if endpoint is not None:
        endpoint.state = EndpointState.DEAD
        endpoint.state_reason = "removed: left its EndpointSlices"
        pool.endpoints[:] = [e for e in pool.endpoints if e is not endpoint]
    return endpoint


DRAIN_POLL_S = 0.05
HELD_PER_ENDPOINT = 4  # addresses held across a pool's slices: at most this many times `max_endpoints`


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
        self.slices: dict[str, Slice] = {}  # name -> the slice, only those with a usable address
        self.refused_slices = 0  # slices left out because the pool held addresses up to its bound
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
            try:
                if self._fold(batch) and self.synced:
                    self._apply()
            except Exception:  # a bug must not end discovery: the next burst is applied afresh
                log.exception("discovery %s: applying %d events failed", self.pool.name, len(batch))

    def _fold(self, batch: list[WatchEvent]) -> bool:
        """Fold a burst of events into the slices held; whether anything changed."""
        touched = False
        for event in batch:
            if isinstance(event, Reset):
                self.slices = {}
                for found in sorted(event.slices, key=lambda s: s.name):
                    self._hold(found)
                self.synced, touched = True, True
                self.resets += 1
            elif isinstance(event, Upsert):
                touched = self._hold(event.slice) or touched
            elif isinstance(event, Delete):
                touched = self.slices.pop(event.name, None) is not None or touched
            elif isinstance(event, NodeRacks):
                self.racks.update(event.racks)
                touched = True
            elif isinstance(event, Failure):
                self.last_failure, self.last_failure_unix_s = event.reason, time.time()
        return touched

    def _hold(self, found: Slice) -> bool:
        """Keep `found` in place of its name's last version, unless the pool's slices would hold more
        than HELD_PER_ENDPOINT x `max_endpoints` addresses (refused, logged: the last version stays).
        A slice with no usable address is the same as none (dropped: it holds nothing)."""
        if not found.addresses:
            return self.slices.pop(found.name, None) is not None
        previous = self.slices.get(found.name)
        held = sum(len(s.addresses) for s in self.slices.values()) - (len(previous.addresses) if previous else 0)
        if held + len(found.addresses) > HELD_PER_ENDPOINT * self.config.max_endpoints:
            self.refused_slices += 1
            log.warning(
                "discovery %s: slice %s left out: the pool's slices would hold more than %d addresses",
                self.pool.name, found.name, HELD_PER_ENDPOINT * self.config.max_endpoints,
            )  # fmt: skip
            return False
        self.slices[found.name] = found
        return True

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
            "slices_refused": self.refused_slices,
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
