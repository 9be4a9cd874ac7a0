"""The Bedrock codec end to end against the stand-in: codec.request → SigV4 → HTTP → stand-in →
codec.answer / codec.stream → a chat completion the openai SDK's types accept.

The stand-in runs in-process on a real loopback socket (aiohttp's TestServer): the client here is
aiohttp on the same event loop, so no process start is needed, and a stand-in failure shows its
traceback in the test. (The official SDK's checks, synchronous clients, run it as a process:
tests/sim/hosted/test_bedrock_standin.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from yarl import URL

from backends.hosted.aws import AwsCredentials, sign
from backends.hosted.base import ProviderError, ProviderStreamError, ProviderTarget, ProviderUsage
from backends.hosted.bedrock import BedrockCodec
from sim.hosted.bedrock import build_app
from sim.hosted.common import StandinConfig

CODEC = BedrockCodec()
TARGET = ProviderTarget(model="anthropic.claude-3-5-haiku-20241022-v1:0")
CREDS = AwsCredentials("AKIDTEST", "test-key")
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # over the 1024-token cache minimum
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@contextlib.asynccontextmanager
async def standin(**options: Any) -> AsyncIterator[str]:
    server = TestServer(build_app(StandinConfig(**options)))
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def send(
    url: str, chat: dict[str, Any], creds: AwsCredentials = CREDS
) -> tuple[dict[str, Any] | list[dict[str, Any]] | None, ProviderUsage | None, ProviderError | None]:
    """(completion or chunks, usage, error) of one translated call."""
    call = sign(CODEC.request(chat, TARGET), url, creds, "us-east-1")
    # encoded=True: the path is sent exactly as signed (the model id's ':' stays %3A)
    target = URL(url + call.path, encoded=True)
    async with (
        aiohttp.ClientSession() as http,
        http.request(call.method, target, headers=dict(call.headers), data=call.body) as response,
    ):
        if response.status != 200:
            return None, None, CODEC.error(response.status, response.headers, await response.read())
        if not call.stream:
            completion, usage = CODEC.answer(await response.read(), TARGET)
            ChatCompletion.model_validate(completion)
            return completion, usage, None
        decoder = CODEC.stream(TARGET)
        chunks: list[dict[str, Any]] = []
        async for data in response.content.iter_any():
            chunks.extend(decoder.feed(data))
        chunks.extend(decoder.close())
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk)
        return chunks, decoder.usage, None


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_a_chat_answer_and_its_stream_say_the_same() -> None:
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 50,
    }
    async with standin() as url:
        completion, usage, error = await send(url, chat)
        chunks, stream_usage, _ = await send(url, {**chat, "stream": True})
    assert error is None and isinstance(completion, dict) and isinstance(chunks, list)
    assert completion["choices"][0]["message"]["content"]
    assert _text(chunks) == completion["choices"][0]["message"]["content"]
    assert usage == stream_usage and usage is not None and usage.output_tokens > 0


async def test_a_tool_call_round_trip() -> None:
    first: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "max_tokens": 200,
    }
    async with standin() as url:
        completion, _, error = await send(url, first)
        assert error is None and isinstance(completion, dict)
        message = completion["choices"][0]["message"]
        assert completion["choices"][0]["finish_reason"] == "tool_calls"
        call = message["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and "city" in call["function"]["arguments"]
        second = {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
            ],
        }
        answer, _, error = await send(url, second)
        chunks, _, _ = await send(url, {**first, "stream": True})
    assert error is None and isinstance(answer, dict)
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["message"]["content"]
    assert isinstance(chunks, list)
    streamed = [
        d["tool_calls"][0] for c in chunks if c["choices"] for d in [c["choices"][0]["delta"]] if "tool_calls" in d
    ]
    assert streamed[0]["function"]["name"] == "get_weather"
    assert "".join(s["function"]["arguments"] for s in streamed) == call["function"]["arguments"]


async def test_the_second_call_reads_the_cached_prefix() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": "Summarise."},
        ],
        "max_tokens": 30,
    }
    async with standin() as url:
        _, first, _ = await send(url, chat)
        completion, second, _ = await send(url, chat)
    assert first is not None and second is not None and isinstance(completion, dict)
    assert first.cache_write_tokens > 0 and first.cache_read_tokens == 0
    assert second.cache_read_tokens == first.cache_write_tokens and second.cache_write_tokens == 0
    assert second.input_tokens == first.input_tokens  # the whole prompt either way
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == second.cache_read_tokens


async def test_json_schema_output_and_thinking_pass_the_stand_ins_checks() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    chat = {
        "messages": [{"role": "user", "content": "Name?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        "reasoning_effort": "low",
        "max_tokens": 4000,
    }
    async with standin() as url:
        completion, usage, error = await send(url, chat)
    assert error is None and isinstance(completion, dict) and usage is not None
    assert set(orjson.loads(completion["choices"][0]["message"]["content"])) == {"name"}
    assert completion["choices"][0]["message"]["reasoning_content"]
    assert usage.reasoning_tokens > 0


async def test_a_wrong_secret_is_an_authentication_error() -> None:
    async with standin() as url:
        _, _, error = await send(
            url, {"messages": [{"role": "user", "content": "hi"}]}, AwsCredentials("AKIDTEST", "nope")
        )
    assert error is not None and error.kind == "authentication_error" and not error.retryable
    assert "InvalidSignatureException" in error.message


async def test_over_the_rate_limit_is_a_retryable_throttle() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    async with standin(rpm=1) as url:
        _, _, first = await send(url, chat)
        _, _, second = await send(url, chat)
    assert first is None
    assert second is not None and second.status == 429 and second.kind == "rate_limit_error" and second.retryable


async def test_a_stream_breaking_off_raises_the_providers_error() -> None:
    async with standin(fail_after_tokens=3) as url:
        with pytest.raises(ProviderStreamError) as raised:
            await send(url, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert raised.value.error.retryable and raised.value.error.status == 502


async def test_a_model_not_ready_fault_is_a_retryable_overload() -> None:
    async with standin() as url:
        async with aiohttp.ClientSession() as http, http.post(url + "/standin/faults", json={"status": 529}):
            pass
        _, _, error = await send(url, {"messages": [{"role": "user", "content": "hi"}]})
    assert error is not None and error.message.startswith("ModelNotReadyException")
    assert (error.status, error.kind, error.retryable) == (503, "overloaded_error", True)


async def test_a_thinking_tool_loop_round_trips_its_signed_thinking_block() -> None:
    first: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "reasoning_effort": "low",
        "max_tokens": 4000,
    }
    async with standin() as url:
        completion, _, error = await send(url, first)
        assert error is None and isinstance(completion, dict)
        message = completion["choices"][0]["message"]
        assert message["reasoning_content"] and message["tool_calls"]
        answers = [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"}]
        echoed = {**first, "messages": [*first["messages"], message, *answers]}
        answer, _, error = await send(url, echoed)
        chunks, _, _ = await send(url, {**first, "stream": True})
        assert isinstance(chunks, list)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        streamed: dict[str, Any] = {
            "role": "assistant",
            "reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas),
            "tool_calls": [
                {
                    "id": next(d["tool_calls"][0]["id"] for d in deltas if "tool_calls" in d),
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": "".join(
                            d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d
                        ),
                    },
                }
            ],
        }
        answers = [{"role": "tool", "tool_call_id": streamed["tool_calls"][0]["id"], "content": "sunny"}]
        from_stream, _, stream_error = await send(url, {**first, "messages": [*first["messages"], streamed, *answers]})
    assert error is None and isinstance(answer, dict) and answer["choices"][0]["message"]["content"]
    assert stream_error is None and isinstance(from_stream, dict)
