"""Which answers end asking for tool calls, in the three grammars the relay reads (unary and streamed)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.upstream.relay import answer_calls_tools, events_call_tools


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({"choices": [{"finish_reason": "tool_calls"}]}, True, id="chat-tool-calls"),
        pytest.param({"choices": [{"finish_reason": "function_call"}]}, True, id="chat-legacy-function-call"),
        pytest.param({"choices": [{"finish_reason": "stop"}]}, False, id="chat-stop"),
        pytest.param({"stop_reason": "tool_use", "content": []}, True, id="messages-tool-use"),
        pytest.param({"stop_reason": "end_turn"}, False, id="messages-end-turn"),
        pytest.param({"output": [{"type": "message"}, {"type": "function_call"}]}, True, id="responses-call"),
        pytest.param({"output": [{"type": "message"}]}, False, id="responses-text"),
        pytest.param({}, False, id="empty"),
        pytest.param(None, False, id="none"),
    ],
)
def test_unary_answers(body: dict[str, Any] | None, expected: bool) -> None:
    assert answer_calls_tools(body) is expected


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param([_event({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})], True, id="chat-finish"),
        pytest.param([_event({"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]})], False, id="stop"),
        pytest.param(
            [b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use"}}'],
            True,
            id="anthropic-tool-use",
        ),
        pytest.param(
            [b'event: response.output_item.done\ndata: {"item":{"type":"function_call","name":"f"}}'],
            True,
            id="responses-function-call-item",
        ),
        pytest.param([b"data: [DONE]"], False, id="done-only"),
        pytest.param([_event({"choices": [{"delta": {"content": "call tool_calls later"}}]})], False, id="text"),
    ],
)
def test_stream_events(events: list[bytes], expected: bool) -> None:
    assert events_call_tools(events) is expected
