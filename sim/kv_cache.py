"""Paged KV cache with prefix caching, as vLLM V1's block pool and KV cache manager keep it, and the
tiers below HBM: one engine's host-DRAM offload (`HostOffload`) and a pool's shared store
(`SharedStore`), priced.

- The pool has `num_blocks` blocks of `block_size` token slots. A request holds a list of block ids.
- A block becomes *cached* once all its slots hold known tokens: it gets a content hash chained over
  the blocks before it, and a later request whose prompt hashes the same reuses it (prefix hit).
- Freed blocks keep their hash and go to the tail of a free queue; allocation takes from the head and
  evicts (un-hashes) what it takes. So freed blocks stay cached until evicted, least recently freed
  first, and a request's tail blocks are freed ahead of its head (vLLM frees in reverse order).
- Usage = 1 - free/total, evictable cached blocks counting as free (`vllm:kv_cache_usage_perc`).

Hashes: `backends/block_hash.py` (shared with the router, which reproduces them from requests).

Every store, eviction and reset is recorded as a `KVEvent` for the KV-event publisher to drain.
An optional host-DRAM tier below HBM (`HostOffload`, below) receives the evicted blocks (`on_evict`).

The host-DRAM tier
------------------
`HostOffload`, the host-DRAM offload tier of one simulated engine: what vLLM's OffloadingConnector does, priced.

- Blocks evicted from HBM (the block pool's free-queue evictions) are copied to host DRAM, an LRU of
  `capacity_blocks` blocks keyed by the same block hash; past capacity the least recently used go.
  (vLLM's native connector stores blocks as they are computed rather than at eviction; for hits the
  two differ only in what DRAM holds of blocks still in HBM, which are served from HBM anyway.)
- A waiting request first reuses its HBM prefix; the consecutive blocks after it that DRAM holds are
  loaded instead of recomputed: the request waits `bytes / bandwidth` simulated seconds (KV bytes per
  token on one device x tokens over the PCIe link; other requests run meanwhile, as vLLM's
  asynchronous loads let them), then continues with those tokens computed and the blocks back in HBM.
  The scheduler treats the wait like a PD decode leg's pull (`Scheduler.pulling`).
- KV events as vLLM's offloading connector publishes them (vllm/distributed/kv_transfer/kv_connector/
  v1/offloading_connector.py, `take_events`): `BlockStored` with `medium: "CPU"`, the blocks' hashes,
  no parent and no token ids; `BlockRemoved` with `medium: "CPU"` when DRAM drops them.

- With a pool's shared store attached (`store`, `SharedStore`), evictions are written there too (a
  store that writes on eviction), and
  the run a request loads goes on through the store's blocks after the DRAM ones (the DRAM part over
  PCIe, then the store part over the store's link).

`KVCacheManager.offload` holds the tier; `attach` wires the eviction hook.

The shared store
----------------
`SharedStore`, a KV store shared by a pool's simulated engines (LMCache's remote backend, Mooncake Store), priced.

- One LRU of `capacity_blocks` block hashes for the whole pool, so a block one engine computed can be
  loaded by any other instead of recomputed. `write` says when blocks get there: `evict` (every
  attached engine writes its HBM evictions, as it writes them to its own host DRAM, `HostOffload`)
  or `compute` (as LMCache stores a request's KV once computed: the engine's owner puts the blocks of
  its GPU `stored` events, `put`, when the step that computed them ends).
- A waiting request's prefix goes on in the store after its HBM and DRAM runs: those blocks are
  loaded at `latency_s + bytes / bandwidth` (a fixed cost per load, then the link; the DRAM run's
  PCIe load is added before it), the load priced like the DRAM one in `HostOffload.start_load`.
- The store publishes its own events (`drain_events`): `stored` when it takes blocks, `removed` when
  its LRU drops them, medium `STORE`, hashes only. A router fed them (`ScoringRouter.on_store_batch`)
  counts those blocks on every replica of the pool (policies/routing/prefix_precise.py).

The store is in-process: engines sharing it run on one virtual clock (bench/kv_tiers). Writes are
free and instant (a real store's writes overlap compute); reads are what the benchmark prices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.block_hash import NONE_HASH, chain_hashes, lora_salt
from backends.perf.roofline import kv_bytes_per_token_per_device

if TYPE_CHECKING:
    from sim.config import EngineConfig
    from sim.scheduler import Request


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens start..end of the request's prompt followed by its (planned) output."""
    prompt = req.prompt_ids
    split = len(prompt)
    if end <= split:
        return prompt[start:end]
    if start >= split:
        return req.output_ids[start - split : end - split]
    return prompt[start:] + req.output_ids[: end - split]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One cache change: kind is "stored", "removed" or "cleared"."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # vLLM's per-block extra keys of a stored run: the first block of a salted prompt carries the
    # request's `cache_salt` (as vLLM's do), so an index re-hashing the tokens can salt them alike
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None
    lora_name: str | None = None  # the adapter whose blocks these are (sim/lora.py)
    medium: str = "GPU"  # where the blocks are: "GPU" (HBM) or "CPU" (the offload tier, HostOffload)


class BlockPool:
    """Block ids, reference counts, the free (eviction) queue and the hash → block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.events: list[KVEvent] = []
        self.record_events = True  # False: nobody publishes them (stores and evictions still happen)
        self.on_evict: Callable[[list[int]], None] | None = None  # told the hashes evicted (offload tier)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses (out of the free queue if idle)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks from the head of the free queue, evicting their old hashes."""
        if count > len(self.free):
            return None
        blocks: list[int] = []
        removed: list[int] = []
        popitem = self.free.popitem
        block_hash, cached, ref_cnt = self.block_hash, self.cached, self.ref_cnt
        for _ in range(count):
            block, _none = popitem(last=False)
            old = block_hash[block]
            if old is not None:
                block_hash[block] = None
                if cached.get(old) == block:
                    del cached[old]
                    removed.append(old)
            ref_cnt[block] = 1
            blocks.append(block)
        if removed and self.record_events:
            self.events.extend(KVEvent("removed", (h,)) for h in removed)
        if removed and self.on_evict is not None:
            self.on_evict(removed)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; idle blocks join the free queue's tail, last block first."""
        ref_cnt, free = self.ref_cnt, self.free
        for block in reversed(blocks):
            count = ref_cnt[block] - 1
            ref_cnt[block] = count
            if count == 0:
                free[block] = None

    def store(self, block: int, block_hash: int) -> bool:
        """Record a full block under its hash; False when another block already holds that content."""
        if block_hash in self.cached:
            return False
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return True

    def reset(self) -> bool:
        """Forget every hash (vLLM's reset_prefix_cache); refused while any block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        self.block_hash = [None] * self.num_blocks
        self.cached.clear()
        self.events.append(KVEvent("cleared"))
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class KVCacheManager:
    """Per-request block bookkeeping on top of a `BlockPool` (vLLM's KVCacheManager, one group)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.offload: HostOffload | None = None  # the host-DRAM tier, when the engine has one

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _ensure_hashes(self, req: Request, num_blocks: int) -> None:
        hashes = req.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self.block_size
        first = len(hashes) * bs
        parent = hashes[-1] if hashes else NONE_HASH
        salt = lora_salt(req.cache_salt, req.lora_name) if first == 0 else None  # the adapter salts too (sim/lora.py)
        chain_hashes(hashes, parent, _tokens(req, first, num_blocks * bs), bs, salt)

    def computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached blocks matching the request's tokens, leaving at least the last token
        to compute (vLLM recomputes it to get logits)."""
        if not self.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks)
        hits: list[int] = []
        lookup = self.pool.cached.get
        for block_hash in req.block_hashes[:max_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed: Sequence[int] = (),
        store: bool = True,
    ) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones (and after any
        newly reused cached blocks); False, changing nothing, when the pool cannot.

        Blocks that the known tokens fill are cached right away (vLLM caches at allocation), unless
        `store` is False: KV still to arrive from a remote prefill must not be matched before it lands.
        """
        bs = self.block_size
        if not new_computed:
            total = req.num_computed + num_new_tokens
            if total <= len(req.blocks) * bs:  # fits in the blocks it holds (most decode steps)
                if store and self.enable_caching:
                    known = min(total, req.num_prompt + req.num_output)
                    if known // bs > req.num_stored_blocks:
                        self.store_full_blocks(req, known)
                return True
        total = req.num_computed + len(new_computed) * bs + num_new_tokens
        needed = -(-total // bs) - len(req.blocks) - len(new_computed)
        idle_reused = sum(1 for b in new_computed if self.pool.ref_cnt[b] == 0)
        if max(needed, 0) + idle_reused > self.pool.num_free:
            return False
        if new_computed:
            self.pool.touch(new_computed)
            req.blocks.extend(new_computed)
            req.num_stored_blocks = len(req.blocks)
        if needed > 0:
            fresh = self.pool.allocate(needed)
            assert fresh is not None
            req.blocks.extend(fresh)
        if store:
            self.store_full_blocks(req, min(total, req.num_tokens))
        return True

    def store_full_blocks(self, req: Request, num_known_tokens: int) -> None:
        """Hash and cache the request's blocks that `num_known_tokens` fill, as one stored event."""
        if not self.enable_caching:
            return
        full = min(num_known_tokens // self.block_size, len(req.blocks))
        first = req.num_stored_blocks
        if full <= first:
            return
        self._ensure_hashes(req, full)
        pool = self.pool
        blocks, hashes = req.blocks, req.block_hashes
        if not pool.record_events:
            cached, block_hash = pool.cached, pool.block_hash
            for index in range(first, full):  # BlockPool.store, inlined
                digest = hashes[index]
                if digest not in cached:
                    block_hash[blocks[index]] = digest
                    cached[digest] = blocks[index]
            req.num_stored_blocks = full
            return
        bs = self.block_size
        run_start = first
        for index in range(first, full + 1):
            stored = index < full and pool.store(blocks[index], hashes[index])
            if stored:
                continue
            if index > run_start:  # one event per contiguous run of newly cached blocks
                parent = hashes[run_start - 1] if run_start else None
                extra: tuple[tuple[str, ...] | None, ...] | None = None
                if req.lora_name:  # vLLM names the adapter first in every block's keys, block 0's salt after it
                    lora, salt = req.lora_name, req.cache_salt
                    extra = tuple((lora, salt) if i == 0 and salt else (lora,) for i in range(run_start, index))
                elif run_start == 0 and req.cache_salt:
                    extra = ((req.cache_salt,), *([None] * (index - 1)))
                pool.events.append(
                    KVEvent(
                        "stored",
                        tuple(hashes[run_start:index]),
                        parent,
                        tuple(_tokens(req, run_start * bs, index * bs)),
                        extra,
                        req.lora_name,
                    )
                )
            run_start = index + 1
        req.num_stored_blocks = full

    def free(self, req: Request) -> None:
        """Release the request's blocks (they stay cached until evicted)."""
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_stored_blocks = 0

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset()
        if ok and self.offload is not None:
            self.offload.clear()
        return ok


# --- the host-DRAM tier ---------------------------------------------------------------------------

CPU_MEDIUM = "CPU"


@dataclass(slots=True)
class OffloadStats:
    """Counts since start: what went to DRAM, what came back, what it cost."""

    offloaded_blocks: int = 0
    evicted_blocks: int = 0
    loads: int = 0
    loaded_blocks: int = 0
    load_s: float = 0.0


class HostOffload:
    def __init__(self, capacity_blocks: int, bandwidth_bytes_per_s: float, bytes_per_block: int) -> None:
        if capacity_blocks <= 0 or bandwidth_bytes_per_s <= 0 or bytes_per_block <= 0:
            raise ValueError("an offload tier needs a capacity, a bandwidth and a block size > 0")
        self.capacity_blocks = capacity_blocks
        self.bandwidth = bandwidth_bytes_per_s
        self.bytes_per_block = bytes_per_block
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.loading: dict[str, int] = {}  # request id -> tokens being loaded for it
        self.stats = OffloadStats()
        self._pool: BlockPool | None = None
        self.store: SharedStore | None = None  # the pool's shared store below DRAM (SharedStore)
        self._from_store: dict[str, int] = {}  # request id -> blocks of its matched run held by the store

    @classmethod
    def for_config(cls, config: EngineConfig) -> HostOffload:
        """The tier an engine's config asks for (`kv_offload_blocks` > 0)."""
        bytes_per_block = config.block_size * kv_bytes_per_token_per_device(config.preset)
        return cls(config.kv_offload_blocks, config.kv_offload_bandwidth, bytes_per_block)

    def attach(self, kv: KVCacheManager) -> HostOffload:
        """Become `kv`'s lower tier: HBM evictions land here."""
        kv.offload = self
        kv.pool.on_evict = self.offload
        self._pool = kv.pool
        return self

    # --- HBM -> DRAM ---------------------------------------------------------------------------------

    def offload(self, hashes: Sequence[int]) -> None:
        """Blocks left HBM: keep them (most recent last), dropping the least recent past capacity."""
        blocks = self.blocks
        stored: list[int] = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        removed: list[int] = []
        while len(blocks) > self.capacity_blocks:
            removed.append(blocks.popitem(last=False)[0])
        self.stats.offloaded_blocks += len(stored)
        self.stats.evicted_blocks += len(removed)
        if self.store is not None and self.store.write == WRITE_ON_EVICT:
            self.store.put(hashes)
        pool = self._pool
        if pool is not None and pool.record_events:
            if stored:
                pool.events.append(KVEvent("stored", tuple(stored), medium=CPU_MEDIUM))
            if removed:
                pool.events.append(KVEvent("removed", tuple(removed), medium=CPU_MEDIUM))

    # --- DRAM -> HBM ---------------------------------------------------------------------------------

    def match(self, req: Request, start_block: int, max_blocks: int) -> int:
        """Consecutive blocks of `req` from `start_block` (its HBM hits end there) held in DRAM, then
        in the shared store, up to `max_blocks` in all; they are touched, so loading them does not race
        their eviction."""
        hashes = req.block_hashes
        blocks = self.blocks
        n = 0
        end = min(max_blocks, len(hashes))
        while start_block + n < end and hashes[start_block + n] in blocks:
            blocks.move_to_end(hashes[start_block + n])
            n += 1
        if self.store is not None:
            shared = self.store.run(hashes, start_block + n, end)
            if shared:
                self._from_store[req.request_id] = shared
            else:
                self._from_store.pop(req.request_id, None)
            n += shared
        return n

    def start_load(self, req: Request, num_blocks: int, block_size: int, now_s: float) -> float:
        """Begin loading `num_blocks` blocks for `req`; returns when they are in HBM (simulated s)."""
        shared = min(self._from_store.pop(req.request_id, 0), num_blocks)
        local = num_blocks - shared
        load_s = local * self.bytes_per_block / self.bandwidth
        if shared and self.store is not None:
            load_s += self.store.record_load(shared)
        self.loading[req.request_id] = num_blocks * block_size
        stats = self.stats
        stats.loads += 1
        stats.loaded_blocks += local
        stats.load_s += load_s
        return now_s + load_s

    def finish_load(self, req: Request) -> int | None:
        """The tokens loaded for `req` (None: it was not loading from DRAM)."""
        return self.loading.pop(req.request_id, None)

    def clear(self) -> None:
        """The prefix cache was reset (AllBlocksCleared covers every medium)."""
        self.blocks.clear()


# --- the shared store -----------------------------------------------------------------------------

STORE_MEDIUM = "STORE"
WRITE_ON_EVICT = "evict"
WRITE_ON_COMPUTE = "compute"


@dataclass(slots=True)
class StoreStats:
    """Counts since start: what was written, dropped and read back, and what the reads cost."""

    written_blocks: int = 0
    evicted_blocks: int = 0
    loads: int = 0
    loaded_blocks: int = 0
    load_s: float = 0.0


class SharedStore:
    def __init__(
        self,
        capacity_blocks: int,
        bandwidth_bytes_per_s: float,
        latency_s: float,
        bytes_per_block: int,
        write: str = WRITE_ON_EVICT,
    ) -> None:
        if capacity_blocks <= 0 or bandwidth_bytes_per_s <= 0 or bytes_per_block <= 0 or latency_s < 0:
            raise ValueError("a KV store needs a capacity, a bandwidth and a block size > 0 and a latency >= 0")
        if write not in (WRITE_ON_EVICT, WRITE_ON_COMPUTE):
            raise ValueError(f"write must be {WRITE_ON_EVICT!r} or {WRITE_ON_COMPUTE!r}")
        self.write = write
        self.capacity_blocks = capacity_blocks
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.bytes_per_block = bytes_per_block
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.events: list[KVEvent] = []
        self.stats = StoreStats()

    def put(self, hashes: Sequence[int]) -> None:
        """An engine wrote these blocks: keep them (most recent last), dropping the least recent past capacity."""
        blocks = self.blocks
        stored: list[int] = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        removed: list[int] = []
        while len(blocks) > self.capacity_blocks:
            removed.append(blocks.popitem(last=False)[0])
        self.stats.written_blocks += len(stored)
        self.stats.evicted_blocks += len(removed)
        if stored:
            self.events.append(KVEvent("stored", tuple(stored), medium=STORE_MEDIUM))
        if removed:
            self.events.append(KVEvent("removed", tuple(removed), medium=STORE_MEDIUM))

    def run(self, hashes: Sequence[int], start: int, end: int, *, touch: bool = True) -> int:
        """Consecutive blocks of `hashes[start:end]` the store holds; touched unless `touch` is False
        (so loading them does not race their eviction)."""
        blocks = self.blocks
        n = 0
        end = min(end, len(hashes))
        while start + n < end and hashes[start + n] in blocks:
            if touch:
                blocks.move_to_end(hashes[start + n])
            n += 1
        return n

    def load_s(self, num_blocks: int) -> float:
        """Seconds to read `num_blocks` blocks back into one engine's HBM (0 for none)."""
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.bytes_per_block / self.bandwidth

    def record_load(self, num_blocks: int) -> float:
        load_s = self.load_s(num_blocks)
        stats = self.stats
        stats.loads += 1
        stats.loaded_blocks += num_blocks
        stats.load_s += load_s
        return load_s

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
