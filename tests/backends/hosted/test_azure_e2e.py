"""The Azure OpenAI codec end to end against its stand-in (deployments and v1), checked by the openai types."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.azure_openai import AzureOpenAICodec
from backends.hosted.base import ProviderTarget
from tests.sim.hosted.standin import Exchange, StandIn, exchange, standin

pytestmark = pytest.mark.e2e  # each test starts a stand-in process

CODEC = AzureOpenAICodec()
AUTH = {"api-key": "test-key"}
TARGET = ProviderTarget(model="gpt-4o-prod")
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    }
]


@pytest.fixture(scope="module")
def running() -> Iterator[StandIn]:
    with standin("azure", "--models", "gpt-4o-prod") as stand_in:
        yield stand_in


async def send(
    url: str, chat: dict[str, Any], target: ProviderTarget = TARGET, auth: dict[str, str] = AUTH
) -> Exchange:
    return await exchange(url, CODEC, chat, target, auth)


async def test_answer_on_both_paths(running: StandIn) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10}
    for target, auth in (
        (TARGET, AUTH),
        (ProviderTarget(model="gpt-4o-prod", api_version="v1"), {"authorization": "Bearer test-key"}),
    ):
        result = await send(running.url, chat, target, auth)
        assert result.status == 200 and result.completion is not None, result.error
        parsed = ChatCompletion.model_validate(result.completion)
        assert parsed.choices[0].message.content and "prompt_filter_results" not in result.completion
        assert result.usage is not None and result.usage.input_tokens > 0
        assert CODEC.rate_limits(result.headers).requests_remaining is not None


async def test_stream_tools_and_usage(running: StandIn) -> None:
    result = await send(
        running.url, {"messages": [{"role": "user", "content": "Find"}], "tools": TOOLS, "stream": True}
    )
    assert result.status == 200 and result.error is None
    for chunk in result.chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in result.chunks if c["choices"]]
    arguments = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or ())
    assert "q" in orjson.loads(arguments)
    assert result.chunks[-1]["usage"] and result.usage is not None and result.usage.output_tokens > 0


async def test_cache_marks_stripped_and_cache_read(running: StandIn) -> None:
    system = f"[{uuid.uuid4().hex}] " + "Answer in plain short words. " * 180
    marked = {"role": "system", "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
    first = await send(running.url, {"messages": [marked, {"role": "user", "content": "One"}]})
    second = await send(running.url, {"messages": [marked, {"role": "user", "content": "Two"}]})
    assert first.status == second.status == 200
    assert first.usage is not None and second.usage is not None and first.usage.cache_read_tokens == 0
    assert second.usage.cache_read_tokens >= 1024 and second.usage.cache_write_tokens == 0
    assert second.completion is not None
    assert second.completion["usage"]["prompt_tokens_details"]["cached_tokens"] == second.usage.cache_read_tokens


async def test_errors(running: StandIn) -> None:
    hello: Any = {"messages": [{"role": "user", "content": "Hi"}]}
    denied = await send(running.url, hello, auth={"api-key": "wrong"})
    assert denied.error is not None and denied.error.status == 401 and denied.error.kind == "authentication_error"
    missing = await send(running.url, hello, ProviderTarget(model="other"))
    assert (
        missing.error is not None and missing.error.kind == "not_found_error" and "deployment" in missing.error.message
    )
    running.fault(429)
    limited = await send(running.url, hello)
    assert limited.error is not None and limited.error.retryable and limited.error.retry_after_s == 1.0


async def test_mid_stream_error() -> None:
    with standin("azure", "--fail-after-tokens", "2") as broken:
        result = await send(broken.url, {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert result.status == 200 and result.error is not None and result.error.status == 500 and result.error.retryable
