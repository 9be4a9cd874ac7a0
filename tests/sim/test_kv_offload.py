"""The host-DRAM offload tier: HBM evictions land in DRAM, a DRAM hit is loaded (for its transfer time)
instead of recomputed, and the KV events carry the medium as vLLM's offloading connector publishes it."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from backends.adapters.vllm import VllmAdapter
from backends.kv_events import decode_frames
from backends.tokenization import chat_prompt_ids
from backends.types import Endpoint, EndpointState
from policies.routing.prefix_blocks import ENGINE_HASHERS, HashedPrompt
from policies.routing.prefix_precise import PrecisePrefixIndex
from policies.types import Principal, RequestFacts
from sim.config import build_engine_config
from sim.kv_cache import HostOffload, KVCacheManager, KVEvent
from sim.kv_events import encode_event
from sim.scheduler import Request, Scheduler, Status
from sim.server import run_sim_engines
from tests.sim.conftest import post_json
from tests.support.procs import free_port

BLOCK = 4
BYTES_PER_BLOCK = 1000
BANDWIDTH = 1e6  # 1 ms per block
PRINCIPAL = Principal(key_id="k", tenant="t", allowed_models=None, priority=0)


def make(rid: str, prompt: list[int], output_len: int = 2) -> Request:
    return Request(rid, prompt, [1] * output_len, "length", 0.0, output_len)


def engine(hbm_blocks: int, dram_blocks: int) -> tuple[Scheduler, HostOffload]:
    kv = KVCacheManager(hbm_blocks, BLOCK)
    offload = HostOffload(dram_blocks, BANDWIDTH, BYTES_PER_BLOCK).attach(kv)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=4096), offload


def run(scheduler: Scheduler, now: float = 0.0, limit: int = 1000) -> float:
    for _ in range(limit):
        if not (scheduler.has_work() or scheduler.pulls_done):
            break
        step = scheduler.schedule(now)
        now += 0.01
        scheduler.complete_step(step, now)
    return now


def drain(scheduler: Scheduler) -> list[KVEvent]:
    return scheduler.kv.pool.drain_events()


def test_blocks_evicted_from_hbm_are_offloaded_with_cpu_events() -> None:
    scheduler, offload = engine(hbm_blocks=4, dram_blocks=16)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    scheduler.add(make("a", a))
    now = run(scheduler)
    drain(scheduler)
    scheduler.add(make("b", list(range(500, 513))))  # needs the HBM blocks a left behind
    run(scheduler, now)
    events = drain(scheduler)
    gpu_removed = [h for e in events if e.kind == "removed" and e.medium == "GPU" for h in e.block_hashes]
    cpu_stored = [e for e in events if e.kind == "stored" and e.medium == "CPU"]
    assert gpu_removed and {h for e in cpu_stored for h in e.block_hashes} == set(gpu_removed)
    assert all(e.parent_block_hash is None and e.token_ids == () for e in cpu_stored)  # hashes only, as vLLM's
    assert offload.stats.offloaded_blocks == len(gpu_removed)


def test_a_dram_hit_is_loaded_for_its_transfer_time_instead_of_recomputed() -> None:
    scheduler, offload = engine(hbm_blocks=4, dram_blocks=16)
    a = list(range(100, 113))
    scheduler.add(make("a", a))
    now = run(scheduler)
    scheduler.add(make("b", list(range(500, 513))))
    now = run(scheduler, now)
    assert not scheduler.kv.computed_blocks(make("probe", [*a, 7]))  # gone from HBM
    drain(scheduler)
    again = make("a2", [*a, 7])  # a's 3 blocks, then new tokens
    scheduler.add(again)
    step = scheduler.schedule(now)
    assert step.empty and again.status is Status.PULLING  # waiting for its load, computing nothing
    assert scheduler.next_pull_s() == now + 3 * BYTES_PER_BLOCK / BANDWIDTH
    run(scheduler, now)
    assert again.finished
    assert again.num_cached_tokens == 3 * BLOCK  # counted as cached: not recomputed
    assert offload.stats.loads == 1 and offload.stats.loaded_blocks == 3
    assert again.first_token_s is not None and again.first_token_s >= now + 0.003
    restored = [e for e in drain(scheduler) if e.kind == "stored" and e.medium == "GPU"]
    assert restored and restored[0].block_hashes[0] == again.block_hashes[0]  # back in HBM, published


def test_dram_is_an_lru_of_its_capacity() -> None:
    scheduler, offload = engine(hbm_blocks=4, dram_blocks=2)
    now = 0.0
    for i in range(3):
        scheduler.add(make(str(i), list(range(1000 * i, 1000 * i + 13))))
        now = run(scheduler, now)
    events = drain(scheduler)
    assert len(offload.blocks) == 2
    assert any(e.kind == "removed" and e.medium == "CPU" for e in events)
    assert offload.stats.evicted_blocks == offload.stats.offloaded_blocks - 2


def test_a_reset_clears_the_offload_tier() -> None:
    scheduler, offload = engine(hbm_blocks=4, dram_blocks=16)
    scheduler.add(make("a", list(range(13))))
    now = run(scheduler)
    scheduler.add(make("b", list(range(500, 513))))
    run(scheduler, now)
    assert offload.blocks
    assert scheduler.kv.reset_prefix_cache()
    assert not offload.blocks


def test_events_carry_the_medium_in_both_wire_shapes() -> None:
    stored = KVEvent("stored", (1, 2), medium="CPU")
    removed = KVEvent("removed", (1,), medium="CPU")
    tagged = encode_event(stored, 16, positional=False)
    assert tagged["medium"] == "CPU" and tagged["token_ids"] == [] and tagged["parent_block_hash"] is None
    assert encode_event(removed, 16, positional=False)["medium"] == "CPU"
    assert encode_event(stored, 16, positional=True)[6] == "CPU"
    assert encode_event(removed, 16, positional=True) == ["BlockRemoved", [1], "CPU"]
    msgpack.packb(tagged)


def test_kv_offloading_size_is_gib_of_host_memory() -> None:
    config = build_engine_config("llama-3.1-8b@h100", kv_offloading_size_gib=2.0, kv_offload_bandwidth_gbps=20)
    # Llama-3.1-8B: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, 2 MiB per 16-token block
    assert config.kv_offload_blocks == 1024
    assert config.kv_offload_bandwidth == 20e9
    assert build_engine_config("llama-3.1-8b@h100").kv_offload_blocks == 0


@pytest.mark.slow
async def test_an_offloading_engine_publishes_cpu_blocks_the_precise_index_routes_to(
    http: aiohttp.ClientSession,
) -> None:
    """Real sockets: a small-HBM engine with a DRAM tier evicts a prompt to DRAM, publishes it with medium
    CPU over ZMQ, the router's precise index decodes it as a CPU-tier hit, and the prompt sent again is
    served from DRAM (counted as cached) instead of recomputed."""
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    first = [{"role": "user", "content": "first " * 150}]
    second = [{"role": "user", "content": "second " * 150}]
    body = {"max_tokens": 2, "ignore_eos": True}
    async with run_sim_engines(
        time_scale=20, kv_events_config=events, num_gpu_blocks_override=14, kv_offloading_size_gib=0.1
    ) as (instance,):
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        await asyncio.sleep(0.3)  # let the subscription reach the publisher
        url = instance.url + "/v1/chat/completions"
        await post_json(http, url, {"messages": first, **body})
        await post_json(http, url, {"messages": second, **body})  # evicts `first` from HBM
        index = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
        endpoint = Endpoint("e", "p", instance.url, "sim", "m", state=EndpointState.READY)
        ids = chat_prompt_ids(first)
        hashed = HashedPrompt(
            RequestFacts("r", "chat", {}, "m", "m", PRINCIPAL, prompt_tokens=len(ids), prompt_token_ids=ids)
        )
        async with asyncio.timeout(5):
            while True:
                index.apply("e", decode_frames(await sub.recv_multipart(), received_at_s=1.0))
                tiers = index.lookup_tiers(hashed, [endpoint], 1.0)[0]
                if tiers is not None and tiers.cpu > 0:  # HBM kept the head, DRAM has the tail
                    break
        sub.close()
        again = await post_json(http, url, {"messages": first, **body})
    assert tiers.gpu > 0 and tiers.cpu >= 16 * 4
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= tiers.total  # not recomputed
    assert instance.engine.kv.offload is not None and instance.engine.kv.offload.stats.loads == 1


async def test_the_offload_traffic_is_in_the_metrics_as_vllm_names_it_and_the_gateway_reads_it(
    http: aiohttp.ClientSession,
) -> None:
    """`vllm:kv_offload_total_bytes{transfer_type}` (vLLM's OffloadingConnector): what went to DRAM and
    came back; the vLLM adapter reads it into the endpoint's stats (`kv_offload_bytes`)."""
    async with run_sim_engines(count=1, time_scale=50, num_gpu_blocks_override=64, kv_offloading_size_gib=1) as (one,):
        first = "one long prompt " * 200  # 600-odd tokens: most of HBM's 64 blocks of 16
        for text in (first, "another long prompt " * 200, first):
            await post_json(http, one.url + "/v1/completions", {"prompt": text, "max_tokens": 1})
        async with http.get(one.url + "/metrics") as resp:
            text = await resp.text()
    stats = VllmAdapter().parse_metrics(text)
    assert stats.kv_offload_bytes["gpu_to_cpu"] > 0  # evicted from HBM to DRAM
    assert stats.kv_offload_bytes["cpu_to_gpu"] > 0  # the first prompt came back from DRAM
    assert 'vllm:kv_offload_total_time_total{engine="0"' in text
