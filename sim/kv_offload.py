"""Host-DRAM offload tier of one simulated engine: what vLLM's OffloadingConnector does, priced.

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

- With a pool's shared store attached (`store`, `kv_store.py`), evictions are written there too (a
  store that writes on eviction), and
  the run a request loads goes on through the store's blocks after the DRAM ones (the DRAM part over
  PCIe, then the store part over the store's link).

`kv_cache.KVCacheManager.offload` holds the tier; `attach` wires the eviction hook.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.perf.capacity import kv_bytes_per_token_per_device
from sim.kv_cache import KVEvent
from sim.kv_store import WRITE_ON_EVICT

if TYPE_CHECKING:
    from sim.config import EngineConfig
    from sim.kv_cache import BlockPool, KVCacheManager
    from sim.kv_store import SharedStore
    from sim.request import Request

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
        self.store: SharedStore | None = None  # the pool's shared store below DRAM (kv_store.py)
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
