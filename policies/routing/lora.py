"""LoRA adapter affinity: which replica should serve a request for an adapter.

A replica of the base model serves an adapter in one of four states (docs/adapters.md):

- **active**: the adapter is on its GPU: the engine reports it among its running or waiting requests'
  adapters (vLLM's `vllm:lora_requests_info`), or this router sent it there recently enough that the
  engine's LRU of `max_loras` slots still holds it (`AdapterResidency`);
- **registered**: the engine lists it in `/v1/models` (`Endpoint.loras`, backends/lora_discovery.py)
  but nothing says it is on the GPU: no registration is needed, at most a load from host memory;
- **free**: fewer adapters than slots are held: it loads without evicting anyone;
- **evict**: every slot is held, some by idle adapters: it loads after evicting one (its cost is the
  predicted load time, size / bandwidth);
- **full**: every slot is pinned by running requests' adapters: the engine cannot batch it until one
  finishes (vLLM's scheduler skips it meanwhile).

`lora-affinity` scores those states (llm-d's adapter affinity scores active / has room / otherwise as
1.0 / 0.8 / 0.6 from the engines' metrics alone: `track_dispatches: false`, `load_cost_s: 0` is it);
`lora-slots` drops the full replicas. A request for a base model scores every replica alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from backends.lora import LoraAdapter
from backends.types import Endpoint
from policies.routing.types import Candidate, RouteContext

AdapterState = Literal["active", "registered", "free", "evict", "full"]
DEFAULT_SLOTS = 8  # a replica's slots when its metrics do not say (vLLM's --max-loras default is 1)
DEFAULT_ADAPTER_BYTES = 64 * 1024 * 1024  # an adapter whose policy entry gives no size
MAX_TRACKED_ENDPOINTS = 65_536  # bound of the residency table (endpoints, not client input)


class AdapterResidency:
    """What the router sent where: per endpoint, the adapters of its last dispatches, most recent
    last, at most as many as the endpoint has slots (what an LRU of that size would hold).

    Bounded: one entry per endpoint (the fleet's, capped), each at most `slots` adapter names, and the
    names come from the policy (a request naming anything else never routes as an adapter)."""

    def __init__(self, default_slots: int = DEFAULT_SLOTS) -> None:
        self.default_slots = default_slots
        self._held: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def slots(self, endpoint: Endpoint) -> int:
        return endpoint.stats.max_loras or self.default_slots

    def record(self, endpoint: Endpoint, adapter: str) -> None:
        held = self._held.get(endpoint.id)
        if held is None:
            held = self._held[endpoint.id] = OrderedDict()
            while len(self._held) > MAX_TRACKED_ENDPOINTS:
                self._held.popitem(last=False)
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.slots(endpoint):
            held.popitem(last=False)

    def held(self, endpoint: Endpoint) -> Sequence[str]:
        found = self._held.get(endpoint.id)
        return tuple(found) if found else ()

    def forget(self, endpoint_id: str) -> None:
        self._held.pop(endpoint_id, None)


def adapter_state(
    endpoint: Endpoint, adapter: str, residency: AdapterResidency | None, default_slots: int = DEFAULT_SLOTS
) -> AdapterState:
    """Where `endpoint` stands for serving `adapter` (see the module's docstring)."""
    stats = endpoint.stats
    busy = stats.running_loras | stats.waiting_loras
    tracked = residency.held(endpoint) if residency is not None else ()
    if adapter in busy or adapter in tracked:
        return "active"
    slots = stats.max_loras or (residency.default_slots if residency is not None else default_slots)
    if endpoint.loras is not None and adapter in endpoint.loras:
        return "full" if len(stats.running_loras) >= slots else "registered"
    held = len(busy.union(tracked))
    if held < slots:
        return "free"
    if len(stats.running_loras) >= slots:
        return "full"
    return "evict"


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
    consumes: ClassVar[tuple[str, ...]] = ("stats.loras",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        adapter = ctx.adapter
        if adapter is None:
            return [1.0] * len(candidates)
        residency = ctx.residency if self.track_dispatches else None
        out: list[float] = []
        for c in candidates:
            state = adapter_state(c.endpoint, adapter.name, residency)
            if state == "evict":
                out.append(
                    self.evict / (1.0 + self._load_s(adapter) / self.load_cost_s)
                    if self.load_cost_s > 0
                    else self.evict
                )
            else:
                out.append(getattr(self, state))
        return out

    def _load_s(self, adapter: LoraAdapter) -> float:
        return adapter.load_s(self.bandwidth_gbps * 1e9, DEFAULT_ADAPTER_BYTES)


@dataclass(frozen=True, slots=True)
class LoraSlotsFilter:
    """Drops the replicas whose every adapter slot is pinned by running requests of other adapters
    (they would queue the request until one finishes); `track_dispatches` as the scorer's."""

    track_dispatches: bool = True
    consumes: ClassVar[tuple[str, ...]] = ("stats.loras",)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        adapter = ctx.adapter
        if adapter is None:
            return list(candidates)
        residency = ctx.residency if self.track_dispatches else None
        return [c for c in candidates if adapter_state(c.endpoint, adapter.name, residency) != "full"]
