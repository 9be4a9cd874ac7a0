"""The shared KV store: what one engine evicted (or computed) another loads at the store's link instead
of recomputing, the store is one LRU for the pool, and it publishes its own events (medium STORE)."""

from __future__ import annotations

import pytest

from sim.kv_cache import STORE_MEDIUM, WRITE_ON_COMPUTE, HostOffload, KVCacheManager, SharedStore
from sim.scheduler import Request, Scheduler, Status

BLOCK = 4
BYTES_PER_BLOCK = 1000
DRAM_BANDWIDTH = 1e6  # 1 ms per block
STORE_BANDWIDTH = 1e5  # 10 ms per block
STORE_LATENCY_S = 0.005


def make(rid: str, prompt: list[int], output_len: int = 2) -> Request:
    return Request(rid, prompt, [1] * output_len, "length", 0.0, output_len)


def engine(store: SharedStore, hbm_blocks: int = 4, dram_blocks: int = 16) -> tuple[Scheduler, HostOffload]:
    kv = KVCacheManager(hbm_blocks, BLOCK)
    offload = HostOffload(dram_blocks, DRAM_BANDWIDTH, BYTES_PER_BLOCK).attach(kv)
    offload.store = store
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=4096), offload


def run(scheduler: Scheduler, now: float = 0.0, limit: int = 1000) -> float:
    for _ in range(limit):
        if not (scheduler.has_work() or scheduler.pulls_done):
            break
        step = scheduler.schedule(now)
        now += 0.01
        scheduler.complete_step(step, now)
    return now


def store(capacity_blocks: int = 64, write: str = "evict") -> SharedStore:
    return SharedStore(capacity_blocks, STORE_BANDWIDTH, STORE_LATENCY_S, BYTES_PER_BLOCK, write)


def test_what_one_engine_evicted_another_loads_from_the_store() -> None:
    shared = store()
    first, _ = engine(shared)
    second, second_dram = engine(shared)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    first.add(make("a", a))
    now = run(first)
    first.add(make("b", list(range(500, 513))))  # pushes a's blocks out of the first engine's HBM
    now = run(first, now)
    events = shared.drain_events()
    assert events and all(e.medium == STORE_MEDIUM and e.kind == "stored" for e in events)
    again = make("a2", [*a, 7])
    second.add(again)  # the second engine never saw `a`: not in its HBM nor its DRAM
    step = second.schedule(now)
    assert step.empty and again.status is Status.PULLING
    assert second.next_pull_s() == pytest.approx(now + STORE_LATENCY_S + 3 * BYTES_PER_BLOCK / STORE_BANDWIDTH)
    run(second, now)
    assert again.finished and again.num_cached_tokens == 3 * BLOCK
    assert shared.stats.loads == 1 and shared.stats.loaded_blocks == 3
    assert second_dram.stats.loaded_blocks == 0  # the DRAM counters count DRAM loads only


def test_a_run_goes_on_from_dram_into_the_store_and_both_loads_are_priced() -> None:
    shared = store()
    sched, dram = engine(shared, hbm_blocks=8)
    prompt = list(range(100, 117))  # 4 full blocks + 1 token
    req = make("r", prompt)
    sched.kv.computed_blocks(req)  # hashes the prompt's blocks (nothing cached yet)
    dram.offload(req.block_hashes[:2])  # blocks 0-1 in this engine's DRAM (and written to the store) ...
    shared.put(req.block_hashes[2:4])  # ... 2-3 only in the store (another engine wrote them)
    sched.add(req)
    sched.schedule(0.0)
    expected = 2 * BYTES_PER_BLOCK / DRAM_BANDWIDTH + STORE_LATENCY_S + 2 * BYTES_PER_BLOCK / STORE_BANDWIDTH
    assert sched.next_pull_s() == pytest.approx(expected)
    run(sched)
    assert req.num_cached_tokens == 4 * BLOCK
    assert dram.stats.loaded_blocks == 2 and shared.stats.loaded_blocks == 2


def test_the_store_is_one_lru_for_the_pool_and_publishes_what_it_drops() -> None:
    shared = store(capacity_blocks=2, write=WRITE_ON_COMPUTE)
    shared.put([1, 2])
    shared.put([1])  # touched: 2 is now the least recently used
    shared.put([3])
    assert list(shared.blocks) == [1, 3]
    removed = [h for e in shared.drain_events() if e.kind == "removed" for h in e.block_hashes]
    assert removed == [2]
    assert shared.stats.written_blocks == 3 and shared.stats.evicted_blocks == 1


def test_a_store_written_on_compute_is_not_written_on_eviction() -> None:
    shared = store(write=WRITE_ON_COMPUTE)
    sched, _ = engine(shared)
    sched.add(make("a", list(range(100, 113))))
    now = run(sched)
    sched.add(make("b", list(range(500, 513))))
    run(sched, now)
    assert not shared.blocks  # its owner puts what the engine computed (bench/kv_tiers), not the evictions


def test_a_store_needs_a_size_and_a_link() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SharedStore(0, 1e9, 0.0, 1000)
    with pytest.raises(ValueError, match="write"):
        SharedStore(1, 1e9, 0.0, 1000, write="sometimes")
