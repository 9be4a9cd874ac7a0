"""vLLM's sleep mode on the simulated engine, over a real socket: routes, refusals, modes, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from backends.perf import roofline
from backends.perf.presets import resolve_preset
from sim.server import SimInstance, run_sim_engines
from tests.sim.conftest import chat_body, metric, post_json, scrape

PRESET = "llama-3.1-8b@h100"


@pytest.fixture
async def sleepy(request: pytest.FixtureRequest) -> AsyncIterator[SimInstance]:
    """An engine with sleep mode and the development routes, at time scale 20 unless overridden."""
    options: dict[str, Any] = {
        "time_scale": 20.0,
        "enable_sleep_mode": True,
        "server_dev_mode": True,
        **getattr(request, "param", {}),
    }
    async with run_sim_engines(PRESET, 1, **options) as instances:
        yield instances[0]


async def _is_sleeping(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/is_sleeping") as resp:
        assert resp.status == 200
        return bool((await resp.json())["is_sleeping"])


async def _post(http: aiohttp.ClientSession, url: str, params: dict[str, str] | None = None) -> int:
    async with http.post(url, params=params) as resp:
        await resp.read()
        return resp.status


def _sleep_states(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {
        state: metric(samples, "vllm:engine_sleep_state", sleep_state=state)
        for state in ("awake", "weights_offloaded", "discard_all")
    }


async def _first_chunks(resp: aiohttp.ClientResponse, count: int) -> bytes:
    """Read until `count` SSE events have arrived (the role chunk counts as one)."""
    raw = b""
    while raw.count(b"\n\n") < count:
        raw += await resp.content.readany()
    return raw


def _events(raw: bytes) -> list[dict[str, Any]]:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


@pytest.mark.parametrize(
    ("enable_sleep_mode", "server_dev_mode"), [(True, False), (False, True)], ids=["no-dev-mode", "no-sleep-mode"]
)
async def test_routes_need_dev_mode_and_sleep_mode(
    http: aiohttp.ClientSession, enable_sleep_mode: bool, server_dev_mode: bool
) -> None:
    options = {"enable_sleep_mode": enable_sleep_mode, "server_dev_mode": server_dev_mode, "time_scale": 20.0}
    async with run_sim_engines(PRESET, 1, **options) as (instance,):
        assert await _post(http, instance.url + "/sleep") == 404
        assert await _post(http, instance.url + "/wake_up") == 404
        async with http.get(instance.url + "/is_sleeping") as resp:
            assert resp.status == 404
        states = _sleep_states(await scrape(http, instance.url))
        assert states == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        samples = await scrape(http, instance.url)
        assert not any(name.startswith("vllm:sleep_mode_operation") for name, _ in samples)


def test_dev_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from sim.config import build_engine_config

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert build_engine_config(PRESET).server_dev_mode
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not build_engine_config(PRESET).server_dev_mode


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.slow
async def test_sleep_refuses_generation_until_woken(
    sleepy: SimInstance, http: aiohttp.ClientSession, level: int
) -> None:
    url = sleepy.url
    assert not await _is_sleeping(http, url)
    assert await _post(http, url + "/sleep", {"level": str(level)}) == 200
    assert await _is_sleeping(http, url)
    states = _sleep_states(await scrape(http, url))
    assert states == {"awake": 0.0, "weights_offloaded": float(level == 1), "discard_all": float(level == 2)}

    async with http.post(url + "/v1/chat/completions", json=chat_body("hello")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "ModelSleepingError"
    async with http.post(url + "/v1/embeddings", json={"input": "hello"}) as resp:
        assert resp.status == 503
    async with http.post(url + "/v1/responses", json={"input": "hello"}) as resp:
        assert resp.status == 503
    async with http.post(url + "/tokenize", json={"prompt": "hello"}) as resp:
        assert resp.status == 200
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    assert await _post(http, url + "/sleep", {"level": "1"}) == 200  # already asleep: a no-op

    assert await _post(http, url + "/wake_up") == 200
    assert not await _is_sleeping(http, url)
    data = await post_json(http, url + "/v1/chat/completions", chat_body("hello", max_tokens=4))
    assert data["usage"]["completion_tokens"] == 4

    # each operation's simulated duration: the weights over PCIe (level 1) or reloaded (level 2)
    samples = await scrape(http, url)
    preset = resolve_preset(PRESET)
    name = "vllm:sleep_mode_operation_duration_seconds_sum"
    assert metric(samples, name, operation="sleep") == pytest.approx(roofline.sleep_s(preset, level))
    assert metric(samples, name, operation="wake") == pytest.approx(roofline.wake_s(preset, level))
    assert _sleep_states(samples)["awake"] == 1.0


async def test_bad_level_mode_or_tag_is_a_400(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    for params in ({"level": "3"}, {"level": "one"}, {"mode": "later"}):
        async with http.post(sleepy.url + "/sleep", params=params) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "BadRequestError"
    assert await _post(http, sleepy.url + "/wake_up", {"tags": "gpu"}) == 400
    assert not await _is_sleeping(http, sleepy.url)


async def test_wake_up_by_tags(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    url = sleepy.url
    assert await _post(http, url + "/sleep") == 200
    assert await _post(http, url + "/wake_up", {"tags": "weights"}) == 200
    assert await _is_sleeping(http, url)  # the KV cache is still away
    async with http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
        assert resp.status == 503
    assert await _post(http, url + "/wake_up", {"tags": "kv_cache"}) == 200
    assert not await _is_sleeping(http, url)


async def test_abort_mode_ends_running_streams(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    url = sleepy.url
    body = chat_body("a long story", max_tokens=4000, stream=True)
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await _first_chunks(resp, 3)  # the role chunk and two tokens: it is decoding
        assert await _post(http, url + "/sleep", {"level": "1"}) == 200
        raw += await resp.read()
    chunks = _events(raw)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    samples = await scrape(http, url)
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") == 1


async def test_wait_mode_lets_requests_finish(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    url = sleepy.url
    body = chat_body("a story", max_tokens=200, stream=True, stream_options={"include_usage": True})
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await _first_chunks(resp, 3)
        sleeping = asyncio.ensure_future(_post(http, url + "/sleep", {"level": "1", "mode": "wait"}))
        raw += await resp.read()
    assert await sleeping == 200
    chunks = _events(raw)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert await _is_sleeping(http, url)


@pytest.mark.slow
async def test_keep_mode_resumes_requests_after_the_wake_up(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    url = sleepy.url
    plain = await post_json(http, url + "/v1/chat/completions", chat_body("a tale", max_tokens=300))
    body = chat_body("a tale", max_tokens=300, stream=True)
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await _first_chunks(resp, 3)
        assert await _post(http, url + "/sleep", {"level": "1", "mode": "keep"}) == 200
        assert await _is_sleeping(http, url)
        samples = await scrape(http, url)
        assert metric(samples, "vllm:num_requests_waiting") == 1  # held, its KV dropped
        assert metric(samples, "vllm:kv_cache_usage_perc") == 0
        assert await _post(http, url + "/wake_up") == 200
        raw += await resp.read()
    chunks = _events(raw)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["metrics"]["preemptions"] == 1  # recomputed after the wake-up


async def test_sleep_drops_the_prefix_cache(sleepy: SimInstance, http: aiohttp.ClientSession) -> None:
    url = sleepy.url
    prompt = "shared context " * 200
    await post_json(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    again = await post_json(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert await _post(http, url + "/sleep", {"level": "1"}) == 200
    assert await _post(http, url + "/wake_up") == 200
    after = await post_json(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
