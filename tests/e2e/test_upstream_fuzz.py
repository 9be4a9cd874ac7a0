"""What an engine answers is input too: the chaos suite's upstream fuzz (`bench/chaos/upstream_fuzz.py`)
in the suite, smaller. A stand-in engine answers each request with a drawn answer (any status and
content type, completions and events of any shape, usage counts of any value, cut anywhere, the
connection dropped), as a vLLM pool and as a TensorRT-LLM pool (whose other APIs are translated):
every request is answered and recorded exactly once, no record is negative, nothing is held after."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.chaos import upstream_fuzz
from bench.chaos.common import KEY, MODEL, ledger_tally
from bench.chaos.surfaces import request

pytestmark = pytest.mark.e2e


def test_whatever_an_engine_answers_every_request_is_answered_and_recorded_once(tmp_path: Path) -> None:
    result = upstream_fuzz.run(tmp_path, examples=1200)
    assert result["statuses"].get(200, 0) > 100, result  # the answers reach the readers, not only failures
    assert upstream_fuzz.met(result), "\n".join(upstream_fuzz.section(result))


def test_an_engines_usage_beyond_what_it_was_sent_is_billed_within_it(tmp_path: Path) -> None:
    """An engine that reports 10^12 tokens for a request sent `max_tokens: 4` is billed 4 output
    tokens and at most twice the model's context for the prompt: one broken answer cannot lock a key out
    of its token limit for a week, nor charge its budget for a trillion tokens."""
    usage = {"prompt_tokens": 10**12, "completion_tokens": 10**12}
    body = {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [], "usage": usage}
    answer = upstream_fuzz.Answer(200, "application/json", [orjson.dumps(body)])
    unread = {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [], "usage": "n/a"}
    with upstream_fuzz.started(tmp_path) as (gateway, engine):
        records = [upstream_fuzz.send_one(gateway, engine, answer, tmp_path) for _ in range(2)]
        # an answer whose usage cannot be read: the whole reservation, as for an answer cut mid-way
        unread_record = upstream_fuzz.send_one(
            gateway, engine, upstream_fuzz.Answer(200, "application/json", [orjson.dumps(unread)]), tmp_path
        )
    for record in records:
        assert record["output_tokens"] == 4 and record["input_tokens"] <= 2 * 16384, record
    assert records[1]["http_status"] == 200  # the first did not exhaust the key's token limit
    assert unread_record["usage_source"] == "reserved" and unread_record["output_tokens"] == 4, unread_record


def test_a_providers_usage_beyond_its_output_limit_is_billed_within_it(tmp_path: Path) -> None:
    """Anthropic's `max_tokens` covers thinking: an answer claiming 10^12 output tokens for a request
    sent 4 is a broken answer, billed 4. (Gemini's usage is billed as reported: `UNBOUNDED_OUTPUT`.)"""
    usage = {"input_tokens": 10**12, "output_tokens": 10**12}
    body = {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}], "usage": usage}
    answer = upstream_fuzz.Answer(200, "application/json", [orjson.dumps(body)])
    with upstream_fuzz.started(tmp_path, "anthropic") as (gateway, engine):
        records = [upstream_fuzz.send_one(gateway, engine, answer, tmp_path) for _ in range(2)]
    for record in records:
        assert record["http_status"] == 200 and record["output_tokens"] == 4 and record["input_tokens"] <= 2 * 16384


@pytest.mark.parametrize("kind", ["vllm", "anthropic"])
def test_an_event_that_never_ends_cuts_the_stream_instead_of_growing_without_bound(tmp_path: Path, kind: str) -> None:
    """17 MiB of one server-sent event with no end (past `MAX_EVENT_BYTES`): the relay, or the provider's
    codec, reads it in linear time up to the bound and cuts the stream there, with the cut reported
    to the client and the request recorded once, rather than buffering and rescanning it forever."""
    first = {"id": "x", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}  # fmt: skip
    start = b"data: " + orjson.dumps(first) + b"\n\n"
    if kind == "anthropic":
        start = b'event: message_start\ndata: {"type": "message_start", "message": {"id": "m", "usage": {}}}\n\n'
    endless = [b"data: " + b"x" * 65_530] * 272  # 17 MiB, no blank line
    answer = upstream_fuzz.Answer(200, "text/event-stream", [start, *endless])
    with upstream_fuzz.started(tmp_path, kind) as (gateway, engine):
        engine.answer = answer
        body = {**upstream_fuzz.BODIES["/v1/chat/completions"], "stream": True}
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "x-request-id": "endless-1"}
        status, _, raw = request(gateway.port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
        counts, _ = ledger_tally(tmp_path / "usage", "endless-")
    assert status in (200, 502), raw[:300]
    assert len(raw) < 1 << 20  # the endless event was not passed on
    assert counts == {"endless-1": 1}
