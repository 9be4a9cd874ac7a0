"""What a gateway can observe of the schedule: caching, batching, preemption, aborts.

Every comparison uses the engine's own simulated timings (the response's `metrics` object and
/metrics), never the host's clock.
"""

from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from backends.perf.roofline import prefill_time_s
from sim.server import SimInstance
from tests.sim.conftest import chat_body, metric, post_json, scrape

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 120  # ~1.3k tokens


async def test_cached_prefix_gives_a_smaller_ttft(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    url = engine.url + "/v1/chat/completions"
    cold = await post_json(http, url, chat_body(LONG_PROMPT, max_tokens=2))
    warm = await post_json(http, url, chat_body(LONG_PROMPT, max_tokens=2))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000
    assert warm["metrics"]["ttft_s"] < 0.5 * cold["metrics"]["ttft_s"]
    samples = await scrape(http, engine.url)
    assert metric(samples, "vllm:prefix_cache_hits_total") == warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert metric(samples, "vllm:prefix_cache_queries_total") == 2 * cold["usage"]["prompt_tokens"]


async def test_appending_the_answer_hits_the_cache_through_it(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    url = engine.url + "/v1/chat/completions"
    turn1 = [{"role": "user", "content": LONG_PROMPT}]
    first = await post_json(http, url, {"messages": turn1, "max_tokens": 64, "ignore_eos": True})
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    second = await post_json(http, url, {"messages": turn2, "max_tokens": 4, "ignore_eos": True})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] + 48  # prompt and most of the answer's blocks


async def test_more_concurrency_means_longer_inter_token_latency(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    url = engine.url + "/v1/chat/completions"

    async def one(i: int) -> float:
        data = await post_json(http, url, chat_body(f"{i} {LONG_PROMPT}", max_tokens=16))
        return float(data["metrics"]["tpot_s"])

    alone = await one(-1)
    crowded = await asyncio.gather(*(one(i) for i in range(48)))
    assert statistics.median(crowded) > 1.2 * alone


@pytest.mark.parametrize("engine", [{"num_gpu_blocks_override": 64, "max_num_seqs": 16}], indirect=True)
async def test_exhausted_kv_blocks_cause_preemptions(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    url = engine.url + "/v1/chat/completions"
    before = metric(await scrape(http, engine.url), "vllm:num_preemptions_total")
    results = await asyncio.gather(
        *(post_json(http, url, chat_body(f"request {i} " + "tokens " * 80, max_tokens=150)) for i in range(8))
    )
    samples = await scrape(http, engine.url)
    assert metric(samples, "vllm:num_preemptions_total") > before
    assert sum(r["metrics"]["preemptions"] for r in results) > 0
    assert all(r["usage"]["completion_tokens"] == 150 for r in results)
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0.0


async def test_a_client_that_disconnects_is_aborted_and_freed(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    body = chat_body(LONG_PROMPT, max_tokens=5000, stream=True)
    async with http.post(engine.url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")  # the role chunk
        await resp.content.readuntil(b"\n\n")  # a first token
        assert engine.engine.kv.usage > 0
    for _ in range(200):
        samples = await scrape(http, engine.url)
        if metric(samples, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        await asyncio.sleep(0.01)
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(samples, "vllm:num_requests_running") == 0
    assert engine.engine.kv.usage == 0.0


async def test_an_idle_engines_ttft_is_the_frontend_and_one_prefill_step(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    preset = engine.engine.preset
    frontend = preset.efficiency.frontend_s
    assert frontend > 0
    data = await post_json(http, engine.url + "/v1/completions", {"prompt": "one two three", "max_tokens": 2})
    prompt = data["usage"]["prompt_tokens"]
    assert data["metrics"]["ttft_s"] == pytest.approx(frontend + prefill_time_s(preset, prompt), rel=1e-6)
