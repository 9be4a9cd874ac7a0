"""Failover inside a stream, its pure parts: what may fail over, the continuation's chunks under the
fallback model's name, the marker in each grammar, a cut seen in an error event or a tool call under
way, each leg's share of the usage, and the ledger's leg fields (the e2e walk:
tests/e2e/test_stream_failover.py)."""

from __future__ import annotations

from typing import Any

import orjson

from backends.protocols import split_event
from gateway.apis.streams import MessagesFromChat, ResponsesFromChat
from gateway.ledger.writer import record_to_entry
from gateway.request.record import RequestRecord
from gateway.upstream.relay import RelayOutcome
from gateway.upstream.replica_loss import Moving, Splice, can_fail_over, can_migrate
from policies.types import Usage

MARKER = {"from": "big", "to": "small", "at_tokens": 3}


def chunk(delta: dict[str, Any], model: str = "big-engine") -> bytes:
    body = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
    return b"data: " + orjson.dumps(body)


def test_tools_may_fail_over_but_not_move_within_the_pool() -> None:
    body = {"messages": [], "tools": [{"type": "function"}], "stream": True}
    assert can_fail_over(body, "chat") and not can_migrate(body, "chat")
    assert not can_fail_over({"messages": [], "n": 2}, "chat")
    assert not can_fail_over({"messages": [], "response_format": {"type": "json_object"}}, "chat")
    assert not can_fail_over({"input": "x"}, "responses")


def test_the_continuation_names_the_fallback_model_under_the_streams_identity() -> None:
    splice = Splice(("chatcmpl-1", 42), 3, 11, "chat", model="small")
    out = splice.events([chunk({"role": "assistant", "content": ""}), chunk({"content": " b1"})])
    assert len(out) == 1  # the continuation's role chunk is dropped: the client had one
    parsed = orjson.loads(out[0][5:])
    assert (parsed["id"], parsed["created"], parsed["model"]) == ("chatcmpl-1", 42, "small")
    marker = orjson.loads(splice.marker(MARKER)[5:])
    assert marker["choices"] == [] and marker["tokenway"] == {"failover": MARKER}
    assert (marker["id"], marker["created"], marker["model"], marker["object"]) == (
        "chatcmpl-1",
        42,
        "small",
        "chat.completion.chunk",
    )


def test_the_marker_in_the_translated_grammars() -> None:
    responses = ResponsesFromChat({"input": "x"}, "big", 64, None, "resp_1")
    responses.begin()
    name, data = split_event(responses.failover(MARKER).rstrip(b"\n"))
    payload = orjson.loads(data or b"")
    assert name == "tokenway.failover"
    assert payload["type"] == "tokenway.failover" and payload["sequence_number"] == 2  # after created, in_progress
    assert payload["tokenway"] == {"failover": MARKER}
    messages = MessagesFromChat({"messages": []}, "big", 64, 11)
    _name, data = split_event(messages.failover(MARKER).rstrip(b"\n"))
    assert orjson.loads(data or b"") == {"type": "ping", "tokenway": {"failover": MARKER}}


def test_an_error_event_is_a_cut_and_nothing_after_it_is_relayed() -> None:
    moving = Moving()
    error = b'data: {"error": {"message": "boom"}}'
    out = moving.relaying([chunk({"content": " a1"}), error, b"data: [DONE]"])
    assert out == [chunk({"content": " a1"})]
    assert moving.error is not None and "boom" in moving.error
    assert not moving.finished  # [DONE] after an error is not the answer's end


def test_a_tool_call_delta_marks_the_stream() -> None:
    moving = Moving()
    moving.relaying([chunk({"content": " a1", "tool_calls": []})])
    assert not moving.tool_calls
    moving.relaying([chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]})])
    assert moving.tool_calls


def test_each_leg_is_billed_its_own_share() -> None:
    outcome = RelayOutcome(counted_completion_tokens=7, usage=Usage(prompt_tokens=11, completion_tokens=7))
    assert outcome.leg_tokens() == 7 and outcome.leg_usage() == outcome.usage  # one leg: the whole stream
    outcome.billed_tokens = 3  # the first leg sent three and was billed for them
    assert outcome.leg_tokens() == 4
    assert outcome.leg_usage() == Usage(prompt_tokens=11, completion_tokens=4)


def test_the_ledger_names_the_legs() -> None:
    plain = record_to_entry(RequestRecord(request_id="r", api="chat", started_at_unix_s=1.0))
    assert "leg" not in plain and "continues" not in plain
    first = record_to_entry(RequestRecord(request_id="r", api="chat", started_at_unix_s=1.0, leg=1))
    assert (first["leg"], first["continues"]) == (1, None)
    second = RequestRecord(request_id="r.leg2", api="chat", started_at_unix_s=1.0, leg=2, continues="r")
    assert (record_to_entry(second)["leg"], record_to_entry(second)["continues"]) == (2, "r")


def test_an_engines_usage_is_billed_within_what_it_was_sent() -> None:
    """An engine the gateway fronts was sent the reservation as its output limit and reads no prompt
    past its context: a report beyond either (a broken or hostile engine) is billed at the bound."""
    outcome = RelayOutcome(usage=Usage(prompt_tokens=10**12, completion_tokens=10**12, cached_tokens=10**12))
    outcome.bound_usage(64, 8192)
    assert outcome.leg_usage() == Usage(prompt_tokens=8192, completion_tokens=64, cached_tokens=8192)
    outcome.usage = Usage(prompt_tokens=100, completion_tokens=30, cached_tokens=20)
    assert outcome.leg_usage() == outcome.usage  # within the bounds: as reported
    outcome.bound_usage(0, None)  # a hosted provider's answer: billed as it reports it
    outcome.usage = Usage(prompt_tokens=10**6, completion_tokens=10**6)
    assert outcome.leg_usage() == outcome.usage
