"""The prefix index routing consults (who caches which prompt prefix): precise where an engine's
events are alive, approximate elsewhere; and the approximate index itself.

In `precise` mode both indexes are kept: the approximate one is recorded at every dispatch (cheap),
so when an endpoint's events stop (or never start) its answers take over with warm data. In
`approximate` mode only the approximate index exists; `off` answers 0 everywhere.

Approximate index: what the gateway itself sent where, no engine cooperation needed.

At dispatch the request's block keys are recorded for the chosen endpoint (both legs in PD) in one
bounded LRU per endpoint, sized from the engine's reported KV capacity (`num_gpu_blocks` x
`block_size` tokens) or `default_capacity_tokens`, capped by `max_capacity_tokens`. Keys are inserted
last-block-first, so a prompt's head is the most recently used part and evicted last, as vLLM frees
a request's blocks tail first. Memory is bounded by (endpoints x capacity) entries and reported.

Tiers: an endpoint whose pool offloads KV below HBM (`offload_tokens_of(pool)` > 0, the pool's
`routing.kv_tiers.offload_capacity_tokens`) keeps a second LRU of that size: blocks pushed out of the
HBM-sized LRU move there (as an offloading engine moves evicted blocks to host DRAM) and count as
`cpu` tier hits until they leave it too; a dispatch that reuses them brings them back to HBM.

A pool's shared store (`kv_store`, `add_store(pool, capacity_tokens)`): one LRU for the pool of
`capacity_tokens` (capped by `max_capacity_tokens`), written with every prompt dispatched to any of
its replicas (LMCache and Mooncake store a request's KV as it is computed). A replica's match goes on
past its own HBM and offload run through the store's blocks, counted as `remote` tier: what the
precise index learns from the store's events, estimated from what the gateway sent when no event
comes (an engine without events, or events that stopped).

Limits: it cannot see evictions caused by traffic that bypasses this gateway, nor other gateway
replicas' dispatches (use the precise index for that); it assumes a dispatched prompt stays cached
until `capacity` newer blocks push it out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from backends.kv_events import KvEventBatch
from backends.types import Endpoint
from policies.routing.config import PrefixIndexConfig
from policies.routing.kv_tiers import TierTokens
from policies.routing.prefix_blocks import (
    ENGINE_HASHERS,
    EngineHasher,
    HashedPrompt,
    OwnerMap,
    PromptBlocks,
    SlotMap,
    leading_matches,
    prompt_blocks,
    seed_of,
)
from policies.routing.prefix_precise import PrecisePrefixIndex


@dataclass(frozen=True, slots=True)
class IndexReport:
    mode: str
    approximate_entries: int
    precise_blocks: int
    memory_bytes: int
    precise_alive: dict[str, bool]  # endpoint id -> answering from events


class PrefixIndex:
    def __init__(
        self,
        config: PrefixIndexConfig,
        *,
        engine_hashers: Mapping[str, EngineHasher] | None = None,
        offload_tokens_of: Callable[[str], int] | None = None,
    ) -> None:
        """`offload_tokens_of(pool)`: tokens each replica of the pool keeps below HBM (approximate index)."""
        self.mode = config.mode
        self.approximate: ApproximatePrefixIndex | None = None
        self.precise: PrecisePrefixIndex | None = None
        if config.mode != "off":
            self.approximate = ApproximatePrefixIndex(
                block_tokens=config.block_size_tokens,
                default_capacity_tokens=config.advanced.default_capacity_tokens,
                max_capacity_tokens=config.advanced.max_capacity_tokens,
                max_prefix_tokens=config.advanced.max_prefix_tokens,
                offload_tokens_of=offload_tokens_of,
            )
        if config.mode == "precise":
            self.precise = PrecisePrefixIndex(
                default_block_tokens=config.precise_block_size_tokens or 16,
                speculative_ttl_s=config.advanced.speculative_ttl_s,
                events_timeout_s=config.advanced.events_timeout_s,
                resync_s=config.advanced.resync_s,
                max_blocks_per_endpoint=config.advanced.max_event_blocks_per_endpoint,
                max_prefix_tokens=config.advanced.max_prefix_tokens,
                engine_hashers=(ENGINE_HASHERS if config.advanced.precise_keys == "auto" else {})
                if engine_hashers is None
                else engine_hashers,
            )

    def lookup(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float) -> list[int]:
        """Estimated cached prompt tokens on each endpoint (same order)."""
        if self.approximate is None or not endpoints:
            return [0] * len(endpoints)
        if self.precise is None:
            return self.approximate.lookup(prompt, endpoints)
        precise = self.precise.lookup(prompt, endpoints, now_s)
        if all(v is not None for v in precise):
            return [v or 0 for v in precise]
        approx = self.approximate.lookup(prompt, endpoints)
        return [a if p is None else p for p, a in zip(precise, approx, strict=True)]

    def lookup_tiers(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float) -> list[TierTokens]:
        """Estimated cached prompt tokens on each endpoint (same order), per KV tier."""
        if self.approximate is None or not endpoints:
            return [TierTokens()] * len(endpoints)
        if self.precise is None:
            return self.approximate.lookup_tiers(prompt, endpoints)
        precise = self.precise.lookup_tiers(prompt, endpoints, now_s)
        if all(v is not None for v in precise):
            return [v or TierTokens() for v in precise]
        approx = self.approximate.lookup_tiers(prompt, endpoints)
        return [a if p is None else p for p, a in zip(precise, approx, strict=True)]

    def record(self, prompt: HashedPrompt, endpoint: Endpoint, now_s: float) -> None:
        if self.approximate is not None:
            self.approximate.record(prompt, endpoint)
        if self.precise is not None:
            self.precise.record(prompt, endpoint, now_s)

    def record_remote(self, endpoint: Endpoint, keys: Sequence[int]) -> None:
        """Another gateway replica dispatched a prompt with these approximate block keys to `endpoint`."""
        if self.approximate is not None:
            self.approximate.record_keys(endpoint, keys)

    def dispatched_keys(self, prompt: HashedPrompt) -> list[int]:
        """The approximate block keys this request records at dispatch (what replicas share)."""
        return list(self.approximate.blocks(prompt).keys) if self.approximate is not None else []

    # KV-event callbacks (`backends.kv_events.KvEventHub(on_batch=..., on_reset=...)`).
    def on_kv_batch(self, endpoint_id: str, batch: KvEventBatch) -> None:
        if self.precise is not None:
            self.precise.apply(endpoint_id, batch)

    def on_kv_reset(self, endpoint_id: str, reason: str, now_s: float) -> None:
        if self.precise is not None:
            self.precise.reset(endpoint_id, reason, now_s)

    # A pool's shared KV store (`kv_store`): its own events, or its engines' events of a store medium.
    def add_store(self, pool: str, capacity_tokens: int) -> None:
        if self.approximate is not None:
            self.approximate.add_store(pool, capacity_tokens)
        if self.precise is not None:
            self.precise.add_store(pool)

    def on_store_batch(self, pool: str, batch: KvEventBatch) -> None:
        if self.precise is not None:
            self.precise.apply_store(pool, batch)

    def on_store_reset(self, pool: str, reason: str, now_s: float) -> None:
        if self.precise is not None:
            self.precise.reset_store(pool, reason, now_s)

    def retain(self, endpoint_ids: Iterable[str]) -> None:
        """Forget endpoints that left the fleet."""
        keep = set(endpoint_ids)
        if self.approximate is not None:
            self.approximate.retain(keep)
        if self.precise is not None:
            self.precise.retain(keep)

    def memory_bytes(self) -> int:
        total = 0
        if self.approximate is not None:
            total += self.approximate.memory_bytes()
        if self.precise is not None:
            total += self.precise.memory_bytes()
        return total

    def report(self, now_s: float) -> IndexReport:
        precise_stats = self.precise.stats(now_s) if self.precise is not None else {}
        return IndexReport(
            mode=self.mode,
            approximate_entries=self.approximate.entries() if self.approximate is not None else 0,
            precise_blocks=self.precise.entries() if self.precise is not None else 0,
            memory_bytes=self.memory_bytes(),
            precise_alive={k: v.alive for k, v in precise_stats.items()},
        )


# Heap per tracked block, tables included: 143 B measured on CPython 3.11 (tracemalloc, 80k entries:
# OrderedDict slot and link node, the key int, the owner-map slot), rounded up for dict growth steps.
BYTES_PER_ENTRY = 160


@dataclass(frozen=True, slots=True)
class EndpointIndexStats:
    entries: int
    capacity_blocks: int


class ApproximatePrefixIndex:
    def __init__(
        self,
        *,
        block_tokens: int = 64,
        default_capacity_tokens: int = 500_000,
        max_capacity_tokens: int = 4_000_000,
        max_prefix_tokens: int = 131_072,
        offload_tokens_of: Callable[[str], int] | None = None,
    ) -> None:
        self.block_tokens = block_tokens
        self.offload_tokens_of = offload_tokens_of
        self.default_capacity_tokens = default_capacity_tokens
        self.max_capacity_tokens = max_capacity_tokens
        self.max_prefix_tokens = max_prefix_tokens
        self._slots = SlotMap()
        self._owners = OwnerMap()
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self._cold: dict[str, OrderedDict[int, None]] = {}  # endpoint -> blocks offloaded below HBM
        self._cold_capacity: dict[str, int] = {}
        self._stores: dict[str, OrderedDict[int, None]] = {}  # pool -> blocks its shared store holds
        self._store_capacity: dict[str, int] = {}
        self.evictions = 0

    # -- request side --------------------------------------------------------------------------

    def blocks(self, prompt: HashedPrompt) -> PromptBlocks:
        facts = prompt.facts
        seed = seed_of("approximate", facts.model, facts.cache_salt)
        blocks = prompt_blocks(prompt, self.block_tokens, seed, self.max_prefix_tokens, namespace="approximate")
        assert blocks is not None  # text fallback always yields blocks
        return blocks

    def lookup(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint]) -> list[int]:
        """Estimated cached prompt tokens on each endpoint (same order), every tier together."""
        return [t.total for t in self.lookup_tiers(prompt, endpoints)]

    def lookup_tiers(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint]) -> list[TierTokens]:
        """Estimated cached prompt tokens on each endpoint (same order), per tier (HBM, then offloaded)."""
        blocks = self.blocks(prompt)
        none = TierTokens()
        if not blocks.keys:
            return [none] * len(endpoints)
        mask = self._slots.mask_of(e.id for e in endpoints)
        matched = leading_matches(blocks.keys, mask, self._owners.owners)
        out: list[TierTokens] = []
        keys = blocks.keys
        stored: dict[tuple[str, int], int] = {}  # (pool, first block) -> the store's run from there
        for e in endpoints:
            slot = self._slots.get(e.id)
            n = matched.get(slot, 0) if slot is not None else 0
            s = 0
            store = self._stores.get(e.pool) if self._stores else None
            if store:
                s = stored.get((e.pool, n), -1)
                if s < 0:
                    end = n
                    while end < len(keys) and keys[end] in store:
                        end += 1
                    s = stored[(e.pool, n)] = end - n
            if not n and not s:
                out.append(none)
                continue
            cached = blocks.cached_tokens(n + s)
            cold = self._cold.get(e.id)
            if not cold and not s:
                out.append(TierTokens(gpu=cached))
                continue
            g = n
            if cold:
                hot = self._lrus[e.id]
                g = 0
                while g < n and keys[g] in hot:
                    g += 1
            out.append(TierTokens.from_blocks([g, n - g, 0, s], blocks.tokens_per_block, cached))
        return out

    def record(self, prompt: HashedPrompt, endpoint: Endpoint) -> None:
        """The request was dispatched to `endpoint`: its prompt's blocks are (about to be) cached there."""
        self.record_keys(endpoint, self.blocks(prompt).keys)

    def record_keys(self, endpoint: Endpoint, keys: Sequence[int]) -> None:
        """Record block keys on `endpoint` (a dispatch of this gateway, or one another replica reported)."""
        if not keys:
            return
        endpoint_id = endpoint.id
        bit = 1 << self._slots.slot(endpoint_id)
        lru = self._lrus.get(endpoint_id)
        if lru is None:
            lru = self._lrus[endpoint_id] = OrderedDict()
        capacity = self._capacity_blocks(endpoint)
        self._capacity[endpoint_id] = capacity
        cold_capacity = self._offload_blocks(endpoint)
        cold = self._cold.get(endpoint_id)
        if cold is None and cold_capacity:
            cold = self._cold[endpoint_id] = OrderedDict()
        if cold_capacity or cold is not None:
            self._cold_capacity[endpoint_id] = cold_capacity
        owners = self._owners.owners
        move = lru.move_to_end
        for key in reversed(keys[:capacity]):
            if key in lru:
                move(key)
            else:
                lru[key] = None
                if cold and cold.pop(key, 0) is None:
                    continue  # back from the offload tier: its owner bit is already set
                owners[key] = owners.get(key, 0) | bit
        if self._stores:
            self._store_keys(endpoint.pool, keys)
        if cold is None:
            self._evict(lru, capacity, bit)
            return
        while len(lru) > capacity:  # pushed out of HBM: offloaded
            key, _ = lru.popitem(last=False)
            cold[key] = None
        self._evict(cold, cold_capacity, bit)

    def add_store(self, pool: str, capacity_tokens: int) -> None:
        """`pool`'s replicas share a KV store of `capacity_tokens` (see the module docstring)."""
        capacity = max(min(capacity_tokens, self.max_capacity_tokens) // self.block_tokens, 1)
        self._store_capacity[pool] = capacity
        store = self._stores.setdefault(pool, OrderedDict())
        while len(store) > capacity:
            store.popitem(last=False)

    def _store_keys(self, pool: str, keys: Sequence[int]) -> None:
        store = self._stores.get(pool)
        if store is None:
            return
        capacity = self._store_capacity[pool]
        move = store.move_to_end
        for key in reversed(keys[:capacity]):  # the head most recent, as on a replica
            if key in store:
                move(key)
            else:
                store[key] = None
        while len(store) > capacity:
            store.popitem(last=False)

    # -- housekeeping --------------------------------------------------------------------------

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint (removed from the fleet, or restarted with an empty cache)."""
        lru = self._lrus.pop(endpoint_id, None)
        cold = self._cold.pop(endpoint_id, None)
        slot = self._slots.get(endpoint_id)
        if slot is not None:
            bit = 1 << slot
            for table in (lru, cold):
                for key in table or ():
                    self._owners.discard(key, bit)
        self._capacity.pop(endpoint_id, None)
        self._cold_capacity.pop(endpoint_id, None)
        self._slots.release(endpoint_id)

    def retain(self, endpoint_ids: Iterable[str]) -> None:
        """Forget every endpoint not in `endpoint_ids` (call when the fleet changes)."""
        keep = set(endpoint_ids)
        for endpoint_id in self._slots.ids():
            if endpoint_id not in keep:
                self.forget(endpoint_id)

    def stats(self) -> dict[str, EndpointIndexStats]:
        return {
            endpoint_id: EndpointIndexStats(
                len(lru) + len(self._cold.get(endpoint_id, ())),
                self._capacity.get(endpoint_id, 0) + self._cold_capacity.get(endpoint_id, 0),
            )
            for endpoint_id, lru in self._lrus.items()
        }

    def entries(self) -> int:
        return (
            sum(len(lru) for lru in self._lrus.values())
            + sum(len(cold) for cold in self._cold.values())
            + sum(len(store) for store in self._stores.values())
        )

    def memory_bytes(self) -> int:
        """Estimated heap held by the index: entries x the measured per-entry cost (tables included)."""
        return self.entries() * BYTES_PER_ENTRY

    def max_memory_bytes(self, endpoints: int, stores: int = 0) -> int:
        """The bound for `endpoints` endpoints and `stores` pools' stores: every LRU (HBM, offload and
        store) full at the largest allowed capacity."""
        return (2 * endpoints + stores) * max(self.max_capacity_tokens // self.block_tokens, 1) * BYTES_PER_ENTRY

    def _capacity_blocks(self, endpoint: Endpoint) -> int:
        tokens = endpoint.stats.kv_capacity_tokens or self.default_capacity_tokens
        tokens = min(tokens, self.max_capacity_tokens)
        return max(tokens // self.block_tokens, 1)

    def _offload_blocks(self, endpoint: Endpoint) -> int:
        if self.offload_tokens_of is None:
            return 0
        tokens = min(self.offload_tokens_of(endpoint.pool), self.max_capacity_tokens)
        return max(tokens // self.block_tokens, 0)

    def _evict(self, lru: OrderedDict[int, None], capacity: int, bit: int) -> None:
        discard = self._owners.discard
        while len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            discard(key, bit)
            self.evictions += 1
