"""Approximate prefix index: what the gateway itself sent where, no engine cooperation needed.

At dispatch the request's block keys are recorded for the chosen endpoint (both legs in PD) in one
bounded LRU per endpoint, sized from the engine's reported KV capacity (`num_gpu_blocks` x
`block_size` tokens) or `default_capacity_tokens`, capped by `max_capacity_tokens`. Keys are inserted
last-block-first, so a prompt's head is the most recently used part and evicted last, as vLLM frees
a request's blocks tail first. Memory is bounded by (endpoints x capacity) entries and reported.

Tiers: an endpoint whose pool offloads KV below HBM (`offload_tokens_of(pool)` > 0, the pool's
`routing.kv_tiers.offload_capacity_tokens`) keeps a second LRU of that size: blocks pushed out of the
HBM-sized LRU move there (as an offloading engine moves evicted blocks to host DRAM) and count as
`cpu` tier hits until they leave it too; a dispatch that reuses them brings them back to HBM.

Limits: it cannot see evictions caused by traffic that bypasses this gateway, nor other gateway
replicas' dispatches (use the precise index for that); it assumes a dispatched prompt stays cached
until `capacity` newer blocks push it out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from backends.types import Endpoint
from policies.routing.prefix.hashing import HashedPrompt, PromptBlocks, prompt_blocks, seed_of
from policies.routing.prefix.owners import OwnerMap, SlotMap, leading_matches
from policies.routing.prefix.tiers import TierTokens

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
        for e in endpoints:
            slot = self._slots.get(e.id)
            n = matched.get(slot, 0) if slot is not None else 0
            if not n:
                out.append(none)
                continue
            cached = blocks.cached_tokens(n)
            cold = self._cold.get(e.id)
            if not cold:
                out.append(TierTokens(gpu=cached))
                continue
            hot = self._lrus[e.id]
            g = 0
            while g < n and keys[g] in hot:
                g += 1
            out.append(TierTokens.from_blocks([g, n - g, 0, 0], blocks.tokens_per_block, cached))
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
        if cold is None:
            self._evict(lru, capacity, bit)
            return
        while len(lru) > capacity:  # pushed out of HBM: offloaded
            key, _ = lru.popitem(last=False)
            cold[key] = None
        self._evict(cold, cold_capacity, bit)

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
        return sum(len(lru) for lru in self._lrus.values()) + sum(len(cold) for cold in self._cold.values())

    def memory_bytes(self) -> int:
        """Estimated heap held by the index: entries x the measured per-entry cost (tables included)."""
        return self.entries() * BYTES_PER_ENTRY

    def max_memory_bytes(self, endpoints: int) -> int:
        """The bound for `endpoints` endpoints: every LRU (HBM and offload) full at the largest allowed capacity."""
        return 2 * endpoints * max(self.max_capacity_tokens // self.block_tokens, 1) * BYTES_PER_ENTRY

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
