"""The Gemini codec end to end against the stand-in: codec.request → HTTP (API key or bearer) →
stand-in → codec.answer / codec.stream → a chat completion the openai SDK's types accept.

The stand-in runs in-process on a real loopback socket (aiohttp's TestServer), served by the test's
own event loop: no process start, and a stand-in failure shows its traceback here. (google-genai,
a synchronous client, checks it as a process: tests/sim/hosted/test_gemini_standin.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.base import ProviderError, ProviderStreamError, ProviderTarget, ProviderUsage
from backends.hosted.gemini import GeminiCodec, VertexToken, api_key_headers
from sim.hosted.common import StandinConfig
from sim.hosted.gemini import build_app

CODEC = GeminiCodec()
API = ProviderTarget(model="gemini-2.5-flash")
VERTEX = ProviderTarget(model="projects/p1/locations/us-central1/publishers/google/models/gemini-2.5-flash")
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # over the 1024-token implicit-cache minimum
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
    url: str, chat: dict[str, Any], target: ProviderTarget = API, auth: Mapping[str, str] | None = None
) -> tuple[dict[str, Any] | list[dict[str, Any]] | None, ProviderUsage | None, ProviderError | None]:
    call = CODEC.request(chat, target)
    headers = {**dict(call.headers), **(api_key_headers("test-key") if auth is None else auth)}
    async with (
        aiohttp.ClientSession() as http,
        http.request(call.method, url + call.path, headers=headers, data=call.body) as response,
    ):
        if response.status != 200:
            return None, None, CODEC.error(response.status, response.headers, await response.read())
        if not call.stream:
            completion, usage = CODEC.answer(await response.read(), target)
            ChatCompletion.model_validate(completion)
            return completion, usage, None
        decoder = CODEC.stream(target)
        chunks: list[dict[str, Any]] = []
        async for data in response.content.iter_any():
            chunks.extend(decoder.feed(data))
        chunks.extend(decoder.close())
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk)
        return chunks, decoder.usage, None


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_an_answer_and_its_stream_say_the_same_on_both_apis() -> None:
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 50,
    }
    bearer = VertexToken.headers("test-key")
    async with standin() as url:
        completion, usage, error = await send(url, chat)
        chunks, stream_usage, _ = await send(url, {**chat, "stream": True})
        on_vertex, _, vertex_error = await send(url, chat, VERTEX, bearer)
    assert error is None and vertex_error is None
    assert isinstance(completion, dict) and isinstance(chunks, list) and isinstance(on_vertex, dict)
    text = completion["choices"][0]["message"]["content"]
    assert text and _text(chunks) == text and on_vertex["choices"][0]["message"]["content"] == text
    assert usage == stream_usage and usage is not None and usage.output_tokens > 0


async def test_a_tool_call_round_trip() -> None:
    first: dict[str, Any] = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    async with standin() as url:
        completion, _, error = await send(url, first)
        assert error is None and isinstance(completion, dict)
        assert completion["choices"][0]["finish_reason"] == "tool_calls"
        calls = completion["choices"][0]["message"]["tool_calls"]
        assert calls[0]["function"]["name"] == "get_weather"
        assert set(orjson.loads(calls[0]["function"]["arguments"])) == {"city"}
        second = {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"},
            ],
        }
        answer, _, error = await send(url, second)
        chunks, _, _ = await send(url, {**first, "stream": True})
    assert error is None and isinstance(answer, dict)
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["message"]["content"]
    assert isinstance(chunks, list)
    streamed = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert streamed[0]["function"]["name"] == "get_weather"


async def test_the_second_call_reads_the_implicitly_cached_prefix() -> None:
    chat = {
        "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise."}],
        "max_tokens": 20,
    }
    async with standin() as url:
        _, first, _ = await send(url, chat)
        completion, second, _ = await send(url, chat)
    assert first is not None and second is not None and isinstance(completion, dict)
    assert first.cache_read_tokens == 0 and second.cache_read_tokens > 1000
    assert second.input_tokens == first.input_tokens
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == second.cache_read_tokens


async def test_json_schema_output_thinking_and_several_choices() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    chat = {
        "messages": [{"role": "user", "content": "Name?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        "reasoning_effort": "low",
        "n": 2,
    }
    async with standin() as url:
        completion, usage, error = await send(url, chat)
    assert error is None and isinstance(completion, dict) and usage is not None
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    for choice in completion["choices"]:
        assert set(orjson.loads(choice["message"]["content"])) == {"name"}
        assert choice["message"]["reasoning_content"]
    assert usage.reasoning_tokens > 0 and usage.output_tokens > usage.reasoning_tokens


async def test_auth_errors_on_both_apis() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with standin() as url:
        _, _, wrong_key = await send(url, chat, auth=api_key_headers("nope"))
        _, _, no_key = await send(url, chat, auth={})
        _, _, expired = await send(url, chat, VERTEX, VertexToken.headers("expired"))
    assert wrong_key is not None and wrong_key.status == 400 and "API key not valid" in wrong_key.message
    assert no_key is not None and no_key.kind == "permission_error"
    assert expired is not None and expired.kind == "authentication_error" and not expired.retryable


async def test_over_the_rate_limit_is_a_retryable_throttle_with_its_delay() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    async with standin(rpm=1) as url:
        _, _, first = await send(url, chat)
        _, _, second = await send(url, chat)
    assert first is None
    assert second is not None and second.kind == "rate_limit_error" and second.retryable
    assert second.retry_after_s is not None and second.retry_after_s > 0


async def test_a_stream_breaking_off_raises_the_providers_error() -> None:
    async with standin(fail_after_tokens=3) as url:
        with pytest.raises(ProviderStreamError) as raised:
            await send(url, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert raised.value.error.kind == "api_error" and raised.value.error.retryable


async def test_an_overloaded_fault_is_retryable_and_an_unserved_model_is_not_found() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with standin(models=("gemini-2.5-flash",)) as url:
        async with aiohttp.ClientSession() as http, http.post(url + "/standin/faults", json={"status": 503}):
            pass
        _, _, overloaded = await send(url, chat)
        _, _, missing = await send(url, chat, ProviderTarget(model="gemini-0-nope"))
    assert overloaded is not None and (overloaded.kind, overloaded.retryable) == ("overloaded_error", True)
    assert missing is not None and (missing.status, missing.kind, missing.retryable) == (404, "not_found_error", False)


async def test_gemini_3_needs_its_thought_signatures_back_and_gets_them() -> None:
    target = ProviderTarget(model="gemini-3-pro-preview")
    first: dict[str, Any] = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    async with standin() as url:
        completion, _, error = await send(url, first, target)
        assert error is None and isinstance(completion, dict)
        calls = completion["choices"][0]["message"]["tool_calls"]
        follow_up = [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
        signed = {**first, "messages": [*first["messages"], {"role": "assistant", "tool_calls": calls}, *follow_up]}
        answer, _, error = await send(url, signed, target)
        stripped_calls = [{**calls[0], "id": "call_0_0"}]
        stripped = {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "tool_calls": stripped_calls},
                {"role": "tool", "tool_call_id": "call_0_0", "content": "sunny"},
            ],
        }
        _, _, refused = await send(url, stripped, target)
    assert error is None and isinstance(answer, dict) and answer["choices"][0]["message"]["content"]
    assert refused is not None and refused.status == 400 and "thought_signature" in refused.message


async def test_a_shared_long_system_prompt_is_read_from_cache_under_a_new_question() -> None:
    def chat(question: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": question}]}

    async with standin() as url:
        _, first, _ = await send(url, chat("Summarise."))
        _, second, _ = await send(url, chat("List the animals."))
    assert first is not None and second is not None
    assert first.cache_read_tokens == 0 and 1000 < second.cache_read_tokens < second.input_tokens
