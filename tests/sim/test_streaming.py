"""Streams written by the engine loop: the same tokens as a plain response, at any speed."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from backends.tokenization import encode
from sim.server import run_sim_instances
from tests.sim.conftest import chat_body, metric, post_json, scrape


def _events(raw: bytes) -> list[Any]:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


@pytest.mark.parametrize("time_scale", [20.0, 2000.0])  # 2000: every step is overdue, tokens go out in bursts
async def test_streamed_text_equals_the_plain_answer(http: aiohttp.ClientSession, time_scale: float) -> None:
    async with run_sim_instances(time_scale=time_scale) as (url,):
        plain = await post_json(http, url + "/v1/chat/completions", chat_body("tell me more", max_tokens=120))
        body = chat_body("tell me more", max_tokens=120, stream=True, stream_options={"include_usage": True})
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            chunks = _events(await resp.read())
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == plain["choices"][0]["message"]["content"]
        assert chunks[-1]["usage"]["completion_tokens"] == 120

        completion = {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}
        plain_text = (await post_json(http, url + "/v1/completions", completion))["choices"][0]["text"]
        # HTTP/1.0: not chunked, raw SSE bytes (the body has no end but the socket's: read to [DONE])
        async with (
            aiohttp.ClientSession(version=aiohttp.HttpVersion10) as http10,
            http10.post(url + "/v1/completions", json={**completion, "stream": True}) as resp,
        ):
            assert "Transfer-Encoding" not in resp.headers
            raw = b""
            async for data in resp.content.iter_any():
                raw += data
                if raw.endswith(b"data: [DONE]\n\n"):
                    break
            chunks = _events(raw)
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain_text
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"

        samples = await scrape(http, url)
        assert metric(samples, "vllm:generation_tokens_total") == 2 * 120 + 2 * 50
        assert metric(samples, "vllm:inter_token_latency_seconds_count") == 2 * 119 + 2 * 49


@pytest.mark.slow
async def test_many_concurrent_streams_through_the_openai_client() -> None:
    async with run_sim_instances(time_scale=50.0, count=2) as urls:
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="x", max_retries=0) for u in urls]

        async def one(i: int) -> int:
            stream = await clients[i % 2].chat.completions.create(
                model="meta-llama/Llama-3.1-8B",
                messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=40,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return len("".join(pieces).split())

        words = await asyncio.gather(*(one(i) for i in range(64)))
        for client in clients:
            await client.close()
    assert all(w >= 30 for w in words)


@pytest.mark.slow
async def test_a_client_that_stops_reading_still_gets_every_token(http: aiohttp.ClientSession) -> None:
    async with run_sim_instances(time_scale=5000.0, max_model_len=32768) as (url,):
        body = chat_body("slow reader", max_tokens=20000, stream=True)
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")  # the role chunk
            await asyncio.sleep(1.0)  # the engine generates all of it meanwhile
            chunks = _events(await resp.read())
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(encode(text)) == 20000
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
