"""The simulated engine's LoRA adapters: registration as vLLM answers it, GPU slots with LRU eviction
and load time, the scheduler's cap on adapters per batch, adapter-salted blocks and their events."""

from __future__ import annotations

import pytest

from backends.block_hash import hash_blocks, lora_salt
from sim.kv_cache import KVCacheManager
from sim.lora import LoraError, LoraSlots
from sim.scheduler import Request, Scheduler


def _req(rid: str, lora: str | None, prompt: list[int] | None = None) -> Request:
    ids = prompt or list(range(64))
    return Request(rid, ids, [1, 2, 3], "length", 0.0, 3, lora_name=lora)


def test_registration_answers_as_vllm_does() -> None:
    slots = LoraSlots(2)
    slots.register("a", "s3://bucket/a")
    with pytest.raises(LoraError) as again:
        slots.register("a", "s3://bucket/a")
    assert again.value.status == 400 and "already been loaded" in again.value.message
    with pytest.raises(LoraError) as missing:
        slots.register("b", "/no/such/dir")
    assert missing.value.status == 404
    slots.unregister("a")
    with pytest.raises(LoraError) as gone:
        slots.unregister("a")
    assert gone.value.status == 404


def test_loads_cost_time_and_evict_the_least_recently_used_idle_adapter() -> None:
    slots = LoraSlots(2, load_bandwidth=1e9, load_fixed_s=0.01, per_adapter_step_s=0.0)
    for name in ("a", "b", "c"):
        slots.register(name, f"s3://x/{name}", size_bytes=100_000_000)
    assert slots.step_cost_s({"a"}) == pytest.approx(0.11)
    assert slots.step_cost_s({"a"}) == 0.0  # resident: no load
    slots.step_cost_s({"b"})
    slots.step_cost_s({"a"})  # a used last: b is the least recently used
    slots.step_cost_s({"c"})
    assert list(slots.resident) == ["a", "c"] and slots.evictions == 1 and slots.loads == 3


def test_per_adapter_cost_grows_with_the_batch_adapters() -> None:
    slots = LoraSlots(4, per_adapter_step_s=0.001, load_fixed_s=0.0, load_bandwidth=1e18)
    for name in ("a", "b", "c"):
        slots.register(name, "s3://x")
    slots.step_cost_s({"a", "b", "c"})
    assert slots.step_cost_s({"a", "b", "c"}) == pytest.approx(0.003)
    assert slots.step_cost_s({"a"}) == pytest.approx(0.001)


def test_scheduler_batches_at_most_max_loras_adapters() -> None:
    kv = KVCacheManager(1000, 16)
    scheduler = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=8192)
    scheduler.lora = LoraSlots(2)
    for rid, lora in (("1", "a"), ("2", "b"), ("3", "c"), ("4", "a"), ("5", None)):
        scheduler.add(_req(rid, lora, list(range(int(rid) * 100, int(rid) * 100 + 64))))
    scheduler.schedule(0.0)
    running = {r.request_id for r in scheduler.running}
    assert running == {"1", "2", "4", "5"}  # c waits for a slot, the others pass it
    assert [r.request_id for r in scheduler.waiting] == ["3"]


def test_an_adapter_salts_its_blocks_and_names_itself_in_events() -> None:
    kv = KVCacheManager(100, 16)
    kv.pool.record_events = True
    base, adapted = _req("1", None), _req("2", "sql")
    assert kv.computed_blocks(base) == []
    kv.allocate_slots(base, 64)
    assert kv.computed_blocks(adapted) == []  # same tokens, another adapter: no shared block
    kv.allocate_slots(adapted, 64)
    assert adapted.block_hashes[:4] == hash_blocks(list(range(64)), 16, lora_salt(None, "sql"))
    names = [event.lora_name for event in kv.pool.drain_events() if event.kind == "stored"]
    assert names == [None, "sql"]


def test_an_adapters_events_name_it_first_in_every_blocks_extra_keys_as_vllm_does() -> None:
    """vLLM 0.32's `to_event_extra_keys`: the adapter in every block's keys, block 0's cache salt after it."""
    kv = KVCacheManager(100, 16)
    kv.pool.record_events = True
    request = _req("1", "sql")
    request.cache_salt = "tenant-1"
    kv.allocate_slots(request, 64)
    (event,) = [event for event in kv.pool.drain_events() if event.kind == "stored"]
    assert event.extra_keys == (("sql", "tenant-1"), ("sql",), ("sql",), ("sql",))
