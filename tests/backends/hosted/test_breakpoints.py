"""Cache breakpoints placed by policy: at the stable prefix and at the end, never over the client's own."""

from __future__ import annotations

from typing import Any

from backends.hosted.anthropic import messages_body
from backends.hosted.base import ProviderTarget
from backends.hosted.chat_in import with_breakpoints

LONG = "You are a careful assistant. " * 300  # ~2,100 tokens at 4 bytes a token
TARGET = ProviderTarget(model="claude-sonnet-4-5")


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), "max_tokens": 8, **extra}


def test_the_system_prompt_and_the_conversation_end_are_marked() -> None:
    body = chat({"role": "system", "content": LONG}, {"role": "user", "content": "hi"})
    marked = with_breakpoints(body, 1024)
    assert marked["messages"][0]["cache_control"] == {"type": "ephemeral"}
    assert marked["messages"][1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in body["messages"][0]  # the client's body is not changed
    wire, _ = messages_body(marked, TARGET)  # the codec puts them on the blocks Anthropic caches
    assert wire["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert wire["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}


def test_short_prompts_and_client_marks_are_left_alone() -> None:
    short = chat({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
    assert with_breakpoints(short, 1024) == short
    own = chat(
        {"role": "system", "content": LONG},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
    )
    assert with_breakpoints(own, 1024) == own


def test_tools_are_marked_when_there_is_no_system_prompt_and_the_ttl_carries() -> None:
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": LONG[:2000]}} for i in range(3)]
    body = chat({"role": "user", "content": "hi"}, tools=tools)
    marked = with_breakpoints(body, 1024, "1h")
    assert marked["tools"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert "cache_control" not in marked["tools"][0]
    assert marked["messages"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_a_long_conversation_without_a_system_prompt_marks_only_its_end() -> None:
    body = chat(
        {"role": "user", "content": LONG}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}
    )
    marked = with_breakpoints(body, 1024)
    assert [("cache_control" in m) for m in marked["messages"]] == [False, False, True]
