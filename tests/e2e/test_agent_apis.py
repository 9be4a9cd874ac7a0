"""Responses, Anthropic Messages and models/{id} through a real gateway, with the official clients.

Two public models share one simulated engine: `native` is a vLLM-kind pool (the engine serves
/v1/responses and /v1/messages itself: pass-through) and `chat` an OpenAI-compatible remote pool
(the gateway translates to and from chat completions). Every scenario runs on both.
"""
# mypy: disable-error-code="arg-type, call-overload, misc, list-item, index"
# (the SDKs' TypedDict parameters are passed plain dicts here on purpose: what a user's code sends)

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from policies.policy import hash_key
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    http_get,
    running,
    start_gateway,
    start_sim,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENGINE_MODEL = "llama-3.1-8b"
LIMITED_KEY = "sk-limited-0000"
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


class Verdict(pydantic.BaseModel):
    title: str
    score: int
    tags: list[str]


def policies() -> dict[str, Any]:
    return {
        "tenants": {"t1": {}, "t2": {}, "slow": {"allow_fallback": False}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "slow", "sha256": hash_key(LIMITED_KEY)},
        ],
        "models": {"native": {"context_length": 16384}, "chat": {"context_length": 16384}},
        "limits": [{"scope": "key", "match": {"key": "k3"}, "rpm": 1}],
    }


def pools(url: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "native",
            "model": "native",
            "engine": "vllm",
            "served_model_name": ENGINE_MODEL,
            "endpoints": [{"url": url}],
        },
        {
            "name": "chat",
            "model": "chat",
            "engine": "openai",
            "served_model_name": ENGINE_MODEL,
            "endpoints": [{"url": url}],
        },
    ]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngines]:
    sim = start_sim(tmp_path_factory.mktemp("apis-engine"), served_model_name=ENGINE_MODEL, time_scale=50.0)
    with running(sim):
        yield sim


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, engine: SimEngines) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("apis-gw"), pools=pools(engine.urls[0]), policies=policies())
    with running(gw):
        yield gw


class RedisStopper:  # `running` stops what it is given
    def __init__(self, server: RedisProcess) -> None:
        self.server = server

    def stop(self) -> None:
        self.server.kill()


def _openai(gw: Gateway, key: str = TEST_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def _anthropic(gw: Gateway, key: str = TEST_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


@pytest.mark.parametrize("model", ["native", "chat"])
def test_responses_create_stream_parse(gateway: Gateway, model: str) -> None:
    client = _openai(gateway)
    raw = client.responses.with_raw_response.create(model=model, input="Hello", instructions="Be brief")
    first = raw.parse()
    assert raw.headers["x-tokenway-model"] == model and raw.headers["x-request-id"]
    assert first.model == model and first.output_text and first.usage is not None and first.usage.output_tokens > 0

    with client.responses.stream(model=model, input="Stream please", max_output_tokens=4000) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.usage is not None and final.model == model

    parsed = client.responses.parse(model=model, input="judge it", text_format=Verdict)
    assert isinstance(parsed.output_parsed, Verdict)

    chat = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "judge"}], response_format=Verdict
    )
    assert isinstance(chat.choices[0].message.parsed, Verdict)


@pytest.mark.parametrize("model", ["native", "chat"])
def test_tool_round_trip_with_previous_response_id(gateway: Gateway, model: str) -> None:
    client = _openai(gateway)
    call = client.responses.create(model=model, input="define cat", tools=[TOOL], tool_choice="required")
    item = next(i for i in call.output if i.type == "function_call")
    jsonschema.validate(json.loads(item.arguments), TOOL["parameters"])
    follow = client.responses.create(
        model=model,
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "a small animal"}],
        tools=[TOOL],
    )
    assert follow.previous_response_id == call.id and follow.output_text
    assert follow.usage is not None and call.usage is not None and follow.usage.input_tokens > call.usage.input_tokens
    assert client.responses.retrieve(call.id).id == call.id

    other = _openai(gateway, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=model, previous_response_id=call.id, input="steal it")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(call.id)
    client.responses.delete(call.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(call.id)


@pytest.mark.parametrize(
    "bad_input",
    [
        pytest.param([{"type": "computer_call"}], id="unknown-item"),
        pytest.param([{"role": "user", "content": [{"type": "input_audio"}]}], id="unknown-part"),
        pytest.param([{"type": "function_call", "call_id": 3}], id="malformed-call"),
        pytest.param(7, id="not-a-list"),
    ],
)
def test_responses_bad_input_is_a_400(gateway: Gateway, bad_input: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _openai(gateway).responses.create(model="native", input=bad_input)
    assert info.value.response.headers.get("x-request-id")


@pytest.mark.parametrize("model", ["native", "chat"])
def test_messages_create_stream_tools_count(gateway: Gateway, model: str) -> None:
    client = _anthropic(gateway)
    raw = client.messages.with_raw_response.create(
        model=model, max_tokens=30, system="terse", messages=[{"role": "user", "content": "Hi"}]
    )
    message = raw.parse()
    assert message.model == model and message.content[0].type == "text"
    assert (
        raw.headers.get("anthropic-ratelimit-requests-limit") is None
        or raw.headers["anthropic-ratelimit-requests-limit"]
    )

    with client.messages.stream(model=model, max_tokens=40, messages=[{"role": "user", "content": "Go"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.output_tokens > 0

    tools = [{"name": "lookup", "description": "d", "input_schema": TOOL["parameters"]}]
    tooled = client.messages.create(
        model=model,
        max_tokens=100,
        tools=tools,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "look up cat"}],
    )
    use = next(b for b in tooled.content if b.type == "tool_use")
    jsonschema.validate(use.input, TOOL["parameters"])
    reply = client.messages.create(
        model=model,
        max_tokens=30,
        tools=tools,
        messages=[
            {"role": "user", "content": "look up cat"},
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "an animal"}]},
        ],
    )
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens")

    count = client.messages.count_tokens(model=model, system="terse", messages=[{"role": "user", "content": "Hi"}])
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_errors(gateway: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        _anthropic(gateway, "sk-wrong").messages.create(
            model="native", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    limited = _anthropic(gateway, LIMITED_KEY)
    limited.messages.create(model="native", max_tokens=5, messages=[{"role": "user", "content": "once"}])
    with pytest.raises(anthropic.RateLimitError) as limit:
        limited.messages.create(model="native", max_tokens=5, messages=[{"role": "user", "content": "twice"}])
    headers = limit.value.response.headers
    assert float(headers["retry-after"]) > 0 and headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert limit.value.body["error"]["type"] == "rate_limit_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        _anthropic(gateway).messages.create(
            model="native", max_tokens=5, messages=[{"role": "user", "content": [{"type": "video"}]}]
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_models_retrieve_and_unknown_routes(gateway: Gateway) -> None:
    client = _openai(gateway)
    assert client.models.retrieve("native").id == "native"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-nope")
    assert missing.value.code == "model_not_found"
    status, body = http_get(gateway.url + "/v1/nowhere", headers={"Authorization": f"Bearer {TEST_KEY}"})
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = http_get(gateway.url + "/v1/chat/completions")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    status, body = http_get(gateway.url + "/v1/messages/nowhere")
    assert status == 404 and json.loads(body)["type"] == "error"


def test_previous_response_id_across_replicas_sharing_redis(tmp_path: Path, engine: SimEngines) -> None:
    own_redis = RedisProcess()
    own_redis.start()
    with running(RedisStopper(own_redis)):
        state = {"backend": "redis", "redis_url": own_redis.url}
        first = start_gateway(tmp_path / "a", pools=pools(engine.urls[0]), policies=policies(), state=state)
        second = start_gateway(tmp_path / "b", pools=pools(engine.urls[0]), policies=policies(), state=state)
        with running(first, second):
            call = _openai(first).responses.create(
                model="native", input="define cat", tools=[TOOL], tool_choice="required"
            )
            item = next(i for i in call.output if i.type == "function_call")
            follow = _openai(second).responses.create(
                model="chat",
                previous_response_id=call.id,
                input=[{"type": "function_call_output", "call_id": item.call_id, "output": "an animal"}],
            )
            assert follow.previous_response_id == call.id and follow.output_text
            with pytest.raises(openai.NotFoundError):
                _openai(second, OTHER_KEY).responses.retrieve(call.id)


@pytest.mark.parametrize("model", ["native", "chat"])
def test_langchain_chat_openai_on_the_responses_api(gateway: Gateway, model: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=model, base_url=gateway.base_url, api_key=TEST_KEY, use_responses_api=True, max_retries=0
    )
    reply = llm.invoke("Say hello")
    assert reply.text and reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0
