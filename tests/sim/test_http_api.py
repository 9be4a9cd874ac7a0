"""The vLLM-shaped HTTP surface, over a real socket."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from backends.tokenization import chat_prompt_ids, completion_prompt_ids
from sim.server import SimInstance, run_sim_engines
from tests.sim.conftest import chat_body, metric, post_json, scrape

REQUIRED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:cache_config_info",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count",
)


async def test_chat_completion_reports_exact_usage_and_simulated_timings(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    data = await post_json(
        http, engine.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "ignore_eos": True}
    )
    assert data["object"] == "chat.completion"
    assert data["usage"]["prompt_tokens"] == len(chat_prompt_ids(messages))
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["choices"][0]["message"]["content"]
    timings = data["metrics"]
    assert 0 < timings["ttft_s"] < timings["e2e_s"] and timings["tpot_s"] > 0


async def test_completion_with_token_id_prompt(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    data = await post_json(
        http, engine.url + "/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "ignore_eos": True}
    )
    assert data["object"] == "text_completion"
    assert data["usage"]["prompt_tokens"] == 5 and data["usage"]["completion_tokens"] == 3
    text_prompt = await post_json(http, engine.url + "/v1/completions", {"prompt": "one two", "max_tokens": 2})
    assert text_prompt["usage"]["prompt_tokens"] == len(completion_prompt_ids("one two"))


@pytest.mark.slow
async def test_output_length_without_ignore_eos_is_seeded_and_capped(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 1000}
    first = await post_json(http, engine.url + "/v1/chat/completions", body)
    again = await post_json(http, engine.url + "/v1/chat/completions", body)
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert 1 <= first["usage"]["completion_tokens"] <= 1000
    capped = await post_json(http, engine.url + "/v1/chat/completions", {**body, "max_tokens": 1})
    assert capped["usage"]["completion_tokens"] == 1 and capped["choices"][0]["finish_reason"] == "length"


async def test_streaming_sends_role_tokens_finish_usage_and_done(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    body = chat_body("stream please", max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with http.post(engine.url + "/v1/chat/completions", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-tokenway-sim"] == "1"
        events = [line for line in (await resp.text()).split("\n\n") if line]

    assert events[-1] == "data: [DONE]"
    chunks: list[dict[str, Any]] = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert "ttft_s" in finals[0]["metrics"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) >= 5


async def test_models_version_tokenize_and_health(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    async with http.get(engine.url + "/v1/models") as resp:
        (model,) = (await resp.json())["data"]
    assert model["id"] == engine.engine.config.served_model_name
    assert model["owned_by"] == "vllm" and model["max_model_len"] == engine.engine.config.max_model_len
    async with http.get(engine.url + "/version") as resp:
        assert (await resp.json()) == {"version": "0.33.0"}
    async with http.get(engine.url + "/health") as resp:
        assert resp.status == 200
    messages = [{"role": "user", "content": "count me"}]
    tokens = await post_json(http, engine.url + "/tokenize", {"messages": messages})
    assert tokens["tokens"] == chat_prompt_ids(messages) and tokens["count"] == len(tokens["tokens"])


@pytest.mark.parametrize("engine", [{"max_model_len": 64, "num_gpu_blocks_override": 100}], indirect=True)
async def test_context_overflow_is_a_400_in_openai_shape(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("word " * 100)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert "maximum context length" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    async with http.post(engine.url + "/v1/chat/completions", json=chat_body("hi", max_tokens=60)) as resp:
        assert resp.status == 400


async def test_unknown_model_and_bad_bodies(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/v1/chat/completions", json={**chat_body("x"), "model": "nope"}) as resp:
        assert resp.status == 404
    async with http.post(engine.url + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
    async with http.post(engine.url + "/v1/chat/completions", json={**chat_body("x"), "n": 99}) as resp:
        assert resp.status == 400


async def test_api_key_guards_v1_only(http: aiohttp.ClientSession) -> None:
    async with run_sim_engines(api_key="secret", time_scale=20) as (instance,):
        async with http.get(instance.url + "/v1/models") as resp:
            assert resp.status == 401
        async with http.get(instance.url + "/v1/models", headers={"Authorization": "Bearer secret"}) as resp:
            assert resp.status == 200
        for path in ("/health", "/metrics", "/version"):
            async with http.get(instance.url + path) as resp:
                assert resp.status == 200


async def test_metrics_parse_and_carry_vllm_names_and_labels(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    await post_json(http, engine.url + "/v1/chat/completions", chat_body("metrics please", max_tokens=4))
    samples = await scrape(http, engine.url)
    names = {name for name, _ in samples}
    missing = [n for n in REQUIRED_METRICS if n not in names]
    assert not missing
    served = engine.engine.config.served_model_name
    for name, labels in samples:
        if name.startswith("vllm:"):
            assert dict(labels)["model_name"] == served and dict(labels)["engine"] == "0", name
    assert metric(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(samples, "vllm:generation_tokens_total") == 4
    info = [dict(labels) for (name, labels) in samples if name == "vllm:cache_config_info"]
    assert info[0]["block_size"] == "16"
    assert int(info[0]["num_gpu_blocks"]) == engine.engine.config.num_gpu_blocks
    assert info[0]["enable_prefix_caching"] == "True"
