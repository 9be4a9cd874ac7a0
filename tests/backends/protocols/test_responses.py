"""Responses ⇄ chat translation as pure functions."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.protocols import ProtocolError, responses, split_event
from backends.protocols.responses import ResponsesStream


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block.strip():
            name, data = split_event(block)
            assert data is not None
            payload = orjson.loads(data)
            assert payload["type"] == name
            out.append(payload)
    return out


def test_string_input_and_instructions() -> None:
    chat = responses.to_chat({"model": "m", "input": "Hi", "instructions": "Be brief", "max_output_tokens": 7})
    assert chat["messages"] == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert chat["max_tokens"] == 7


def test_items_function_call_round_trip() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city":"x"}'},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": []},
    ]
    chat = responses.to_chat({"model": "m", "input": items})
    assert chat["messages"][0] == {"role": "user", "content": "weather?"}
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert len(chat["messages"]) == 3


def test_tools_choice_and_format() -> None:
    body = {
        "model": "m",
        "input": "x",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "S", "schema": {"type": "object"}, "strict": True}},
        "stream": True,
    }
    chat = responses.to_chat(body)
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"] == {"name": "S", "schema": {"type": "object"}, "strict": True}
    assert chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"input": [{"type": "computer_call"}]}, "input[0].type", id="unknown-item"),
        pytest.param({"input": [{"content": "no role"}]}, "input[0]", id="untyped-item"),
        pytest.param({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", id="bad-role"),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "audio"}]}]}, "input[0].content[0].type", id="part"
        ),
        pytest.param({"input": 3}, "input", id="not-a-list"),
        pytest.param({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", id="builtin-tool"),
        pytest.param({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", id="format"),
        pytest.param({"input": "x", "max_output_tokens": 0}, "max_output_tokens", id="max-output"),
        pytest.param({"input": [{"type": "function_call_output", "call_id": 1}]}, "input[0].call_id", id="call-id"),
    ],
)
def test_bad_input_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ProtocolError) as info:
        responses.to_chat({"model": "m", **body})
    assert info.value.param == param


def test_from_chat_text_tools_usage_and_length() -> None:
    chat = {
        "created": 5,
        "model": "m",
        "choices": [
            {
                "finish_reason": "length",
                "message": {
                    "content": "hello",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    out = responses.from_chat(chat, {"input": "q", "store": False}, "resp_1")
    assert out["id"] == "resp_1" and out["object"] == "response" and out["store"] is False
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    assert responses.output_text(out) == "hello"
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": 4}
    assert out["usage"]["total_tokens"] == 13
    items = responses.conversation_items({"input": "q"}, out)
    assert [i.get("type") for i in items] == ["message", "message", "function_call"]
    assert responses.to_chat({"model": "m", "input": "next"}, items)["messages"][1]["content"] == "hello"


def test_stream_text_then_tool_call() -> None:
    stream = ResponsesStream({"input": "q"}, "m", "resp_s")
    raw = stream.start()
    raw += stream.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    raw += stream.feed({"choices": [{"delta": {"content": "Hel"}}]})
    raw += stream.feed({"choices": [{"delta": {"content": "lo"}}]})
    call = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}
    raw += stream.feed({"choices": [{"delta": {"tool_calls": [call]}}]})
    raw += stream.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]})
    raw += stream.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    raw += stream.feed({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}})
    raw += stream.finish()
    events = _events(raw)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["usage"]["output_tokens"] == 3 and done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert done["output"][1]["arguments"] == "{}"


def test_stream_failure() -> None:
    stream = ResponsesStream({"input": "q"}, "m")
    stream.start()
    event = _events(stream.fail("engine went away"))[0]
    assert event["type"] == "response.failed"
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"]["message"] == "engine went away"
