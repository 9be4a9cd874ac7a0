"""An engine's answer is input: every reader of its chunks and answers takes any JSON value where an
object belongs (`data: null`, a list of choices that are strings, a `delta` that is a number, usage
that is text) without raising, so a broken engine makes a 502 or an odd answer, never a request that
meets a bug. `bench/chaos/upstream_fuzz.py` draws such answers at random; these are its findings."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.protocols import anthropic, responses
from backends.types import InFlight, answer_choices, call_index, object_field, objects
from gateway.upstream.relay import RelayOutcome, relay_events
from gateway.upstream.replica_loss import sent_text

ODD: list[Any] = [
    None,
    7,
    "text",
    [1, "a"],
    {"choices": None},
    {"choices": "abc"},
    {"choices": [None, 3, "x"]},
    {"choices": [{"delta": 5, "message": "m", "finish_reason": ["stop"]}]},
    {"choices": [{"delta": {"content": 5, "tool_calls": ["x", {"index": "a", "function": 3}]}}]},
    {"choices": [{"message": {"content": "hi", "tool_calls": [None, {"function": {"arguments": 5}}]}}]},
    {"usage": "abc", "choices": []},
    {"usage": [1], "created": "x", "choices": [{"finish_reason": {"a": 1}}]},
    {"usage": {"prompt_tokens_details": 3, "prompt_tokens": -5}, "choices": []},
]


@pytest.mark.parametrize("value", ODD)
def test_the_relay_reads_any_chunk(value: Any) -> None:
    event = b"data: " + orjson.dumps(value)
    outcome = RelayOutcome()
    relay_events([event, event], outcome, InFlight().begin(0), None, True, 10)
    assert sent_text([event], "chat") == "" or isinstance(sent_text([event], "chat"), str)


@pytest.mark.parametrize("value", ODD)
def test_the_translations_read_any_answer_and_chunk(value: Any) -> None:
    chat = value if isinstance(value, dict) else {"choices": value}
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert anthropic.from_chat(chat, request)["type"] == "message"
    assert responses.from_chat(chat, {"model": "m", "input": "hi"})["object"] == "response"
    messages = anthropic.MessagesStream(request, "m")
    messages.start()
    messages.feed(chat)
    messages.finish()
    stream = responses.ResponsesStream({"model": "m", "input": "hi"}, "m")
    stream.start()
    stream.feed(chat)
    stream.finish()


def test_the_shape_readers() -> None:
    assert answer_choices({"choices": [{"a": 1}, None, "x"]}) == [{"a": 1}]
    assert answer_choices([{"choices": []}]) == [] and answer_choices({"choices": {"a": 1}}) == []
    assert object_field({"delta": 3}, "delta") == {} and object_field({"delta": {"c": 1}}, "delta") == {"c": 1}
    assert objects([{"a": 1}, 2]) == [{"a": 1}] and objects("x") == []
    assert [call_index({"index": i}) for i in (2, -1, "3", None, 1.5)] == [2, 0, 0, 0, 0]
