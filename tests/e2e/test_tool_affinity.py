"""Tool-boundary affinity end to end: a program whose answer ended in tool calls comes back, after
its tool run, to the replica that served it (docs/agents.md#tool-boundary-affinity).

Real processes: three simulated engines (time scale 10) that answer `tool_choice: required` with a
tool call (`finish_reason: tool_calls`), `tokenway serve` with the default pipeline plus the
`tool-affinity` scorer, the official `openai` client. Where each turn went is read from
`x-tokenway-endpoint`, why from the debug header `x-tokenway-route`, and whether the engine reused
the program's prefix from its own `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from policies.routing.config import PipelineConfig
from tests.support.procs import TEST_KEY, Gateway, SimEngines, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "llama-3.1-8b"
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find an order",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
    },
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("tool-affinity")
    engines: SimEngines = start_sim(workdir, count=3, served_model_name=MODEL)
    pipeline = PipelineConfig().model_dump()
    pipeline["scorers"].append({"type": "tool-affinity", "weight": 2.0, "params": {}})
    gateway = start_gateway(
        workdir / "gw", pools=[static_pool("agents", MODEL, engines.urls)], routing={"default": pipeline}
    )
    with running(engines, gateway):
        yield gateway


def _system(tag: str) -> str:
    return " ".join(f"{tag}-{i}" for i in range(400))  # a prompt of its own, ~1.6k tokens


def _turn(gateway: Gateway, program: str, messages: list[Any], **extra: Any) -> tuple[str, str, Any]:
    """(endpoint, route header, completion) of one turn of `program`."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        extra_headers={"x-tokenway-program": program, "x-tokenway-debug": "1"},
        **extra,
    )
    return raw.headers["x-tokenway-endpoint"], raw.headers["x-tokenway-route"], raw.parse()


def _streamed_turn(gateway: Gateway, program: str, messages: list[Any], **extra: Any) -> tuple[str, str | None]:
    """(endpoint, finish reason) of one streamed turn of `program`."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        stream=True,
        extra_headers={"x-tokenway-program": program},
        **extra,
    ) as raw:
        endpoint = raw.headers["x-tokenway-endpoint"]
        finish = None
        for chunk in raw.parse():
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
    return endpoint, finish


def _cached(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def _next_messages(first: list[Any], completion: Any) -> list[Any]:
    """The program's next turn: its prompt, the answer's tool call and the tool's result."""
    call = completion.choices[0].message.tool_calls[0]
    return [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "order 42: shipped"},
    ]


def test_a_program_returns_to_its_replica_after_a_tool_call(fleet: Gateway) -> None:
    program = f"agent-{uuid.uuid4().hex[:8]}"
    first = [{"role": "system", "content": _system(program)}, {"role": "user", "content": "Where is my order?"}]
    holder, _, answer = _turn(fleet, program, first, tools=[TOOL], tool_choice="required")
    assert answer.choices[0].finish_reason == "tool_calls"
    # unrelated traffic meanwhile sees the holder's pending return as KV in use
    _, route, _ = _turn(fleet, f"other-{uuid.uuid4().hex[:8]}", [{"role": "user", "content": _system("x")}])
    holder_scores = route.split(f"{holder}=[", 1)[1].split("]", 1)[0]
    assert "tool-affinity:1.000" not in holder_scores
    endpoint, route, back = _turn(fleet, program, _next_messages(first, answer), tools=[TOOL])
    assert endpoint == holder
    assert "reason=tool-return" in route
    assert _cached(back) >= answer.usage.prompt_tokens - 64  # the engine still held the program's prefix


def test_an_answer_without_tool_calls_leaves_no_pending_return(fleet: Gateway) -> None:
    program = f"chat-{uuid.uuid4().hex[:8]}"
    first = [{"role": "system", "content": _system(program)}, {"role": "user", "content": "Hello"}]
    _, _, answer = _turn(fleet, program, first)
    assert answer.choices[0].finish_reason != "tool_calls"
    _, route, _ = _turn(
        fleet, program, [*first, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]
    )
    assert "reason=tool-return" not in route


def test_a_streamed_tool_call_is_seen_too(fleet: Gateway) -> None:
    program = f"stream-{uuid.uuid4().hex[:8]}"
    first = [{"role": "system", "content": _system(program)}, {"role": "user", "content": "Where is my order?"}]
    holder, finish = _streamed_turn(fleet, program, first, tools=[TOOL], tool_choice="required")
    assert finish == "tool_calls"
    call = {"id": "call-1", "type": "function", "function": {"name": "lookup_order", "arguments": '{"order_id": "42"}'}}
    follow = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "order 42: shipped"},
    ]
    endpoint, route, _ = _turn(fleet, program, follow, tools=[TOOL])
    assert endpoint == holder and "reason=tool-return" in route
