"""Approximate prefix index: what the gateway itself sent where, no engine cooperation needed.

At dispatch the request's block keys are recorded for the chosen endpoint (both legs in PD) in one
bounded LRU per endpoint, sized from the engine's reported KV capacity (`num_gpu_blocks` x
`block_size` tokens) or `default_capacity_tokens`, capped by `max_capacity_tokens`. Keys are inserted
last-block-first, so a prompt's head is the most recently used part and evicted last, as vLLM frees
a request's blocks tail first. Memory is bounded by (endpoints x capacity) entries and reported.

Limits: it cannot see evictions caused by traffic that bypasses this gateway, nor other gateway
replicas' dispatches (use the precise index for that); it assumes a dispatched prompt stays cached
until `capacity` newer blocks push it out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backends.types import Endpoint
from policies.routing.prefix.hashing import HashedPrompt, PromptBlocks, prompt_blocks, seed_of
from policies.routing.prefix.owners import OwnerMap, SlotMap, leading_matches

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
    ) -> None:
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self.max_capacity_tokens = max_capacity_tokens
        self.max_prefix_tokens = max_prefix_tokens
        self._slots = SlotMap()
        self._owners = OwnerMap()
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self.evictions = 0

    # -- request side --------------------------------------------------------------------------

    def blocks(self, prompt: HashedPrompt) -> PromptBlocks:
        facts = prompt.facts
        seed = seed_of("approximate", facts.model, facts.cache_salt)
        blocks = prompt_blocks(prompt, self.block_tokens, seed, self.max_prefix_tokens, namespace="approximate")
        assert blocks is not None  # text fallback always yields blocks
        return blocks

    def lookup(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint]) -> list[int]:
        """Estimated cached prompt tokens on each endpoint (same order)."""
        blocks = self.blocks(prompt)
        if not blocks.keys:
            return [0] * len(endpoints)
        mask = self._slots.mask_of(e.id for e in endpoints)
        matched = leading_matches(blocks.keys, mask, self._owners.owners)
        out: list[int] = []
        for e in endpoints:
            slot = self._slots.get(e.id)
            n = matched.get(slot, 0) if slot is not None else 0
            out.append(blocks.cached_tokens(n) if n else 0)
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
        owners = self._owners.owners
        move = lru.move_to_end
        for key in reversed(keys[:capacity]):
            if key in lru:
                move(key)
            else:
                lru[key] = None
                owners[key] = owners.get(key, 0) | bit
        self._evict(lru, capacity, bit)

    # -- housekeeping --------------------------------------------------------------------------

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint (removed from the fleet, or restarted with an empty cache)."""
        lru = self._lrus.pop(endpoint_id, None)
        slot = self._slots.get(endpoint_id)
        if lru is not None and slot is not None:
            bit = 1 << slot
            for key in lru:
                self._owners.discard(key, bit)
        self._capacity.pop(endpoint_id, None)
        self._slots.release(endpoint_id)

    def retain(self, endpoint_ids: Iterable[str]) -> None:
        """Forget every endpoint not in `endpoint_ids` (call when the fleet changes)."""
        keep = set(endpoint_ids)
        for endpoint_id in self._slots.ids():
            if endpoint_id not in keep:
                self.forget(endpoint_id)

    def stats(self) -> dict[str, EndpointIndexStats]:
        return {
            endpoint_id: EndpointIndexStats(len(lru), self._capacity.get(endpoint_id, 0))
            for endpoint_id, lru in self._lrus.items()
        }

    def entries(self) -> int:
        return sum(len(lru) for lru in self._lrus.values())

    def memory_bytes(self) -> int:
        """Estimated heap held by the index: entries x the measured per-entry cost (tables included)."""
        return self.entries() * BYTES_PER_ENTRY

    def max_memory_bytes(self, endpoints: int) -> int:
        """The bound for `endpoints` endpoints: every LRU full at the largest allowed capacity."""
        return endpoints * max(self.max_capacity_tokens // self.block_tokens, 1) * BYTES_PER_ENTRY

    def _capacity_blocks(self, endpoint: Endpoint) -> int:
        tokens = endpoint.stats.kv_capacity_tokens or self.default_capacity_tokens
        tokens = min(tokens, self.max_capacity_tokens)
        return max(tokens // self.block_tokens, 1)

    def _evict(self, lru: OrderedDict[int, None], capacity: int, bit: int) -> None:
        discard = self._owners.discard
        while len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            discard(key, bit)
            self.evictions += 1
