"""Program identity through `tokenway serve` with the official clients: the ledger names each
request's agent program (docs/agents.md), whichever way the client named it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.support.procs import TEST_KEY, Gateway, SimEngines, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "llama-3.1-8b"


def ledger_entry(ledger: Path, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if ledger.exists():
            found = [r for r in iter_entries(ledger) if r["request_id"] == request_id]
            if found:
                (entry,) = found
                return entry
        time.sleep(0.05)
    raise AssertionError(f"no ledger record for {request_id}")


def test_ledger_records_carry_the_program(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=1, served_model_name=MODEL)
    ledger = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)],
        policies={
            "tenants": {"t1": {}},
            "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
            "models": {MODEL: {"context_length": 16384}},
        },
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
    )
    oai = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=TEST_KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "hello"}]
    ids = {name: uuid.uuid4().hex for name in ("header", "user", "metadata", "none")}

    oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        user="end-user-1",  # the header outranks it
        extra_headers={"x-tokenway-program": "run-42", "x-request-id": ids["header"]},
    )
    oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, user="end-user-1", extra_headers={"x-request-id": ids["user"]}
    )
    claude.messages.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        metadata={"user_id": "claude-session-9"},
        extra_headers={"x-request-id": ids["metadata"]},
    )
    oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, extra_headers={"x-request-id": ids["none"]}
    )

    assert ledger_entry(ledger, ids["header"])["program"] == "run-42"
    assert ledger_entry(ledger, ids["user"])["program"] == "end-user-1"
    entry = ledger_entry(ledger, ids["metadata"])
    assert (entry["api"], entry["program"], entry["status"]) == ("messages", "claude-session-9", "ok")
    assert "program" not in ledger_entry(ledger, ids["none"])

    # a Responses conversation continued by previous_response_id is one program: its first response's id,
    # inherited turn after turn; a turn naming its own program keeps it, and its successors inherit that
    first = oai.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    turns = [uuid.uuid4().hex for _ in range(3)]
    second = oai.responses.create(
        model=MODEL, input="more", max_output_tokens=4, previous_response_id=first.id,
        extra_headers={"x-request-id": turns[0]},
    )  # fmt: skip
    oai.responses.create(
        model=MODEL, input="again", max_output_tokens=4, previous_response_id=second.id,
        extra_headers={"x-request-id": turns[1]},
    )  # fmt: skip
    named = oai.responses.create(
        model=MODEL, input="named", max_output_tokens=4, previous_response_id=second.id,
        extra_headers={"x-request-id": uuid.uuid4().hex, "x-tokenway-program": "ticket-7"},
    )  # fmt: skip
    oai.responses.create(
        model=MODEL, input="after", max_output_tokens=4, previous_response_id=named.id,
        extra_headers={"x-request-id": turns[2]},
    )  # fmt: skip
    assert [ledger_entry(ledger, t)["program"] for t in turns] == [first.id, first.id, "ticket-7"]


def test_a_looping_agent_is_stopped_by_the_runaway_guard(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    """An agent that gets the same tool result back each turn (fresh tool_use ids, a growing history)
    is refused after `program_max_repeats` such turns, in Anthropic's error shape; another program runs on."""
    engines = sim_factory(count=1, served_model_name=MODEL)
    ledger = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)],
        policies={
            "tenants": {"t1": {"program_max_repeats": 3}},
            "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
            "models": {MODEL: {"context_length": 16384}},
        },
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
    )
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=TEST_KEY, max_retries=0)
    history: list[Any] = [{"role": "user", "content": "look the word up"}]

    def loop_turn(i: int, program: str) -> None:
        history.append(
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "lookup", "input": {}}]}
        )
        history.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "not found"}]}
        )
        claude.messages.create(
            model=MODEL, messages=history, max_tokens=4, extra_headers={"x-claude-code-session-id": program}
        )

    for i in range(3):
        loop_turn(i, "looping-agent")
    with pytest.raises(anthropic.RateLimitError) as refused:
        loop_turn(3, "looping-agent")
    assert refused.value.status_code == 429
    body: Any = refused.value.body
    assert body["type"] == "error" and "program_max_repeats" in body["error"]["message"]
    request_id = refused.value.response.headers["x-request-id"]
    entry = ledger_entry(ledger, request_id)
    assert (entry["status"], entry["reject_reason"], entry["program"]) == ("rejected", "program_loop", "looping-agent")
    loop_turn(4, "another-agent")  # the guard stops a program, not the tenant
