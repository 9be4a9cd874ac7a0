"""Gateway-driven LoRA loading: an adapter is registered on a replica the first time a request for it
goes there, through the engine's `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`, vLLM's
runtime adapter API: docs.vllm.ai, "LoRA Adapters"), and unregistered through
`POST /v1/unload_lora_adapter` (`{"lora_name"}`) when the keeper (below) finds it idle.
The engine keeps its own LRU of `max_loras` GPU slots; registration is what the gateway does
(docs/adapters.md).

What an engine holds is known two ways: what this loader registered, and what the engine lists in
`/v1/models` (`Endpoint.loras`, backends/scrape.py). A listed adapter is not loaded again; one
registered before the engine's last listing and absent from it was lost (a restart, the engine's own
unload) and is loaded again.

One load per (endpoint, adapter) at a time: concurrent first requests await the same load. A load is
bounded by `timeout_s`, so a slow or dead engine fails the request, never hangs it. The answer:
`LoadFailed(status, message)`: the engine refused (4xx: the adapter is wrong everywhere) or did not
answer (status 0: that endpoint's fault), the message naming the adapter.

Each pair the gateway holds carries its last use and its requests in flight, so the keeper unloads
only an adapter nobody is using. Events (`load`, `preload`, `load_failed`, `unload`, `evict`, `lost`)
go to `on_event(adapter, event)`: the metrics' per-adapter counters; per replica they are counted in
`activity` too (the console's adapter view, and the autoscaler's adapter demand: on-demand loads per
pool, `pool_loads`). With `state: redis` the uses, demand and loads are shared with the fleet's other
gateway processes (`share`, `lora_shared.py`): the idle unload and the budget's LRU order read the
fleet-wide last use (`last_used`).

A pool's memory budget (`lora_memory_budget_mb`, `budget_of`): before a load that would take the
adapters registered on a replica (those the gateway holds there, and those the engine lists) over it,
the least recently used adapters the gateway holds there with no request in flight and not
`preload: true` are unloaded (event `evict`; a pool's hottest, which the keeper preloads, last) until
it fits, as the engine's LRU evicts for `max_loras`. When what is left (in use, preloaded, or the
engine's own) leaves too little room, the load fails as that endpoint's fault (status 0), so the
request tries another replica. An adapter larger than the whole budget never reaches here: the
dispatch answers 400 (`backends.fleet.too_large`).

The adapter keeper
------------------

The keeper preloads the adapters marked `preload: true` (and a pool's hottest) and
unloads idle ones.

Loading on first demand (above) makes the first request for an adapter on a replica pay the
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
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from backends.fleet import DEFAULT_ADAPTER_BYTES, MB, Fleet, LoraAdapter, budget_bytes
from backends.scrape import LISTING_ENGINES
from backends.types import Endpoint, EndpointState
from gateway.upstream.client import UpstreamClient

# ---- Loading and unloading adapters

MAX_REGISTERED = 65_536  # (endpoint, adapter) pairs remembered; the policy's names, not client input
DEMAND_HALF_LIFE_S = 600.0  # recent demand per adapter (the keeper's hottest-N preloads) halves in this

EventSink = Callable[[str, str], None]
BudgetOf = Callable[[Endpoint], int | None]  # an endpoint's LoRA memory budget in bytes (None: none)
AdapterOf = Callable[[str], LoraAdapter | None]  # the policy's adapter by name


def _no_event(adapter: str, event: str) -> None:
    return None


def _no_budget(endpoint: Endpoint) -> int | None:
    return None


def _no_adapter(name: str) -> LoraAdapter | None:
    return None


def _none_kept(endpoint: Endpoint) -> frozenset[str]:
    return frozenset()


class AdapterShare(Protocol):
    """Adapter activity shared with the fleet's other gateway processes (`lora_shared.py`): told of this
    process's uses and loads (no I/O: it batches them), asked for the fleet-wide last use."""

    def begun(self, endpoint: Endpoint, adapter: str) -> None: ...

    def ended(self, endpoint: Endpoint, adapter: str) -> None: ...

    def loaded(self, endpoint: Endpoint) -> None: ...

    def last_used_s(self, endpoint: Endpoint, adapter: str) -> float | None: ...

    def fleet_activity(self, endpoint: Endpoint) -> ReplicaActivity | None: ...


ACTIVITY_KINDS = ("loads", "preloads", "evictions", "unloads", "failures")  # ReplicaActivity's counters


@dataclass(slots=True)
class ReplicaActivity:
    """What the gateway did with adapters on one replica since it started (monotonic counters)."""

    pool: str
    loads: int = 0  # on first demand
    preloads: int = 0  # by the keeper
    evictions: int = 0  # unloaded to fit the pool's memory budget
    unloads: int = 0  # unloaded for idleness
    failures: int = 0  # loads the engine refused or did not answer


class LoadFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Held:
    """One adapter on one endpoint, as the gateway knows it."""

    endpoint: Endpoint
    adapter: str
    registered_at_s: float  # monotonic: when the gateway registered it, or first served it there
    last_used_s: float  # monotonic: a request for it began or ended there
    inflight: int = 0  # its requests on that endpoint now


class AdapterLoader:
    def __init__(
        self,
        upstream: UpstreamClient,
        timeout_s: float = 30.0,
        *,
        on_event: EventSink = _no_event,
        clock: Callable[[], float] = time.monotonic,
        budget_of: BudgetOf = _no_budget,
        adapter_of: AdapterOf = _no_adapter,
    ) -> None:
        self.upstream = upstream
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.clock = clock
        self.budget_of = budget_of
        self.adapter_of = adapter_of
        self.activity: dict[str, ReplicaActivity] = {}  # endpoint id -> counters (the fleet's endpoints)
        # adapters the keeper keeps on an endpoint (its pool's hottest): evicted for the budget last
        self.kept: Callable[[Endpoint], frozenset[str]] = _none_kept
        self._registered: OrderedDict[tuple[str, str], Held] = OrderedDict()
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.loads = 0
        self.failures = 0
        self.unloads = 0
        self._demand: dict[str, tuple[float, float]] = {}  # adapter -> (decayed requests, as of when)
        self.share: AdapterShare | None = None  # with `state: redis`: the other processes' uses and loads

    def registered(self, endpoint: Endpoint, adapter: str) -> bool:
        """Whether the gateway holds `adapter` on `endpoint` (registered it, or served it where listed)."""
        return (endpoint.id, adapter) in self._registered

    def holds(self, endpoint: Endpoint, adapter: str) -> bool:
        """Whether `adapter` is on `endpoint` as far as anyone knows: registered here or listed there."""
        listed = endpoint.loras
        return self._fresh((endpoint.id, adapter), endpoint) or (listed is not None and adapter in listed)

    def loading(self, endpoint: Endpoint, adapter: str) -> bool:
        return (endpoint.id, adapter) in self._loading

    def held(self) -> Iterator[Held]:
        """The pairs the gateway holds (a snapshot: the caller may unload while iterating)."""
        return iter(list(self._registered.values()))

    async def ensure(self, endpoint: Endpoint, adapter: LoraAdapter, *, reason: str = "load") -> None:
        """Register `adapter` on `endpoint` unless it is already; LoadFailed when the engine cannot.
        `reason` names the event a load counts as (`load` on demand, `preload` by the keeper)."""
        key = (endpoint.id, adapter.name)
        if self._fresh(key, endpoint):
            return
        listed = endpoint.loras
        if listed is not None and adapter.name in listed:  # the engine holds it already (discovery)
            self._remember(key, endpoint, adapter.name)
            return
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loading[key] = pending
            try:
                await self._make_room(endpoint, adapter)
                await self._load(endpoint, adapter, reason)
            except LoadFailed as exc:
                self.failures += 1
                self._activity(endpoint).failures += 1
                self.on_event(adapter.name, "load_failed")
                pending.set_exception(exc)
                pending.exception()  # retrieved: the waiters (if any) re-raise it
                raise
            finally:
                self._loading.pop(key, None)
            self._remember(key, endpoint, adapter.name)
            pending.set_result(None)
            return
        await asyncio.shield(pending)

    def begin(self, endpoint: Endpoint, adapter: str) -> None:
        """A request for `adapter` starts on `endpoint`: the keeper leaves the pair alone meanwhile, and
        the adapter's recent demand grows by one."""
        now = self.clock()
        self.add_demand(adapter, 1.0)
        held = self._registered.get((endpoint.id, adapter))
        if held is not None:
            held.inflight += 1
            held.last_used_s = now
        if self.share is not None:
            self.share.begun(endpoint, adapter)

    def add_demand(self, adapter: str, count: float) -> None:
        """`count` requests for `adapter` now: this process's (`begin`), or the other processes' as the
        shared state reports them."""
        now = self.clock()
        value, at = self._demand.get(adapter, (0.0, now))
        if adapter in self._demand or len(self._demand) < MAX_REGISTERED:
            self._demand[adapter] = (value * 0.5 ** ((now - at) / DEMAND_HALF_LIFE_S) + count, now)

    def last_used(self, held: Held) -> float:
        """When `held` was last used (monotonic): here, or by any gateway process sharing state with this
        one (the idle unload and the memory budget's LRU order judge by the fleet's uses)."""
        shared = self.share.last_used_s(held.endpoint, held.adapter) if self.share is not None else None
        return held.last_used_s if shared is None else max(held.last_used_s, shared)

    def hottest(self, names: Iterable[str], count: int) -> list[str]:
        """The `count` adapters among `names` with the most recent demand (none without any)."""
        now = self.clock()
        scored = []
        for name in names:
            found = self._demand.get(name)
            if found is not None:
                scored.append((found[0] * 0.5 ** ((now - found[1]) / DEMAND_HALF_LIFE_S), name))
        scored.sort(key=lambda item: (-item[0], item[1]))
        return [name for _value, name in scored[:count]]

    def end(self, endpoint: Endpoint, adapter: str) -> None:
        held = self._registered.get((endpoint.id, adapter))
        if held is not None:
            held.inflight = max(held.inflight - 1, 0)
            held.last_used_s = self.clock()
        if self.share is not None:
            self.share.ended(endpoint, adapter)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint restarted or left: its adapters must be loaded again."""
        for key in [k for k in self._registered if k[0] == endpoint_id]:
            del self._registered[key]

    def lost(self, endpoint: Endpoint, adapter: str) -> None:
        """The engine answered that it does not hold `adapter` (a 404): forget it everywhere we look,
        the engine's last listing included, so the next request loads it again."""
        self.forget(endpoint.id)
        if endpoint.loras is not None and adapter in endpoint.loras:
            endpoint.loras = endpoint.loras - {adapter}
        self.on_event(adapter, "lost")

    def pool_loads(self, pool: str) -> int:
        """On-demand loads on `pool`'s replicas since start (the autoscaler's adapter demand)."""
        return sum(a.loads for a in self.activity.values() if a.pool == pool)

    def held_on(self, endpoint_id: str) -> list[Held]:
        """The adapters the gateway holds on one endpoint, least recently used first."""
        return sorted((h for h in self._registered.values() if h.endpoint.id == endpoint_id), key=self.last_used)

    async def unload(self, endpoint: Endpoint, adapter: str, *, reason: str = "unload") -> bool:
        """Unregister `adapter` from `endpoint` (vLLM's `/v1/unload_lora_adapter`); True when the engine no
        longer holds it (unloaded now, or already gone: vLLM answers 404 for a name it does not know).
        `reason`: `unload` (idle, the keeper) or `evict` (to fit the memory budget)."""
        key = (endpoint.id, adapter)
        held = self._registered.get(key)
        if held is not None and held.inflight:
            return False
        body = orjson.dumps({"lora_name": adapter})
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.upstream.post(
                    endpoint.base_url + "/v1/unload_lora_adapter", _headers(endpoint), body
                )
                await response.read()
                response.release()
        except Exception:  # no answer: try again on a later pass
            return False
        if response.status not in (200, 404):
            return False
        # a request that began meanwhile meets the engine's 404 and is sent again (`lost`): it reloads
        self._registered.pop(key, None)
        if endpoint.loras is not None and adapter in endpoint.loras:
            endpoint.loras = endpoint.loras - {adapter}
        self.unloads += 1
        counts = self._activity(endpoint)
        if reason == "evict":
            counts.evictions += 1
        else:
            counts.unloads += 1
        self.on_event(adapter, reason)
        return True

    def _activity(self, endpoint: Endpoint) -> ReplicaActivity:
        found = self.activity.get(endpoint.id)
        if found is None:
            found = ReplicaActivity(endpoint.pool)
            if len(self.activity) < MAX_REGISTERED:
                self.activity[endpoint.id] = found
        return found

    def _size(self, name: str) -> int:
        adapter = self.adapter_of(name)
        return adapter.size_bytes if adapter is not None and adapter.size_bytes else DEFAULT_ADAPTER_BYTES

    async def _make_room(self, endpoint: Endpoint, adapter: LoraAdapter) -> None:
        """Unload the least recently used idle adapters the gateway holds on `endpoint` until `adapter`
        fits the pool's memory budget; LoadFailed (status 0: this endpoint's) when it cannot."""
        budget = self.budget_of(endpoint)
        if budget is None:
            return
        need = adapter.size_bytes or DEFAULT_ADAPTER_BYTES
        kept = self.kept(endpoint)
        # least recently used first, the pool's hottest (the keeper would preload them again) last
        held = sorted(
            (h for h in self.held_on(endpoint.id) if h.adapter != adapter.name), key=lambda h: h.adapter in kept
        )
        mine = {h.adapter for h in held}
        others = (endpoint.loras or frozenset()) - mine - {adapter.name}  # the engine's own: not ours to unload
        used = sum(self._size(h.adapter) for h in held) + sum(self._size(name) for name in others)
        for victim in held:
            if used + need <= budget:
                return
            if self._registered.get((endpoint.id, victim.adapter)) is not victim:  # gone meanwhile (another load)
                used -= self._size(victim.adapter)
                continue
            policy = self.adapter_of(victim.adapter)
            if victim.inflight or (policy is not None and policy.preload):
                continue
            if await self.unload(endpoint, victim.adapter, reason="evict"):
                used -= self._size(victim.adapter)
        if used + need > budget:
            raise LoadFailed(
                0,
                f"The adapter '{adapter.name}' ({need / MB:g} MB) does not fit the LoRA memory budget of "
                f"{endpoint.id} ({budget / MB:g} MB): {used / MB:g} MB are held by adapters in use or kept there",
            )

    def _fresh(self, key: tuple[str, str], endpoint: Endpoint) -> bool:
        """Registered here, and not contradicted by a listing the engine sent after registering it."""
        held = self._registered.get(key)
        if held is None:
            return False
        listed = endpoint.loras
        if listed is not None and key[1] not in listed and endpoint.loras_at_s > held.registered_at_s:
            del self._registered[key]  # lost since (a restart, the engine's own unload)
            self.on_event(key[1], "lost")
            return False
        return True

    def _remember(self, key: tuple[str, str], endpoint: Endpoint, adapter: str) -> None:
        now = self.clock()
        self._registered[key] = Held(endpoint, adapter, now, now)
        while len(self._registered) > MAX_REGISTERED:
            self._registered.popitem(last=False)

    async def _load(self, endpoint: Endpoint, adapter: LoraAdapter, reason: str) -> None:
        body = orjson.dumps({"lora_name": adapter.name, "lora_path": adapter.source})
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.upstream.post(
                    endpoint.base_url + "/v1/load_lora_adapter", _headers(endpoint), body
                )
                text = await response.read()
                response.release()
        except Exception as exc:  # no answer: refused, reset, timed out (the client's own errors included)
            raise LoadFailed(0, f"The adapter '{adapter.name}' could not be loaded on {endpoint.id}: {exc!r}") from None
        self.loads += 1
        if response.status == 200 or _already_loaded(response.status, text):
            counts = self._activity(endpoint)
            if reason == "preload":
                counts.preloads += 1
            else:
                counts.loads += 1
                if self.share is not None:
                    self.share.loaded(endpoint)
            self.on_event(adapter.name, reason)
            return
        detail = _message(text)
        raise LoadFailed(
            response.status, f"The adapter '{adapter.name}' could not be loaded ({response.status}): {detail}"
        )


def fleet_budget(fleet: Fleet) -> BudgetOf:
    """Each endpoint's budget from its pool's `lora_memory_budget_mb`, read at each load (a reload's
    pools are the fleet's)."""

    def budget_of(endpoint: Endpoint) -> int | None:
        pool = fleet.pools.get(endpoint.pool)
        return budget_bytes(pool.config.lora_memory_budget_mb) if pool is not None else None

    return budget_of


def _headers(endpoint: Endpoint) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    return headers


def _already_loaded(status: int, text: bytes) -> bool:
    """vLLM answers 400 "has already been loaded" to a second load of the same name: that is success."""
    return status == 400 and b"already been loaded" in text


def _message(text: bytes) -> str:
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text[:300].decode("utf-8", "replace")
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:300]
    return text[:300].decode("utf-8", "replace")


# ---- The adapter keeper

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
