"""Precise prefix index: the blocks each engine says it holds, from its KV-cache events.

Per endpoint it keeps the blocks of `BlockStored` until `BlockRemoved` / `AllBlocksCleared`, so every
gateway replica fed the same events holds the same index. Requests are matched on consecutive full
blocks of their token ids at the engine's block size.

Keys. A stored block is indexed under one of two keys, by the endpoint's engine kind (under both
until the first request to the endpoint tells its kind):
- the engine's own hash from the event, when an `EngineHasher` for that kind reproduces it
  (`prefix_blocks.ENGINE_HASHERS`: the simulated engine), requests being hashed the same way;
- otherwise a key of our own ("token" keys): the block re-hashed with this package's chained xxh3
  (`prefix_blocks.block_key`) over the event's `token_ids`, its parent found through `parent_block_hash`,
  the first block seeded by `lora_name` and the cache salt carried in `extra_keys`. This works for
  any engine whose events carry token ids (vLLM with sha256/CBOR and any `PYTHONHASHSEED`: its events
  carry `token_ids`). A block whose parent was never seen (events lost) gets no token key (an orphan).
  Limits: a salt the engine does not publish in `extra_keys` makes salted prompts miss (never a
  false hit). A request for a LoRA adapter is hashed with it (`HashedPrompt.lora`) as the engine's
  blocks are: token keys seeded by the adapter as events' `lora_name`, engine keys salted by it.

Tiers. Every key keeps the media that hold it (`_MEDIUM_BITS`: an offloading engine publishes the same
block again with medium CPU when it copies it to host DRAM, and `BlockRemoved` with that medium when
it drops it there). `lookup_tiers` splits a match into the leading run in HBM and the run that follows
in the lower tiers (`kv_tiers.TierTokens`), as vLLM serves it: HBM hits first, then its connector's. A
stored event without token ids (vLLM's offloading connector publishes hashes only, parent None) keeps
the token key its hash already maps to. Limit: an offload block size larger than the GPU block size
(one hash per group of GPU blocks) is not matched.

Shared store (a pool's `kv_store`: LMCache's remote backend, Mooncake Store). Its blocks are readable by
every replica of the pool, so they are kept once per pool, in a state of their own (a slot like an
endpoint's), and a lookup on any replica of the pool continues its match through them, as tier
`remote` (each block in its fastest tier: a replica's own HBM or DRAM copy wins). The index learns them
from the store's own event stream (`apply_store`: stored, removed when the store evicts, cleared) or,
for a pool registered with `add_store`, from its engines' events whose medium is not GPU/CPU/DISK
(an engine publishing what it wrote to the store, and what it saw dropped there). Store events may carry
hashes only: their keys are then found through the pool's engines' hash -> key maps.

Between a dispatch and the engine's first event about it, speculative entries (TTL
`speculative_ttl_s`) stand in, so a burst of same-prefix requests sees the first one's blocks.

Liveness per endpoint: precise answers only for endpoints that have published at least once, are not
within `resync_s` of an unrecoverable gap, and have not left a dispatch unanswered by any event for
`events_timeout_s` (an engine started without `--kv-events-config`, or a dead subscription). Otherwise
`lookup` returns None for that endpoint and the caller uses the approximate index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from backends.block_hash import lora_salt
from backends.kv_events import (
    RESET_GAP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)
from backends.types import Endpoint
from policies.routing.kv_tiers import LOWER_TIER_BITS, TierTokens, lower_tier_of
from policies.routing.prefix_blocks import (
    EngineHasher,
    HashedPrompt,
    OwnerMap,
    PromptBlocks,
    SlotMap,
    leading_matches,
    prompt_blocks,
    prompt_token_bytes,
    seed_of,
    token_bytes,
)

_MEDIUM_BITS = {"GPU": 1, "CPU": 2, "DISK": 4, "STORAGE": 4}
_OTHER_MEDIUM = 8
ALL_MEDIA = -1
NO_KEY = -1  # engine hash whose token key cannot be derived (an orphan)
# Heap per entry of the per-endpoint tables, owner map included: 67-85 B measured on CPython 3.11
# (tracemalloc, 20k blocks; engine-hash vs token keys), rounded up.
BYTES_PER_ENTRY = 100


def _medium_bit(medium: str | None) -> int:
    if medium is None:
        return 1
    return _MEDIUM_BITS.get(medium.upper(), _OTHER_MEDIUM)


def salt_from_extra_keys(extra: Any, lora_name: str | None = None) -> str | None:
    """The cache salt in a block's extra keys: a bare string, or a ("cache_salt", salt) pair.

    vLLM puts a LoRA request's adapter name first in every block's extra keys, also a bare string
    (`to_event_extra_keys` in vllm/v1/core/kv_cache_utils.py: block 0 of a salted request for an adapter
    is `[lora_name, cache_salt]`), so with `lora_name` set that leading name is not the salt."""
    if extra is None:
        return None
    items = extra if isinstance(extra, list | tuple) else [extra]
    if lora_name and items and items[0] == lora_name:
        items = items[1:]
    for item in items:
        if isinstance(item, str):
            return item
        if isinstance(item, list | tuple) and len(item) == 2 and item[0] == "cache_salt" and isinstance(item[1], str):
            return item[1]
    return None


@dataclass(slots=True)
class _EndpointBlocks:
    slot: int
    block_tokens: int | None = None
    present: dict[int, int] = field(default_factory=dict)  # key -> medium bits
    engine_to_key: OrderedDict[int, int] = field(default_factory=OrderedDict)  # engine hash -> token key | NO_KEY
    spec: dict[int, float] = field(default_factory=dict)  # key -> expiry (monotonic s)
    seen: bool = False
    last_event_s: float = 0.0
    awaiting_since_s: float | None = None
    degraded_until_s: float = 0.0
    restarts: int | None = None
    engine_keys: bool = True  # index blocks under the engine's hashes (its kind has an EngineHasher)
    token_keys: bool = True  # ... and/or under token keys; both until the endpoint's kind is known
    batches: int = 0
    orphans: int = 0
    lower: int = 0  # keys held in a tier below HBM (lookups split tiers only when some are)
    pool: str | None = None  # the endpoint's pool, once a lookup or dispatch told it; a store's own pool
    store: bool = False  # the pool's shared KV store, not an endpoint


@dataclass(frozen=True, slots=True)
class PreciseEndpointStats:
    blocks: int
    speculative: int
    batches: int
    orphans: int
    alive: bool


class PrecisePrefixIndex:
    def __init__(
        self,
        *,
        default_block_tokens: int = 16,
        speculative_ttl_s: float = 2.0,
        events_timeout_s: float = 10.0,
        resync_s: float = 30.0,
        max_blocks_per_endpoint: int = 4_000_000,
        max_prefix_tokens: int = 131_072,
        engine_hashers: Mapping[str, EngineHasher] | None = None,
    ) -> None:
        self.default_block_tokens = default_block_tokens
        self.speculative_ttl_s = speculative_ttl_s
        self.events_timeout_s = events_timeout_s
        self.resync_s = resync_s
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.max_prefix_tokens = max_prefix_tokens
        self.engine_hashers = dict(engine_hashers or {})
        self._slots = SlotMap()
        self._owners = OwnerMap()
        self._spec_owners = OwnerMap()
        self._spec_queue: deque[tuple[float, int, int]] = deque()  # (expiry, slot, key), expiry ascending
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._by_slot: dict[int, _EndpointBlocks] = {}
        self._stores: dict[str, _EndpointBlocks] = {}  # pool -> its shared store's blocks (bounded by config)

    # -- event side -----------------------------------------------------------------------------

    def apply(self, endpoint_id: str, batch: KvEventBatch) -> None:
        st = self._state(endpoint_id)
        st.seen = True
        st.batches += 1
        st.last_event_s = max(st.last_event_s, batch.received_at_s)
        st.awaiting_since_s = None
        store = self._stores.get(st.pool) if st.pool is not None else None
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(st, event)
                if store is not None and _medium_bit(event.medium) == _OTHER_MEDIUM:
                    store.seen = True  # an engine wrote these blocks to the pool's store
                    self._stored(store, event)
            elif isinstance(event, BlockRemoved):
                bit = _medium_bit(event.medium)
                self._removed(st, event.block_hashes, bit)
                if store is not None and bit == _OTHER_MEDIUM:
                    self._removed(store, event.block_hashes, ALL_MEDIA)
            elif isinstance(event, AllBlocksCleared):
                self._clear(st)

    def add_store(self, pool: str) -> None:
        """`pool` has a shared KV store: its engines' events of a store medium (not GPU/CPU/DISK) tell
        the store's blocks too. Idempotent."""
        self._store_state(pool)

    def apply_store(self, pool: str, batch: KvEventBatch) -> None:
        """The pool's shared store's own events: what it holds, whichever replica wrote it."""
        st = self._store_state(pool)
        st.seen = True
        st.batches += 1
        st.last_event_s = max(st.last_event_s, batch.received_at_s)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(st, event)
            elif isinstance(event, BlockRemoved):
                self._removed(st, event.block_hashes, ALL_MEDIA)
            elif isinstance(event, AllBlocksCleared):
                self._clear(st)

    def reset_store(self, pool: str, reason: str, now_s: float) -> None:
        """The store's event stream broke: forget its blocks; after a gap, distrust it for a while."""
        st = self._store_state(pool)
        self._clear(st)
        if reason == RESET_GAP:
            st.degraded_until_s = now_s + self.resync_s

    def _store_state(self, pool: str) -> _EndpointBlocks:
        st = self._stores.get(pool)
        if st is None:
            st = _EndpointBlocks(slot=self._slots.slot("\x00store:" + pool), pool=pool, store=True)
            self._stores[pool] = st
            self._by_slot[st.slot] = st
        return st

    def _live_store(self, pool: str, now_s: float) -> _EndpointBlocks | None:
        st = self._stores.get(pool)
        if st is None or not st.seen or not st.present or now_s < st.degraded_until_s:
            return None
        return st

    def _key_of(self, st: _EndpointBlocks, engine_hash: int) -> int:
        """The token key an engine hash maps to; for a store, as any engine of its pool mapped it."""
        key = st.engine_to_key.get(engine_hash, NO_KEY)
        if key == NO_KEY and st.store:
            for other in self._endpoints.values():
                if other.pool == st.pool:
                    key = other.engine_to_key.get(engine_hash, NO_KEY)
                    if key != NO_KEY:
                        break
        return key

    def _removed(self, st: _EndpointBlocks, hashes: Sequence[int], bit: int) -> None:
        for engine_hash in hashes:
            self._remove(st, engine_hash, bit)
            key = self._key_of(st, engine_hash)
            if key != NO_KEY:
                self._remove(st, key, bit)

    def reset(self, endpoint_id: str, reason: str, now_s: float) -> None:
        """The event stream broke: forget what the endpoint holds; after a gap, distrust it for a while."""
        st = self._state(endpoint_id)
        self._clear(st)
        self._clear_spec(st)
        if reason == RESET_GAP:
            st.degraded_until_s = now_s + self.resync_s

    def _stored(self, st: _EndpointBlocks, event: BlockStored) -> None:
        bs = event.block_size or st.block_tokens or self.default_block_tokens
        if event.token_ids:  # offload events (hashes only) may carry the offload tier's block size
            st.block_tokens = bs
        medium = _OTHER_MEDIUM if st.store else _medium_bit(event.medium)  # a store's blocks are its own tier
        mapping = st.engine_to_key
        keys: list[int] = []  # token keys of the event's blocks, as far as they can be derived
        if event.parent_block_hash is None:
            first_extra = event.extra_keys[0] if event.extra_keys else None
            parent: int | None = seed_of("precise", event.lora_name, salt_from_extra_keys(first_extra, event.lora_name))
        else:
            parent = self._key_of(st, event.parent_block_hash)
            if parent == NO_KEY:
                parent = None
                st.orphans += len(event.block_hashes)
        n_blocks = len(event.block_hashes)
        if parent is not None and st.token_keys:
            data = token_bytes(event.token_ids[: n_blocks * bs])
            step = bs * 4
            view = memoryview(data)
            for offset in range(0, min(len(data) // step, n_blocks) * step, step):
                parent = xxh3_64_intdigest(view[offset : offset + step], parent)
                keys.append(parent)
        present, spec, slot_bit = st.present, st.spec, 1 << st.slot
        owners, spec_owners = self._owners, self._spec_owners
        for i, engine_hash in enumerate(event.block_hashes):
            if engine_hash in mapping:
                mapping.move_to_end(engine_hash)
            key = keys[i] if i < len(keys) else NO_KEY
            if key == NO_KEY and not event.token_ids:  # a copy to another medium: hashes only
                key = self._key_of(st, engine_hash)
            mapping[engine_hash] = key
            for k in (engine_hash if st.engine_keys else NO_KEY, key):
                if k == NO_KEY:
                    continue
                bits = present.get(k, 0)
                present[k] = bits | medium
                if not bits:
                    owners.add(k, slot_bit)
                if medium & LOWER_TIER_BITS and not bits & LOWER_TIER_BITS:
                    st.lower += 1
                if spec and spec.pop(k, None) is not None:
                    spec_owners.discard(k, slot_bit)
        while len(mapping) > self.max_blocks_per_endpoint:
            # Past the bound a block could no longer be removed by its event: drop it now instead.
            old_hash, old_key = mapping.popitem(last=False)
            self._remove(st, old_hash, ALL_MEDIA)
            if old_key != NO_KEY:
                self._remove(st, old_key, ALL_MEDIA)

    def _remove(self, st: _EndpointBlocks, key: int, medium: int) -> None:
        bits = st.present.get(key)
        if bits is None:
            return
        if bits & LOWER_TIER_BITS and not bits & ~medium & LOWER_TIER_BITS:
            st.lower -= 1
        bits &= ~medium
        if bits:
            st.present[key] = bits
        else:
            del st.present[key]
            self._owners.discard(key, 1 << st.slot)

    def _clear(self, st: _EndpointBlocks) -> None:
        bit = 1 << st.slot
        for key in st.present:
            self._owners.discard(key, bit)
        st.present.clear()
        st.lower = 0

    def _clear_spec(self, st: _EndpointBlocks) -> None:
        bit = 1 << st.slot
        for key in st.spec:
            self._spec_owners.discard(key, bit)
        st.spec.clear()

    # -- request side ---------------------------------------------------------------------------

    def alive(self, endpoint_id: str, now_s: float) -> bool:
        st = self._endpoints.get(endpoint_id)
        if st is None or not st.seen or now_s < st.degraded_until_s:
            return False
        return st.awaiting_since_s is None or now_s - st.awaiting_since_s < self.events_timeout_s

    def block_tokens(self, endpoint: Endpoint) -> int:
        st = self._endpoints.get(endpoint.id)
        if st is not None and st.block_tokens:
            return st.block_tokens
        return endpoint.stats.block_size or self.default_block_tokens

    def blocks(self, prompt: HashedPrompt, endpoint: Endpoint) -> PromptBlocks | None:
        """Keys of the request as `endpoint` would store them; None without token ids."""
        block_tokens = self.block_tokens(endpoint)
        hasher = self.engine_hashers.get(endpoint.engine)
        salt = prompt.facts.cache_salt
        if hasher is None:
            seed = seed_of("precise", prompt.lora, salt)  # as events' token keys are seeded (`_stored`)
            return prompt_blocks(
                prompt, block_tokens, seed, self.max_prefix_tokens, namespace="precise", require_ids=True
            )
        cache = prompt.blocks
        cache_key = ("engine:" + endpoint.engine, block_tokens)
        if cache_key not in cache:
            ids = prompt.exact_token_ids
            if ids is None:
                cache[cache_key] = None
            else:
                data = prompt_token_bytes(prompt, ids, self.max_prefix_tokens)
                keys = hasher(data, block_tokens, lora_salt(salt, prompt.lora))  # the engine salts by adapter
                cache[cache_key] = PromptBlocks(keys, block_tokens, len(ids), exact=True)
        return cache[cache_key]

    def lookup(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float) -> list[int | None]:
        """Cached prompt tokens per endpoint (same order); None where precise data is not trustworthy."""
        return [None if t is None else t.total for t in self.lookup_tiers(prompt, endpoints, now_s)]

    def lookup_tiers(
        self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float
    ) -> list[TierTokens | None]:
        """Cached prompt tokens per endpoint and tier (same order); None where precise data is not
        trustworthy. Speculative entries count as HBM (the engine is computing them there)."""
        self._purge_spec(now_s)
        out: list[TierTokens | None] = [None] * len(endpoints)
        groups: dict[tuple[int, str], list[int]] = {}
        for i, endpoint in enumerate(endpoints):
            self._check_restart(endpoint)
            if self.alive(endpoint.id, now_s):
                engine = endpoint.engine if endpoint.engine in self.engine_hashers else ""
                groups.setdefault((self.block_tokens(endpoint), engine), []).append(i)
        for indexes in groups.values():
            blocks = self.blocks(prompt, endpoints[indexes[0]])
            if blocks is None:
                continue
            slots = [self._endpoints[endpoints[i].id].slot for i in indexes]
            mask = 0
            for slot in slots:
                mask |= 1 << slot
            keys = blocks.keys
            confirmed = self._owners.owners
            matched = leading_matches(keys, mask, confirmed)
            spec = self._spec_owners.owners
            for i, slot in zip(indexes, slots, strict=True):
                n = matched.get(slot, 0)
                store = self._live_store(endpoints[i].pool, now_s) if self._stores else None
                if spec or store is not None:
                    # extend through blocks dispatched here but not yet confirmed by an event, and
                    # through the blocks the pool's shared store holds
                    bits = 1 << slot | (1 << store.slot if store is not None else 0)
                    while n < len(keys) and (confirmed.get(keys[n], 0) | spec.get(keys[n], 0)) & bits:
                        n += 1
                st = self._by_slot[slot]
                if not n:
                    out[i] = TierTokens()
                elif not st.lower and store is None:
                    out[i] = TierTokens(gpu=blocks.cached_tokens(n))
                else:
                    out[i] = self._split_tiers(st, keys, n, blocks, store)
        return out

    @staticmethod
    def _split_tiers(
        st: _EndpointBlocks, keys: Sequence[int], n: int, blocks: PromptBlocks, store: _EndpointBlocks | None = None
    ) -> TierTokens:
        """The leading HBM run of the n matched blocks, then the run held in lower tiers (each block
        counted in its fastest one, the pool's store as `remote`); a block in none ends the match, as
        it ends the engine's."""
        present, spec = st.present, st.spec
        shared = store.present if store is not None else {}
        g = 0
        while g < n and (present.get(keys[g], 0) & 1 or keys[g] in spec):
            g += 1
        counts = [g, 0, 0, 0]
        j = g
        while j < n:
            tier = lower_tier_of(present.get(keys[j], 0) | shared.get(keys[j], 0))
            if tier < 0:
                break
            counts[tier] += 1
            j += 1
        return TierTokens.from_blocks(counts, blocks.tokens_per_block, blocks.cached_tokens(j))

    def record(self, prompt: HashedPrompt, endpoint: Endpoint, now_s: float) -> None:
        """Dispatched: add speculative entries for the blocks the engine will store, and expect an event."""
        st = self._state(endpoint.id)
        self._check_restart(endpoint)
        self._purge_spec(now_s)
        blocks = self.blocks(prompt, endpoint)
        if blocks is None or not blocks.keys:
            return
        bit = 1 << st.slot
        confirmed = leading_matches(blocks.keys, bit, self._owners.owners).get(st.slot, 0)
        if confirmed >= len(blocks.keys):
            return
        if st.awaiting_since_s is None:
            st.awaiting_since_s = now_s
        if self.speculative_ttl_s <= 0:
            return
        expiry = now_s + self.speculative_ttl_s
        for key in blocks.keys[confirmed:]:
            if key not in st.spec:
                self._spec_owners.add(key, bit)
            st.spec[key] = expiry
            self._spec_queue.append((expiry, st.slot, key))

    def _purge_spec(self, now_s: float) -> None:
        queue = self._spec_queue
        while queue and queue[0][0] <= now_s:
            expiry, slot, key = queue.popleft()
            st = self._by_slot.get(slot)
            if st is not None and st.spec.get(key) == expiry:
                del st.spec[key]
                self._spec_owners.discard(key, 1 << slot)

    def _check_restart(self, endpoint: Endpoint) -> None:
        """The supervisor restarted the engine: its cache is empty whatever events we missed.

        Also learns the endpoint's engine kind, so later events are indexed under one kind of key."""
        st = self._state(endpoint.id)
        st.pool = endpoint.pool
        if st.restarts is None:
            st.restarts = endpoint.restarts
            st.engine_keys = endpoint.engine in self.engine_hashers
            st.token_keys = not st.engine_keys
        elif st.restarts != endpoint.restarts:
            st.restarts = endpoint.restarts
            self._clear(st)
            self._clear_spec(st)

    # -- housekeeping ---------------------------------------------------------------------------

    def _state(self, endpoint_id: str) -> _EndpointBlocks:
        st = self._endpoints.get(endpoint_id)
        if st is None:
            st = _EndpointBlocks(slot=self._slots.slot(endpoint_id))
            self._endpoints[endpoint_id] = st
            self._by_slot[st.slot] = st
        return st

    def forget(self, endpoint_id: str) -> None:
        st = self._endpoints.pop(endpoint_id, None)
        if st is None:
            return
        self._clear(st)
        self._clear_spec(st)
        self._by_slot.pop(st.slot, None)
        self._slots.release(endpoint_id)

    def retain(self, endpoint_ids: Iterable[str]) -> None:
        keep = set(endpoint_ids)
        for endpoint_id in list(self._endpoints):
            if endpoint_id not in keep:
                self.forget(endpoint_id)

    def entries(self) -> int:
        return sum(len(st.present) for st in (*self._endpoints.values(), *self._stores.values()))

    def memory_bytes(self) -> int:
        states = (*self._endpoints.values(), *self._stores.values())
        entries = sum(len(st.present) + len(st.engine_to_key) + len(st.spec) for st in states)
        return entries * BYTES_PER_ENTRY

    def stats(self, now_s: float) -> dict[str, PreciseEndpointStats]:
        return {
            endpoint_id: PreciseEndpointStats(
                blocks=len(st.present),
                speculative=len(st.spec),
                batches=st.batches,
                orphans=st.orphans,
                alive=self.alive(endpoint_id, now_s),
            )
            for endpoint_id, st in self._endpoints.items()
        }
