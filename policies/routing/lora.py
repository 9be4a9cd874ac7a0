"""LoRA adapter affinity: which replica should serve a request for an adapter.

A replica of the base model serves an adapter in one of four states (docs/adapters.md):

- **active**: the adapter is on its GPU: the engine reports it among its running or waiting requests'
  adapters (vLLM's `vllm:lora_requests_info`), or this router sent it there recently enough that the
  engine's LRU of `max_loras` slots still holds it (`AdapterResidency`);
- **registered**: the engine lists it in `/v1/models` (`Endpoint.loras`, backends/scrape.py)
  but nothing says it is on the GPU: no registration is needed, at most a load from host memory;
- **free**: fewer adapters than slots are held, and the adapter fits the pool's memory budget
  (`lora_memory_budget_mb`) beside those registered there: it loads without evicting anyone;
- **evict**: every slot is held, some by idle adapters, or the adapter would take the replica over its
  memory budget: it loads after evicting (its cost is the predicted load time, size / bandwidth);
- **full**: every slot is pinned by running requests' adapters, or those adapters leave less of the
  budget than it needs: the engine cannot batch it until one finishes (vLLM's scheduler skips it
  meanwhile; the gateway cannot unload an adapter in use).

An adapter's size is its policy entry's (`LoraAdapter.size_bytes`, learnt by the residency at each
dispatch), `DEFAULT_ADAPTER_BYTES` for one this router never sent anywhere.

`lora-affinity` scores those states (llm-d's adapter affinity scores active / has room / otherwise as
1.0 / 0.8 / 0.6 from the engines' metrics alone: `track_dispatches: false`, `load_cost_s: 0` is it);
`lora-slots` drops the full replicas. A request for a base model scores every replica alike.

Victim-aware loads: a load evicts the engine's least recently used idle adapter, and evicting one in
demand costs a second load soon. The residency mirrors each replica's LRU order from the dispatches
and keeps a decayed count of each adapter's requests (its demand), so `evict` is scaled by the chance
that the replica's victim goes unrequested for `victim_horizon_s`: a one-off adapter's load goes where
it evicts another one-off adapter rather than a popular one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from backends.fleet import DEFAULT_ADAPTER_BYTES, LoraAdapter
from backends.types import Endpoint
from policies.routing.types import Candidate, RouteContext

AdapterState = Literal["active", "registered", "free", "evict", "full"]
DEFAULT_SLOTS = 8  # a replica's slots when its metrics do not say (vLLM's --max-loras default is 1)
MAX_TRACKED_ENDPOINTS = 65_536  # bound of the residency table (endpoints, not client input)
DEMAND_HALF_LIFE_S = 60.0  # an adapter's demand estimate halves in this long without requests


class AdapterResidency:
    """What the router sent where: per endpoint, the adapters of its last dispatches, most recent
    last, at most as many as the endpoint has slots (what an LRU of that size would hold).

    Bounded: one entry per endpoint (the fleet's, capped), each at most `slots` adapter names, and the
    names come from the policy (a request naming anything else never routes as an adapter)."""

    def __init__(self, default_slots: int = DEFAULT_SLOTS, demand_half_life_s: float = DEMAND_HALF_LIFE_S) -> None:
        self.default_slots = default_slots
        self.demand_half_life_s = demand_half_life_s
        self._held: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._sizes: dict[str, int] = {}  # adapter -> bytes, learnt at dispatch (the policy's names)
        self._demand: dict[str, tuple[float, float]] = {}  # adapter -> (decayed count, as of when)

    def slots(self, endpoint: Endpoint) -> int:
        return endpoint.stats.max_loras or self.default_slots

    def record(
        self, endpoint: Endpoint, adapter: str, size_bytes: int | None = None, now_s: float | None = None
    ) -> None:
        """`adapter` was dispatched to `endpoint` (at `now_s`: counted in its demand; None: not)."""
        if size_bytes is not None and (adapter in self._sizes or len(self._sizes) < MAX_TRACKED_ENDPOINTS):
            self._sizes[adapter] = size_bytes
        if now_s is not None and (adapter in self._demand or len(self._demand) < MAX_TRACKED_ENDPOINTS):
            self._demand[adapter] = (self.demand(adapter, now_s) + 1.0, now_s)
        held = self._held.get(endpoint.id)
        if held is None:
            held = self._held[endpoint.id] = OrderedDict()
            while len(self._held) > MAX_TRACKED_ENDPOINTS:
                self._held.popitem(last=False)
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.slots(endpoint):
            held.popitem(last=False)

    def add_demand(self, adapter: str, count: float, now_s: float) -> None:
        """`count` requests for `adapter` at `now_s` that this router did not dispatch: the other gateway
        processes', as the shared state reports them (gateway/transport/lora_shared.py)."""
        if adapter in self._demand or len(self._demand) < MAX_TRACKED_ENDPOINTS:
            self._demand[adapter] = (self.demand(adapter, now_s) + count, now_s)

    def size_of(self, adapter: str) -> int:
        """Bytes of `adapter` as last dispatched (`DEFAULT_ADAPTER_BYTES` when never, or unknown)."""
        return self._sizes.get(adapter, DEFAULT_ADAPTER_BYTES)

    def demand(self, adapter: str, now_s: float) -> float:
        """`adapter`'s requests, each weighing half as much every `demand_half_life_s` since it came
        (0 for one never dispatched): which adapters an eviction would cost a reload soon."""
        found = self._demand.get(adapter)
        if found is None:
            return 0.0
        count, at = found
        return count * math.exp2(-max(now_s - at, 0.0) / self.demand_half_life_s)

    def victim(self, endpoint: Endpoint) -> str | None:
        """The adapter the engine's LRU would evict next on `endpoint` as far as this router knows: the
        least recently dispatched one not among its running or waiting requests' adapters, when every
        slot is held (None: a slot is free, or nothing known is idle)."""
        held = self._held.get(endpoint.id)
        if not held:
            return None
        stats = endpoint.stats
        busy = stats.running_loras | stats.waiting_loras
        if len(held.keys() | busy) < self.slots(endpoint):
            return None
        return next((name for name in held if name not in busy), None)

    def held(self, endpoint: Endpoint) -> Sequence[str]:
        found = self._held.get(endpoint.id)
        return tuple(found) if found else ()

    def forget(self, endpoint_id: str) -> None:
        self._held.pop(endpoint_id, None)


def adapter_state(
    endpoint: Endpoint,
    adapter: str,
    residency: AdapterResidency | None,
    default_slots: int = DEFAULT_SLOTS,
    *,
    budget_bytes: int | None = None,
    size_bytes: int | None = None,
) -> AdapterState:
    """Where `endpoint` stands for serving `adapter` (see the module's docstring); `budget_bytes` is its
    pool's LoRA memory budget (None: slots alone), `size_bytes` the adapter's (None: the default)."""
    stats = endpoint.stats
    busy = stats.running_loras | stats.waiting_loras
    tracked = residency.held(endpoint) if residency is not None else ()
    if adapter in busy or adapter in tracked:
        return "active"
    slots = stats.max_loras or (residency.default_slots if residency is not None else default_slots)
    listed = endpoint.loras
    if listed is not None and adapter in listed:
        return "full" if len(stats.running_loras) >= slots else "registered"
    held = busy.union(tracked)
    over = pinned = False
    if budget_bytes is not None:
        need = size_bytes if size_bytes is not None else DEFAULT_ADAPTER_BYTES
        size_of = residency.size_of if residency is not None else _default_size
        over = sum(size_of(name) for name in held.union(listed or ())) + need > budget_bytes
        pinned = sum(size_of(name) for name in stats.running_loras) + need > budget_bytes
    if len(held) < slots and not over:
        return "free"
    if len(stats.running_loras) >= slots or pinned:
        return "full"
    return "evict"


def _default_size(adapter: str) -> int:
    return DEFAULT_ADAPTER_BYTES


@dataclass(frozen=True, slots=True)
class LoraAffinityScorer:
    """Scores a replica by the adapter's state there; `evict` is discounted by the predicted load time
    (`evict / (1 + load_s / load_cost_s)`, off at `load_cost_s: 0`). `track_dispatches: false` reads
    the engines' metrics alone (llm-d's behaviour). Range: `full`..`active` (0..1 by default); a
    request for a base model scores 1 everywhere."""

    active: float = 1.0
    registered: float = 0.9
    free: float = 0.8
    evict: float = 0.6
    full: float = 0.0
    load_cost_s: float = 0.1  # the load time that halves the `evict` score
    bandwidth_gbps: float = 1.0  # GB/s at which an adapter loads (the predicted load time)
    track_dispatches: bool = True
    victim_horizon_s: float = 10.0  # `evict` x P(the LRU victim goes unrequested this long); 0: off
    consumes: ClassVar[tuple[str, ...]] = ("stats.loras",)

    def __post_init__(self) -> None:
        if self.victim_horizon_s < 0:
            raise ValueError("victim_horizon_s must be >= 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        adapter = ctx.adapter
        if adapter is None:
            return [1.0] * len(candidates)
        residency = ctx.residency if self.track_dispatches else None
        evict = self.evict / (1.0 + self._load_s(adapter) / self.load_cost_s) if self.load_cost_s > 0 else self.evict
        out: list[float] = []
        for c in candidates:
            state = adapter_state(
                c.endpoint, adapter.name, residency, budget_bytes=ctx.lora_budget_bytes, size_bytes=adapter.size_bytes
            )
            if state == "evict":
                out.append(evict * self._spared(residency, c.endpoint, ctx.now_s))
            else:
                out.append(getattr(self, state))
        return out

    def _spared(self, residency: AdapterResidency | None, endpoint: Endpoint, now_s: float) -> float:
        """The chance that the adapter this load evicts on `endpoint` (the engine's LRU victim, as the
        router's residency mirrors it) is not asked for within `victim_horizon_s`, its demand taken as
        a Poisson rate: a load that evicts a hot adapter costs a second load soon, one that evicts a
        tail adapter does not. 1 when off, untracked, or no victim is known."""
        if residency is None or self.victim_horizon_s <= 0:
            return 1.0
        victim = residency.victim(endpoint)
        if victim is None:
            return 1.0
        rate = residency.demand(victim, now_s) * math.log(2) / residency.demand_half_life_s
        return math.exp(-rate * self.victim_horizon_s)

    def _load_s(self, adapter: LoraAdapter) -> float:
        return adapter.load_s(self.bandwidth_gbps * 1e9, DEFAULT_ADAPTER_BYTES)


@dataclass(frozen=True, slots=True)
class LoraSlotsFilter:
    """Drops the replicas whose every adapter slot is pinned by running requests of other adapters, or
    whose running adapters leave less of the pool's memory budget than the adapter needs (they would
    queue the request until one finishes); `track_dispatches` as the scorer's."""

    track_dispatches: bool = True
    consumes: ClassVar[tuple[str, ...]] = ("stats.loras",)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        adapter = ctx.adapter
        if adapter is None:
            return list(candidates)
        residency = ctx.residency if self.track_dispatches else None
        budget = ctx.lora_budget_bytes
        return [
            c
            for c in candidates
            if adapter_state(c.endpoint, adapter.name, residency, budget_bytes=budget, size_bytes=adapter.size_bytes)
            != "full"
        ]
