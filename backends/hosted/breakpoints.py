"""Prompt-cache breakpoints placed by policy, for providers that cache only where told (Anthropic's
Messages, Bedrock's Converse): `cache_breakpoints: auto` on a hosted pool.

Those providers reuse a prompt prefix only up to a block marked `cache_control` (Anthropic: up to 4
marks, each caching everything before it; a later request whose prompt starts with the same blocks
reads them at a tenth of the input price, the first one writes them at 1.25x). Clients written for
OpenAI-compatible APIs never mark anything, so an agent that resends a 30k-token history each turn
pays for all of it each turn. With `auto`, a chat body that carries no mark of its own gets (on a
copy; the client's body is not changed):

1. the end of the system prompt (which also covers the tools: providers order tools before system),
   or the last tool when there is no system prompt, when that stable part alone is long enough;
2. the last message: the conversation so far, read back by the next turn, which marks its own end.

"Long enough" is `min_tokens` estimated as bytes / 4 (the providers ignore marks under their own
minimum, 1,024 tokens for most Claude models: a mark there would cost a write and never be read). A
body that already marks anything is the client's own choice and is left alone. The codecs translate
the chat-level `cache_control` to their wire format (backends/hosted/anthropic.py, bedrock.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

EPHEMERAL: Final = {"type": "ephemeral"}


def with_breakpoints(chat: Mapping[str, Any], min_tokens: int, ttl: str | None = None) -> dict[str, Any]:
    """`chat` with cache breakpoints at its stable prefix and its end, or `chat` itself when it marks
    anything already, has nothing long enough to cache, or is not a list of messages."""
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages or _marked(chat):
        return dict(chat)
    mark = {**EPHEMERAL, "ttl": ttl} if ttl else dict(EPHEMERAL)
    out = dict(chat)
    marked = list(messages)
    system_end = _system_end(marked)
    tools = chat.get("tools")
    if system_end is not None:
        stable: Sequence[Any] = [*(tools if isinstance(tools, list) else ()), *marked[: system_end + 1]]
        if _tokens(stable) >= min_tokens:
            marked[system_end] = {**marked[system_end], "cache_control": mark}
    elif isinstance(tools, list) and tools and isinstance(tools[-1], dict) and _tokens(tools) >= min_tokens:
        out["tools"] = [*tools[:-1], {**tools[-1], "cache_control": mark}]
    last = marked[-1]
    conversation = system_end is None or system_end < len(marked) - 1  # a turn after the system prompt
    if isinstance(last, dict) and conversation and _tokens([tools or (), *marked]) >= min_tokens:
        marked[-1] = {**last, "cache_control": mark}
    out["messages"] = marked
    return out


def _system_end(messages: list[Any]) -> int | None:
    """The index of the last system (or developer) message of the leading run, if any."""
    end = None
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            end = i
        else:
            break
    return end


def _marked(chat: Mapping[str, Any]) -> bool:
    """Whether the client placed any `cache_control` itself (on a tool, a message or a content part)."""
    for tool in chat.get("tools") or ():
        if isinstance(tool, dict) and "cache_control" in tool:
            return True
    for message in chat.get("messages") or ():
        if not isinstance(message, dict):
            continue
        if "cache_control" in message:
            return True
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and "cache_control" in p for p in content):
            return True
    return False


def _tokens(parts: Sequence[Any]) -> int:
    """A cheap size estimate: 4 bytes of JSON per token (an estimate; the provider's count settles)."""
    return len(orjson.dumps(list(parts))) // 4
