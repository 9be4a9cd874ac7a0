"""The Anthropic codec end to end against its stand-in: codec.request → HTTP → stand-in → chat completions.

Every answer must be one the `openai` SDK's own types accept (ChatCompletion / ChatCompletionChunk).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.anthropic import AnthropicCodec
from backends.hosted.base import ProviderTarget
from tests.sim.hosted.standin import Exchange, StandIn, exchange, standin

pytestmark = pytest.mark.e2e  # each test starts a stand-in process

CODEC = AnthropicCodec()
AUTH = {"x-api-key": "test-key"}
TARGET = ProviderTarget(model="claude-sonnet-4-5")
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def running() -> Iterator[StandIn]:
    with standin("anthropic") as stand_in:
        yield stand_in


async def send(url: str, chat: dict[str, Any], target: ProviderTarget = TARGET) -> Exchange:
    return await exchange(url, CODEC, chat, target, AUTH)


def assembled(chunks: list[dict[str, Any]]) -> tuple[str, str, list[str]]:
    """(text, tool-call arguments, finish reasons) of a chunk stream, each chunk checked by the SDK's type."""
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    arguments = "".join(
        t["function"].get("arguments") or "" for d in deltas for t in d["delta"].get("tool_calls") or ()
    )
    return text, arguments, [d["finish_reason"] for d in deltas if d["finish_reason"]]


async def test_chat_answer(running: StandIn) -> None:
    result = await send(
        running.url,
        {"messages": [{"role": "system", "content": "Brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 20},
    )
    assert result.status == 200 and result.completion is not None and result.usage is not None
    parsed = ChatCompletion.model_validate(result.completion)
    assert parsed.choices[0].message.content and parsed.choices[0].finish_reason in ("stop", "length")
    assert parsed.usage is not None and parsed.usage.prompt_tokens == result.usage.input_tokens > 0
    limits = CODEC.rate_limits(result.headers)
    assert limits.requests_remaining is not None and limits.reset_s is not None and limits.reset_s >= 0


async def test_tool_round_trip(running: StandIn) -> None:
    question: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await send(running.url, {"messages": question, "tools": TOOLS, "max_tokens": 50})
    assert first.completion is not None
    parsed = ChatCompletion.model_validate(first.completion)
    calls: Any = parsed.choices[0].message.tool_calls
    assert parsed.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert "city" in orjson.loads(calls[0].function.arguments)
    follow = [
        *question,
        first.completion["choices"][0]["message"],
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny"},
    ]
    second = await send(running.url, {"messages": follow, "tools": TOOLS, "max_tokens": 50})
    assert second.status == 200 and second.completion is not None
    assert ChatCompletion.model_validate(second.completion).choices[0].message.content


async def test_streamed_text_and_tool_call(running: StandIn) -> None:
    text_run = await send(
        running.url, {"messages": [{"role": "user", "content": "Stream"}], "max_tokens": 12, "stream": True}
    )
    text, _, finish = assembled(text_run.chunks)
    assert text and finish in (["stop"], ["length"]) and text_run.chunks[-1]["usage"]["completion_tokens"] > 0
    assert text_run.usage is not None and text_run.usage.output_tokens == len(text.split(" "))
    chat = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "stream": True,
    }
    tool_run = await send(running.url, chat)
    _, arguments, finish = assembled(tool_run.chunks)
    assert finish == ["tool_calls"] and "city" in orjson.loads(arguments)


async def test_cache_read_on_second_call(running: StandIn) -> None:
    system = {
        "role": "system",
        "content": [{"type": "text", "text": f"[{uuid.uuid4().hex}] " + "Be careful and brief. " * 250}],
        "cache_control": {"type": "ephemeral"},
    }
    first = await send(running.url, {"messages": [system, {"role": "user", "content": "One"}], "max_tokens": 5})
    second = await send(
        running.url, {"messages": [system, {"role": "user", "content": "Two"}], "max_tokens": 5, "stream": True}
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.cache_write_tokens >= 1024 and first.usage.cache_read_tokens == 0
    assert second.usage.cache_read_tokens == first.usage.cache_write_tokens
    assert second.usage.input_tokens > second.usage.cache_read_tokens
    assert second.chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == second.usage.cache_read_tokens


async def test_reasoning_effort_and_structured_output(running: StandIn) -> None:
    thought = await send(
        running.url, {"messages": [{"role": "user", "content": "Think"}], "reasoning_effort": "low", "max_tokens": 2000}
    )
    assert thought.status == 200 and thought.completion is not None and thought.usage is not None
    assert thought.completion["choices"][0]["message"]["reasoning_content"]
    assert 0 < thought.usage.reasoning_tokens < thought.usage.output_tokens
    ChatCompletion.model_validate(thought.completion)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema}}
    shaped = await send(running.url, {"messages": [{"role": "user", "content": "Plan"}], "response_format": fmt})
    assert shaped.completion is not None
    assert set(orjson.loads(shaped.completion["choices"][0]["message"]["content"])) == {"city", "days"}


async def test_images_and_new_api_version(running: StandIn) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}
    result = await send(
        running.url, chat, ProviderTarget(model="m", api_version="2026-10-21", beta=("extended-cache-ttl-2025-04-11",))
    )
    assert result.status == 200 and result.completion is not None
    ChatCompletion.model_validate(result.completion)


async def test_provider_errors(running: StandIn) -> None:
    hello: Any = {"messages": [{"role": "user", "content": "Hi"}]}
    denied = await exchange(running.url, CODEC, hello, TARGET, {"x-api-key": "wrong"})
    assert denied.error is not None and (denied.error.status, denied.error.kind) == (401, "authentication_error")
    assert not denied.error.retryable
    running.fault(529)
    overloaded = await send(running.url, hello)
    assert overloaded.error is not None and overloaded.error.status == 503 and overloaded.error.retryable
    unknown_beta = await send(running.url, hello, ProviderTarget(model="m", beta=("no-such-beta",)))
    assert unknown_beta.error is not None and unknown_beta.error.kind == "invalid_request_error"


async def test_rate_limit_and_mid_stream_error() -> None:
    hello: Any = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30}
    with standin("anthropic", "--rpm", "1", "--fail-after-tokens", "3") as limited:
        broken = await send(limited.url, {**hello, "stream": True})
        assert broken.status == 200 and broken.error is not None
        assert broken.error.kind == "overloaded_error" and broken.error.retryable
        refused = await send(limited.url, hello)
        assert refused.error is not None and refused.error.status == 429 and refused.error.retryable
        assert refused.error.retry_after_s is not None and refused.error.retry_after_s >= 1
        assert CODEC.rate_limits(refused.headers).requests_remaining == 0
