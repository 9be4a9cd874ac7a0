"""Continuing a cut stream: the continuation request and the splice of its events (pure)."""

from __future__ import annotations

from typing import Any

import orjson

from backends.types import Endpoint
from gateway.upstream.replica_loss import Resumer, Splice, can_migrate, continuation_body, sent_text, stream_identity

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "Tell me"}],
    "max_tokens": 50,
    "stream": True,
}


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None, cid: str = "a") -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    body = {"id": cid, "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + orjson.dumps(body)


def usage_chunk(prompt: int, completion: int, cid: str = "b") -> bytes:
    body = {"id": cid, "object": "chat.completion.chunk", "created": 9, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": prompt}}}  # fmt: skip
    return b"data: " + orjson.dumps(body)


def test_what_can_move() -> None:
    assert can_migrate({"messages": [], "stream": True}, "chat")
    assert can_migrate({"prompt": "x"}, "completions")
    assert not can_migrate({"messages": [], "n": 2}, "chat")
    assert not can_migrate({"messages": [], "tools": [{"type": "function"}]}, "chat")
    assert not can_migrate({"messages": [], "logprobs": True}, "chat")
    assert not can_migrate({"input": "x"}, "responses")


def test_chat_continues_the_assistant_message_with_the_budget_left() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    out = continuation_body(body, "chat", "Hello th", 3)
    assert out is not None
    assert out["messages"][-1] == {"role": "assistant", "content": "Hello th"}
    assert len(out["messages"]) == 2
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_tokens"] == 47
    assert body["max_tokens"] == 50 and body["messages"] == [{"role": "user", "content": "hi"}]  # untouched
    assert continuation_body({**body, "max_tokens": 3}, "chat", "abc", 3) is None  # nothing left
    assert continuation_body(body, "chat", "", 0) == body  # nothing sent yet: the same request


def test_completions_continue_the_prompt() -> None:
    out = continuation_body({"prompt": ["Once"], "max_tokens": 10, "min_tokens": 4}, "completions", " upon", 2)
    assert out == {"prompt": "Once upon", "max_tokens": 8, "min_tokens": 2}
    assert continuation_body({"prompt": [1, 2, 3]}, "completions", "x", 1) is None  # token-id prompts stay


def test_sent_text_and_identity() -> None:
    events = [chunk(role="assistant", content=""), chunk("Hel"), chunk("lo"), b"data: [DONE]"]
    assert sent_text(events, "chat") == "Hello"
    completion = b"data: " + orjson.dumps({"id": "c", "object": "text_completion", "choices": [{"text": "ab"}]})
    assert sent_text([completion], "completions") == "ab"
    assert stream_identity(events[1]) == ("a", 7)


def test_splice_reads_as_the_original_stream() -> None:
    splice = Splice(("a", 7), sent_tokens=2, prompt_tokens=100, api="chat")
    out = splice.events([chunk(role="assistant", content="", cid="b"), chunk("lo", cid="b"),
                         chunk(finish="stop", cid="b"), usage_chunk(130, 5), b"data: [DONE]"])  # fmt: skip
    parsed = [orjson.loads(e[5:]) for e in out[:-1]]
    assert len(out) == 4  # the continuation's role-only opening is dropped
    assert {p["id"] for p in parsed} == {"a"} and {p["created"] for p in parsed} == {7}
    assert parsed[0]["choices"][0]["delta"] == {"content": "lo"}
    usage = parsed[-1]["usage"]
    assert usage["prompt_tokens"] == 100  # the recomputed prefix is not billed
    assert usage["completion_tokens"] == 7 and usage["total_tokens"] == 107
    assert usage["prompt_tokens_details"]["cached_tokens"] == 100
    assert out[-1] == b"data: [DONE]"


def _endpoint(name: str) -> Endpoint:
    return Endpoint(id=name, pool="p", base_url="http://127.0.0.1:1", engine="sim", served_model="m")


async def test_a_cut_waits_for_another_replica_to_come_back_into_routing() -> None:
    # The other replica is out of routing for the first asks (a probe that timed out on a busy host):
    # the continuation waits for it instead of ending the stream at once.
    other = _endpoint("p/both-1")
    asked: list[frozenset[str]] = []

    def route(avoid: frozenset[str]) -> Endpoint | None:
        asked.append(avoid)
        return other if len(asked) >= 3 and other.id not in avoid else None

    sent: list[str] = []

    async def send(endpoint: Endpoint, body: dict[str, Any]) -> None:
        sent.append(endpoint.id)
        return None  # the continuation fails there too: the resumer gives up after trying it

    resumer = Resumer(
        CHAT, "chat", 10, "p/both-0", route, send, lambda avoid: other.id not in avoid, wait_s=30.0, poll_s=0.0
    )
    assert await resumer("Once upon", 2) is None
    assert sent == ["p/both-1"]
    assert asked[0] == frozenset({"p/both-0"})
    assert len(asked) == 4  # two misses, the hit, then one more ask that finds nobody left to try
    assert other.inflight.requests == 0  # the failed continuation's load ticket ended


async def test_a_cut_with_no_replica_left_ends_at_once() -> None:
    asked: list[frozenset[str]] = []

    def route(avoid: frozenset[str]) -> Endpoint | None:
        asked.append(avoid)
        return None

    async def send(endpoint: Endpoint, body: dict[str, Any]) -> None:
        raise AssertionError("nothing to send to")

    resumer = Resumer(CHAT, "chat", 10, "p/both-0", route, send, lambda avoid: False, wait_s=30.0, poll_s=0.0)
    assert await resumer("Once upon", 2) is None
    assert len(asked) == 1


async def test_a_preempted_stream_waits_its_turn_and_may_continue_where_it_was_cut() -> None:
    """Flow control cut it to free its slot, not because its replica broke: it takes the turn the
    waiting room gives it, its own replica included, and the router is not asked around the room."""
    own = _endpoint("p/both-0")
    turns: list[str] = []
    sent: list[tuple[str, dict[str, Any]]] = []

    def route(avoid: frozenset[str]) -> Endpoint | None:
        raise AssertionError("a preempted stream is routed by its turn, not around the waiting room")

    async def wait_turn() -> Endpoint | None:
        turns.append("turn")
        return own

    async def send(endpoint: Endpoint, body: dict[str, Any]) -> Any:
        sent.append((endpoint.id, body))
        return object()  # an upstream answer

    resumer = Resumer(CHAT, "chat", 10, "p/both-0", route, send, wait_turn=wait_turn)
    resumed = await resumer("Once upon", 2, True)
    assert resumed is not None and resumed.endpoint_id == "p/both-0" and turns == ["turn"]
    assert sent[0][1]["max_tokens"] == 48 and sent[0][1]["messages"][-1]["content"] == "Once upon"
    assert own.inflight.requests == 1  # the continuation's load is on it now
    # and its prompt (the original 10 tokens and the 2 sent) is a pending prefill there until the relay
    # sees its first new token: the answer's headers come before the engine has prefilled it
    assert own.inflight.prefill_tokens == 12 and not resumed.ticket.prefilled
    resumed.ticket.end()
    assert own.inflight.requests == 0 and own.inflight.prefill_tokens == 0


async def test_a_preempted_stream_whose_wait_ends_without_a_turn_ends_there() -> None:
    def route(avoid: frozenset[str]) -> Endpoint | None:
        raise AssertionError("no going around the waiting room")

    async def wait_turn() -> Endpoint | None:
        return None  # its band's deadline passed

    async def send(endpoint: Endpoint, body: dict[str, Any]) -> Any:
        raise AssertionError("nothing is sent")

    resumer = Resumer(CHAT, "chat", 10, "p/both-0", route, send, wait_turn=wait_turn)
    assert await resumer("Once upon", 2, True) is None
