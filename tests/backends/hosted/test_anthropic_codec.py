"""The Anthropic codec on its own: what it sends, what it refuses, how it reads answers, streams and errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.anthropic import DEFAULT_MAX_TOKENS, AnthropicCodec
from backends.hosted.base import ProviderStreamError, ProviderTarget, Untranslatable

CODEC = AnthropicCodec()
TARGET = ProviderTarget(model="claude-sonnet-4-5")


def sent(chat: dict[str, Any], target: ProviderTarget = TARGET) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(CODEC.request(chat, target).body)
    return body


def test_messages_system_images_and_cache_marks() -> None:
    mark = {"type": "ephemeral", "ttl": "1h"}
    body = sent(
        {
            "model": "alias",
            "messages": [
                {"role": "system", "content": "Be brief.", "cache_control": mark},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                    ],
                },
                {"role": "developer", "content": "Late rule."},
            ],
        }
    )
    assert body["model"] == "claude-sonnet-4-5" and body["max_tokens"] == DEFAULT_MAX_TOKENS
    assert body["system"] == [
        {"type": "text", "text": "Be brief.", "cache_control": mark},
        {"type": "text", "text": "Late rule."},
    ]
    blocks = body["messages"][0]["content"]
    assert blocks[0] == {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}}
    assert blocks[1]["source"] == {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    assert blocks[2]["source"] == {"type": "url", "url": "https://example.com/cat.jpg"}


def test_tools_tool_calls_and_results() -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city":"Oslo"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city":"Rome"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Cold"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "Warm"}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "w", "description": "weather", "parameters": {"type": "object"}},
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_completion_tokens": 300,
        "stop": "END",
        "user": "u-1",
    }
    body = sent(chat)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"][1] == {"type": "tool_use", "id": "c2", "name": "w", "input": {"city": "Rome"}}
    results = body["messages"][2]["content"]
    assert results[0] == {"type": "tool_result", "tool_use_id": "c1", "content": "Cold"}
    assert results[1] == {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "Warm"}]}
    tool = body["tools"][0]
    assert tool == {
        "name": "w",
        "input_schema": {"type": "object"},
        "description": "weather",
        "cache_control": {"type": "ephemeral"},
    }
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["max_tokens"] == 300 and body["stop_sequences"] == ["END"] and body["metadata"] == {"user_id": "u-1"}
    named = sent({**chat, "tool_choice": {"type": "function", "function": {"name": "w"}}, "parallel_tool_calls": True})
    assert named["tool_choice"] == {"type": "tool", "name": "w"}


def test_reasoning_effort_and_structured_output() -> None:
    hello = [{"role": "user", "content": "Hi"}]
    assert sent({"messages": hello, "reasoning_effort": "medium"})["thinking"] == {
        "type": "enabled",
        "budget_tokens": 4096,
    }
    capped = sent({"messages": hello, "reasoning_effort": "high", "max_tokens": 2000})
    assert capped["thinking"] == {"type": "enabled", "budget_tokens": 1999}
    assert "thinking" not in sent({"messages": hello, "reasoning_effort": "minimal"})
    with pytest.raises(Untranslatable) as small:
        sent({"messages": hello, "reasoning_effort": "low", "max_tokens": 500})
    assert small.value.param == "reasoning_effort"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert sent({"messages": hello, "response_format": fmt})["output_config"] == {
        "format": {"type": "json_schema", "schema": schema}
    }


def test_headers_and_stream_flag() -> None:
    target = ProviderTarget(model="m", api_version="2026-10-21", beta=("a-1", "b-2"), extra_headers={"x-api-key": "k"})
    call = CODEC.request({"messages": [{"role": "user", "content": "Hi"}], "stream": True}, target)
    headers = dict(call.headers)
    assert call.method == "POST" and call.path == "/v1/messages" and call.stream
    assert headers["anthropic-version"] == "2026-10-21" and headers["anthropic-beta"] == "a-1,b-2"
    assert headers["x-api-key"] == "k" and orjson.loads(call.body)["stream"] is True
    assert (
        dict(CODEC.request({"messages": [{"role": "user", "content": "Hi"}]}, TARGET).headers)["anthropic-version"]
        == "2023-06-01"
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"seed": 7}, "seed"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"temperature": 1.5}, "temperature"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"store": True}, "store"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(Untranslatable) as refused:
        sent({"messages": [{"role": "user", "content": "Hi"}], **extra})
    assert refused.value.param == param


def test_refusals_inside_messages_and_by_version() -> None:
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}]
    with pytest.raises(Untranslatable) as part:
        sent({"messages": audio})
    assert part.value.param == "messages[0].content[0].type"
    with pytest.raises(Untranslatable) as named:
        sent({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]})
    assert named.value.param == "messages[0].name"
    hello = [{"role": "user", "content": "Hi"}]
    assert sent({"messages": hello, "temperature": 0.2, "top_p": 0.9})["temperature"] == 0.2
    with pytest.raises(Untranslatable) as sampling:
        sent({"messages": hello, "temperature": 0.2}, ProviderTarget(model="m", api_version="2026-10-21"))
    assert sampling.value.param == "temperature"


def test_allow_drop_lists_instead_of_refusing() -> None:
    target = ProviderTarget(model="m", allow_drop=True)
    call = CODEC.request({"messages": [{"role": "user", "content": "Hi"}], "n": 3, "seed": 1, "logprobs": True}, target)
    assert set(call.dropped) == {"n", "seed", "logprobs"}
    body = orjson.loads(call.body)
    assert "n" not in body and "seed" not in body
    ignored = CODEC.request(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "stream_options": {"include_usage": True},
            "prompt_cache_key": "k",
        },
        TARGET,
    )
    assert ignored.dropped == ()


def test_answer_with_tools_thinking_and_cache_usage() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 1000,
            "cache_creation_input_tokens": 300,
            "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200},
            "output_tokens": 50,
            "output_tokens_details": {"thinking_tokens": 20},
        },
    }
    completion, usage = CODEC.answer(orjson.dumps(message), TARGET)
    parsed = ChatCompletion.model_validate(completion)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls: Any = choice.message.tool_calls
    call = calls[0]
    assert call.function.arguments == '{"city":"Oslo"}'
    assert completion["choices"][0]["message"]["reasoning_content"] == "Hmm."
    assert usage.input_tokens == 1310 and usage.cache_read_tokens == 1000
    assert usage.cache_write_tokens == 100 and usage.cache_write_1h_tokens == 200 and usage.reasoning_tokens == 20
    assert parsed.usage is not None and parsed.usage.prompt_tokens == 1310 and parsed.usage.total_tokens == 1360


def events(*payloads: dict[str, Any]) -> bytes:
    return b"".join(b"event: " + p["type"].encode() + b"\ndata: " + orjson.dumps(p) + b"\n\n" for p in payloads)


STREAM = events(
    {
        "type": "message_start",
        "message": {"id": "msg_2", "model": "m", "usage": {"input_tokens": 5, "output_tokens": 1}},
    },
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "t1", "name": "w", "input": {}},
    },
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"ci'}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": 'ty":"X"}'}},
    {"type": "content_block_stop", "index": 1},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use"},
        "usage": {"output_tokens": 9, "cache_read_input_tokens": 3},
    },
    {"type": "message_stop"},
)


def test_stream_decoder_in_odd_pieces() -> None:
    decoder = CODEC.stream(TARGET)
    chunks: list[dict[str, Any]] = []
    for i in range(0, len(STREAM), 7):
        chunks.extend(decoder.feed(STREAM[i : i + 7]))
    chunks.extend(decoder.close())
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    arguments = "".join(
        call["function"]["arguments"]
        for c in chunks
        if c["choices"]
        for call in c["choices"][0]["delta"].get("tool_calls") or ()
    )
    assert text == "Hi" and orjson.loads(arguments) == {"city": "X"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert decoder.usage is not None and decoder.usage.input_tokens == 8 and decoder.usage.cache_read_tokens == 3


def test_stream_error_event_and_truncation() -> None:
    decoder = CODEC.stream(TARGET)
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with pytest.raises(ProviderStreamError) as failed:
        decoder.feed(STREAM[:200] + events(error))
    assert failed.value.error.status == 503 and failed.value.error.retryable
    cut = CODEC.stream(TARGET)
    cut.feed(STREAM[: STREAM.index(b"event: message_stop")])
    with pytest.raises(ProviderStreamError):
        cut.close()


def test_errors_and_rate_limits() -> None:
    overloaded = CODEC.error(
        529, {}, orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    )
    assert (overloaded.status, overloaded.kind, overloaded.retryable) == (503, "overloaded_error", True)
    limited = CODEC.error(
        429,
        {"retry-after": "7"},
        orjson.dumps({"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}),
    )
    assert (limited.status, limited.kind, limited.retryable, limited.retry_after_s) == (
        429,
        "rate_limit_error",
        True,
        7.0,
    )
    denied = CODEC.error(
        401, {}, orjson.dumps({"type": "error", "error": {"type": "authentication_error", "message": "no"}})
    )
    assert (denied.status, denied.kind, denied.retryable) == (401, "authentication_error", False)
    garbage = CODEC.error(502, {}, b"<html>bad gateway</html>")
    assert garbage.status == 502 and garbage.retryable and "bad gateway" in garbage.message
    state = CODEC.rate_limits(
        {
            "Date": "Sun, 06 Dec 2026 06:00:00 GMT",
            "anthropic-ratelimit-requests-remaining": "49",
            "anthropic-ratelimit-requests-reset": "2026-12-06T06:00:30Z",
            "anthropic-ratelimit-tokens-remaining": "9000",
            "anthropic-ratelimit-tokens-reset": "2026-12-06T06:00:05Z",
            "anthropic-ratelimit-input-tokens-remaining": "8000",
            "anthropic-ratelimit-output-tokens-remaining": "1000",
        }
    )
    assert (state.requests_remaining, state.tokens_remaining) == (49, 9000)
    assert (state.input_tokens_remaining, state.output_tokens_remaining) == (8000, 1000)
    assert state.reset_s == 5.0 and "anthropic-ratelimit-requests-reset" in state.extra


def test_reset_waits_for_the_exhausted_limit() -> None:
    headers = {
        "date": "Sun, 06 Dec 2026 06:00:00 GMT",
        "anthropic-ratelimit-requests-remaining": "10",
        "anthropic-ratelimit-requests-reset": "2026-12-06T06:00:02Z",
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": "2026-12-06T06:00:40Z",
    }
    assert CODEC.rate_limits(headers).reset_s == 40.0
    assert CODEC.rate_limits({**headers, "retry-after": "3"}).reset_s == 3.0
