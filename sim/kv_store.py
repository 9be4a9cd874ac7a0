"""A KV store shared by a pool's simulated engines (LMCache's remote backend, Mooncake Store), priced.

- One LRU of `capacity_blocks` block hashes for the whole pool, so a block one engine computed can be
  loaded by any other instead of recomputed. `write` says when blocks get there: `evict` (every
  attached engine writes its HBM evictions, as it writes them to its own host DRAM, `kv_offload.py`)
  or `compute` (as LMCache stores a request's KV once computed: the engine's owner puts the blocks of
  its GPU `stored` events, `put`, when the step that computed them ends).
- A waiting request's prefix goes on in the store after its HBM and DRAM runs: those blocks are
  loaded at `latency_s + bytes / bandwidth` (a fixed cost per load, then the link; the DRAM run's
  PCIe load is added before it), the load priced like the DRAM one in `HostOffload.start_load`.
- The store publishes its own events (`drain_events`): `stored` when it takes blocks, `removed` when
  its LRU drops them, medium `STORE`, hashes only. A router fed them (`ScoringRouter.on_store_batch`)
  counts those blocks on every replica of the pool (policies/routing/prefix/precise.py).

The store is in-process: engines sharing it run on one virtual clock (bench/kv_tiers). Writes are
free and instant (a real store's writes overlap compute); reads are what the benchmark prices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sim.kv_cache import KVEvent

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
