"""Anthropic Messages ⇄ chat translation as pure functions."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.protocols import ProtocolError, anthropic, split_event


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(split_event(b)[1] or b"") for b in raw.split(b"\n\n") if b.strip()]


def test_system_blocks_tools_and_results() -> None:
    body = {
        "model": "m",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                ],
            },
        ],
        "tools": [{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"},
    }
    chat = anthropic.to_chat(body)
    messages = chat["messages"]
    assert messages[0] == {"role": "system", "content": "You are terse."}
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"city":"Oslo"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "cold"}
    assert messages[4]["content"][0]["image_url"]["url"] == "data:image/png;base64,AAA"
    assert chat["tool_choice"] == "required" and chat["stop"] == ["END"] and chat["user"] == "u1"
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", id="max-tokens-required"),
        pytest.param({"max_tokens": 5, "messages": []}, "messages", id="empty"),
        pytest.param({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", id="role"),
        pytest.param(
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
            id="block",
        ),
        pytest.param(
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
            "tools[0].type",
            id="server-tool",
        ),
    ],
)
def test_bad_input(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ProtocolError) as info:
        anthropic.to_chat({"model": "m", **body})
    assert info.value.param == param


def test_from_chat_usage_and_stop_sequence() -> None:
    chat = {
        "model": "m",
        "choices": [{"finish_reason": "stop", "stop_reason": "END", "message": {"content": "hi"}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 6}},
    }
    out = anthropic.from_chat(chat, {"stop_sequences": ["END"]}, "msg_1")
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "END"
    assert out["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 6,
        "output_tokens": 2,
    }
    tool = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a":1}'}}]},
            }
        ]
    }
    out = anthropic.from_chat(tool, {})
    assert out["stop_reason"] == "tool_use" and out["content"] == [
        {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}
    ]


def test_stream_sequence() -> None:
    stream = anthropic.MessagesStream({}, "m", "msg_s")
    raw = stream.start(12)
    raw += stream.feed({"choices": [{"delta": {"content": "He"}}]})
    raw += stream.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}}]})
    raw += stream.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]})
    raw += stream.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    raw += stream.feed({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4}})
    raw += stream.finish()
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 12
    assert events[5]["content_block"]["type"] == "tool_use" and events[5]["index"] == 1
    assert events[8]["delta"]["stop_reason"] == "tool_use" and events[8]["usage"]["output_tokens"] == 4


def test_errors_and_ratelimit_headers() -> None:
    assert anthropic.error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert anthropic.error_body(429, "slow", "req_1") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow"},
        "request_id": "req_1",
    }
    assert anthropic.duration_s("6m0s") == 360.0 and anthropic.duration_s("12ms") == pytest.approx(0.012)
    assert anthropic.duration_s("soon") is None
    headers = [("x-ratelimit-limit-requests", "60"), ("x-ratelimit-reset-tokens", "1m30s"), ("other", "x")]
    assert anthropic.ratelimit_headers(headers, 0.0) == [
        ("anthropic-ratelimit-requests-limit", "60"),
        ("anthropic-ratelimit-tokens-reset", "1970-01-01T00:01:30Z"),
    ]
