"""POST /v1/embeddings: vLLM's response shape, deterministic unit vectors, prefill-only scheduling."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

from backends.tokenization import encode
from sim import http_api
from sim.server import SimInstance
from tests.sim.conftest import metric, post_json, scrape

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LONG_TEXT = "Embeddings turn text into vectors that can be compared. " * 150  # ~1.5k tokens


async def test_openai_client_gets_unit_vectors_and_exact_usage(engine: SimInstance) -> None:
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    model = engine.engine.config.served_model_name
    async with client:
        one = await client.embeddings.create(model=model, input="The quick brown fox")  # base64 on the wire
        assert one.object == "list" and one.model == model
        assert [d.index for d in one.data] == [0] and one.data[0].object == "embedding"
        vector = one.data[0].embedding
        assert len(vector) == 256 and math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5)
        assert one.usage.prompt_tokens == one.usage.total_tokens == len(encode("The quick brown fox"))

        batch = await client.embeddings.create(
            model=model, input=["The quick brown fox", "Stock markets fell"], dimensions=64, encoding_format="float"
        )
        assert [d.index for d in batch.data] == [0, 1] and all(len(d.embedding) == 64 for d in batch.data)
        assert batch.usage.prompt_tokens == len(encode("The quick brown fox")) + len(encode("Stock markets fell"))
        again = await client.embeddings.create(model=model, input="The quick brown fox", encoding_format="float")
        assert np.allclose(again.data[0].embedding, vector, atol=1e-7)  # same input, same vector

        ids = await client.embeddings.create(model=model, input=[[1, 2, 3], [4, 5]])
        assert ids.usage.prompt_tokens == 5 and len(ids.data) == 2


async def test_similar_texts_are_closer_than_unrelated_ones(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    texts = [
        "The quick brown fox jumps over the lazy dog",
        "The quick brown fox jumped over the lazy cat",
        "Inflation fears sent stock markets sharply lower on Tuesday",
    ]
    data = await post_json(http, engine.url + "/v1/embeddings", {"input": texts})
    a, b, c = (np.asarray(d["embedding"]) for d in data["data"])
    assert float(a @ b) > 0.5 > abs(float(a @ c))
    assert data["usage"]["completion_tokens"] == 0 and data["id"].startswith("embd-")


async def test_base64_is_float32_little_endian_of_the_float_answer(
    engine: SimInstance, http: aiohttp.ClientSession
) -> None:
    url = engine.url + "/v1/embeddings"
    floats = (await post_json(http, url, {"input": "same text", "dimensions": 32}))["data"][0]["embedding"]
    encoded = (await post_json(http, url, {"input": "same text", "dimensions": 32, "encoding_format": "base64"}))[
        "data"
    ][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert list(struct.unpack("<32f", raw)) == pytest.approx(floats, abs=1e-7)
    expected = http_api.embed(encode("same text"), 32, engine.engine.config.seed)
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), expected)


@pytest.mark.slow
async def test_embeddings_run_as_prefill_only_requests(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    url = engine.url + "/v1/embeddings"
    before = await scrape(http, engine.url)
    await post_json(http, url, {"input": "short"})
    short = await scrape(http, engine.url)
    data = await post_json(http, url, {"input": LONG_TEXT})
    after = await scrape(http, engine.url)

    def delta(a: Samples, b: Samples, name: str, **labels: str) -> float:
        return metric(b, name, **labels) - metric(a, name, **labels)

    assert delta(before, after, "vllm:request_success_total", finished_reason="stop") == 2
    assert delta(before, after, "vllm:generation_tokens_total") == 0
    assert delta(short, after, "vllm:prompt_tokens_total") == data["usage"]["prompt_tokens"] > 1000
    # A 1.5k-token prompt takes longer to prefill than a 1-token one, in simulated time.
    assert delta(short, after, "vllm:e2e_request_latency_seconds_sum") > 2 * delta(
        before, short, "vllm:e2e_request_latency_seconds_sum"
    )
    assert metric(after, "vllm:kv_cache_usage_perc") == 0.0 and metric(after, "vllm:num_requests_running") == 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"input": ""}, 400),
        ({"input": []}, 400),
        ({"input": [1, "a"]}, 400),
        ({"input": "x", "dimensions": 0}, 400),
        ({"input": "x", "dimensions": True}, 400),
        ({"input": "x", "encoding_format": "int8"}, 400),
        ({"input": "x", "model": "not-served"}, 404),
        ({}, 400),
    ],
)
async def test_bad_embedding_requests(
    engine: SimInstance, http: aiohttp.ClientSession, body: dict[str, Any], status: int
) -> None:
    async with http.post(engine.url + "/v1/embeddings", json=body) as resp:
        assert resp.status == status
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("engine", [{"max_model_len": 64, "num_gpu_blocks_override": 100}], indirect=True)
async def test_an_input_over_the_context_length_is_a_400(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + "/v1/embeddings", json={"input": list(range(65))}) as resp:
        assert resp.status == 400
        assert "maximum context length" in (await resp.json())["error"]["message"]
    data = await post_json(http, engine.url + "/v1/embeddings", {"input": list(range(64))})
    assert data["usage"]["prompt_tokens"] == 64


def test_vectors_are_deterministic_unit_length_and_seeded() -> None:
    ids = encode("deterministic vectors")
    a, b = http_api.embed(ids, 128), http_api.embed(list(ids), 128)
    assert a.dtype == np.float32 and np.array_equal(a, b)
    assert math.isclose(float(np.linalg.norm(a)), 1.0, rel_tol=1e-6)
    assert not np.array_equal(a, http_api.embed(ids, 128, seed=1))
    empty = http_api.embed([], 8)
    assert math.isclose(float(np.linalg.norm(empty)), 1.0)
