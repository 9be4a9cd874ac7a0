"""The simulated engine's LoRA memory budget (`--lora-memory-budget-mb`): the adapters on its GPU stay
within it beside `max_loras` (least recently used idle ones evicted first), a batch's adapters fit it
together, an adapter larger than the whole budget is refused at registration, and a launched `engine:
sim` pool is started with its `lora_memory_budget_mb`."""

from __future__ import annotations

import pytest

from backends.adapters.vllm import SIM, VLLM
from sim.config import build_engine_config
from sim.lora import LoraError, LoraSlots
from tests.backends.builders import pool, replica

MB = 1024 * 1024


def test_resident_adapters_stay_within_the_budget() -> None:
    slots = LoraSlots(8, load_bandwidth=1e9, load_fixed_s=0.0, per_adapter_step_s=0.0, memory_budget=200 * MB)
    for name in ("a", "b", "c"):
        slots.register(name, f"s3://x/{name}", size_bytes=90 * MB)
    slots.step_cost_s({"a"})
    slots.step_cost_s({"b"})
    assert list(slots.resident) == ["a", "b"]  # 180 MB of 200
    slots.step_cost_s({"c"})  # 270 MB would not fit: a, the least recently used, goes
    assert list(slots.resident) == ["b", "c"] and slots.evictions == 1
    # two at once fit (180 MB); a third joins no batch that holds two
    assert slots.admissible("c", {"b"}) and not slots.admissible("a", {"b", "c"})


def test_an_adapter_larger_than_the_budget_is_refused() -> None:
    slots = LoraSlots(8, memory_budget=100 * MB)
    with pytest.raises(LoraError) as refused:
        slots.register("huge", "s3://x/huge", size_bytes=101 * MB)
    assert refused.value.status == 400 and "huge" in refused.value.message
    assert not slots.knows("huge")


def test_the_flag_reaches_the_engine_config() -> None:
    config = build_engine_config("llama-3.1-8b@h100", enable_lora=True, lora_memory_budget_mb=512)
    assert config.lora_memory_budget == 512 * MB
    with pytest.raises(ValueError, match="lora-memory-budget-mb"):
        build_engine_config("llama-3.1-8b@h100", enable_lora=True, lora_memory_budget_mb=0)


def test_a_launched_sim_pool_gets_the_gateways_budget() -> None:
    with_budget = SIM.launch_spec(pool(engine="sim", lora_memory_budget_mb=512), replica())
    assert list(with_budget.argv[-2:]) == ["--lora-memory-budget-mb", "512"]
    assert "--lora-memory-budget-mb" not in SIM.launch_spec(pool(engine="sim"), replica()).argv
    assert "--lora-memory-budget-mb" not in VLLM.launch_spec(pool(lora_memory_budget_mb=512), replica()).argv
