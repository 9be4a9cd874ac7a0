"""The cost in the answer's usage (`show_cost`), streamed or not, on every API, read with the official
clients: a tenant whose policy shows it finds `cost_usd` beside the token counts (the final usage
chunk, `response.completed`, `message_delta`), the same figure as `x-tokenway-cost-usd` and the
ledger; a tenant without it gets bodies exactly the API's own.

Two public models share one simulated engine: `native` is a vLLM-kind pool (the engine serves
/v1/responses and /v1/messages itself) and `chat` an OpenAI-compatible remote pool (the gateway
translates), as in test_agent_apis.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines, running, start_gateway, start_sim

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENGINE_MODEL = "llama-3.1-8b"
PRICE = {"input_per_mtok": 100.0, "output_per_mtok": 300.0}
MODELS = ["native", "chat"]


def policies() -> dict[str, Any]:
    return {
        "tenants": {"shown": {"show_cost": True}, "plain": {}},
        "keys": [
            {"id": "k1", "tenant": "shown", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "plain", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {name: {"context_length": 16384, "price": PRICE} for name in MODELS},
    }


def pools(url: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "model": name, "engine": engine, "served_model_name": ENGINE_MODEL, "endpoints": [{"url": url}]}
        for name, engine in (("native", "vllm"), ("chat", "openai"))
    ]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    sim: SimEngines = start_sim(tmp_path_factory.mktemp("cost-engine"), served_model_name=ENGINE_MODEL, time_scale=50.0)
    with running(sim):
        gw = start_gateway(tmp_path_factory.mktemp("cost-gw"), pools=pools(sim.urls[0]), policies=policies())
        with running(gw):
            yield gw


def priced(prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * PRICE["input_per_mtok"] + completion_tokens * PRICE["output_per_mtok"]) / 1e6


def ledger_cost(gw: Gateway, request_id: str) -> float | None:
    for path in sorted(Path(gw.workdir, "var", "usage").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                return float(entry["cost_usd"])
    return None


def _openai(gw: Gateway, key: str = TEST_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def _anthropic(gw: Gateway, key: str = TEST_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


@pytest.mark.parametrize("model", MODELS)
def test_chat_stream_carries_the_cost_in_its_usage_chunk_and_the_ledger_agrees(gateway: Gateway, model: str) -> None:
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    cost = (usage.model_extra or {})["cost_usd"]
    assert cost == pytest.approx(priced(usage.prompt_tokens, usage.completion_tokens), abs=1e-9)
    assert wait_for(lambda: ledger_cost(gateway, raw.headers["x-request-id"]), timeout_s=10) == pytest.approx(
        cost, abs=1e-9
    )


@pytest.mark.parametrize("model", MODELS)
def test_a_non_streamed_body_carries_the_headers_figure(gateway: Gateway, model: str) -> None:
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
    )
    usage = raw.parse().usage
    assert usage is not None
    assert (usage.model_extra or {})["cost_usd"] == pytest.approx(float(raw.headers["x-tokenway-cost-usd"]), abs=1e-9)


@pytest.mark.parametrize("model", MODELS)
def test_a_tenant_without_show_cost_gets_the_apis_own_bodies(gateway: Gateway, model: str) -> None:
    client = _openai(gateway, OTHER_KEY)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    assert raw.headers["x-tokenway-cost-usd"]  # the header stays on for everyone
    assert "cost_usd" not in json.loads(raw.http_response.text)["usage"]
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and "cost_usd" not in (chunks[-1].usage.model_extra or {})
    final = client.responses.create(model=model, input="Hi", max_output_tokens=16)
    assert final.usage is not None and "cost_usd" not in (final.usage.model_extra or {})
    events = list(
        _anthropic(gateway, OTHER_KEY).messages.create(
            model=model, max_tokens=16, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    delta = next(e for e in events if e.type == "message_delta")
    assert "cost_usd" not in (delta.usage.model_extra or {})


@pytest.mark.parametrize("model", MODELS)
def test_responses_completed_carries_the_cost(gateway: Gateway, model: str) -> None:
    client = _openai(gateway)
    with client.responses.stream(model=model, input="Stream please", max_output_tokens=4000) as stream:
        final = stream.get_final_response()
    assert final.usage is not None
    cost = (final.usage.model_extra or {})["cost_usd"]
    assert cost == pytest.approx(priced(final.usage.input_tokens, final.usage.output_tokens), abs=1e-9)
    raw = client.responses.with_raw_response.create(model=model, input="Hello", max_output_tokens=16)
    unary = raw.parse().usage
    assert unary is not None
    assert (unary.model_extra or {})["cost_usd"] == pytest.approx(float(raw.headers["x-tokenway-cost-usd"]), abs=1e-9)


@pytest.mark.parametrize("model", MODELS)
def test_messages_delta_carries_the_cost(gateway: Gateway, model: str) -> None:
    client = _anthropic(gateway)
    events = list(
        client.messages.create(
            model=model, max_tokens=32, messages=[{"role": "user", "content": "Say hello"}], stream=True
        )
    )
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    prompt = start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0)
    cost = (delta.usage.model_extra or {})["cost_usd"]
    assert cost == pytest.approx(priced(prompt, delta.usage.output_tokens), abs=1e-9)
    raw = client.messages.with_raw_response.create(
        model=model, max_tokens=16, messages=[{"role": "user", "content": "Hello"}]
    )
    usage = raw.parse().usage
    assert (usage.model_extra or {})["cost_usd"] == pytest.approx(float(raw.headers["x-tokenway-cost-usd"]), abs=1e-9)
