"""The chat body every codec starts from, and the prompt-cache marks policy adds to it before a codec
reads it: both are chat-level and the same whichever provider the body goes to.

Reading the chat body
---------------------
Reading the chat body every codec starts from: what is the same whichever provider it goes to.

Each codec writes its provider's shapes (Converse blocks, Gemini parts, Anthropic blocks); the walk
over a chat body's content parts, tool calls and turns, the refusal bookkeeping and the header lookup
are one piece of code here, so a fix to how a chat body is read reaches every provider at once.

Prompt-cache breakpoints
------------------------
Prompt-cache breakpoints placed by policy, for providers that cache only where told (Anthropic's
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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import orjson

from backends.hosted.base import Untranslatable
from backends.protocols import ProtocolError

Block = dict[str, Any]
# A codec's converter for a content part other than text: the provider's blocks for it ([] when the part
# was refused through `Refusals` and dropped), or None when the provider takes no part of that type.
PartConverter = Callable[[Any, Mapping[str, Any], str], list[Block] | None]


class Refusals:
    """Collects fields with no counterpart upstream: raise at the first (the gateway answers 400 naming
    it), or, when the target allows dropping, list them all for `x-tokenway-dropped-fields`."""

    def __init__(self, allow_drop: bool, provider: str = "") -> None:
        self.allow_drop = allow_drop
        self.provider = provider
        self.dropped: list[str] = []

    def refuse(self, param: str, why: str) -> None:
        if self.allow_drop:
            self.dropped.append(param)
            return
        suffix = f" ({self.provider} has no counterpart)" if self.provider else ""
        raise Untranslatable(f"{param}: {why}{suffix}", param)


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A response header by its lower-case name, from a mapping that may not fold case."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


def content_parts(
    content: Any,
    where: str,
    refusals: Refusals,
    convert: PartConverter,
    *,
    cache_marker: Callable[[Any, str], Block] | None = None,
) -> list[Block]:
    """A chat message's `content` (a string or an array of parts) as the provider's blocks.

    Text and refusal parts become `{"text": ...}`; every other part goes to `convert`. Where the
    provider marks cache breakpoints with blocks of their own (Bedrock's `cachePoint`), `cache_marker`
    turns a part's `cache_control` into the block that follows it.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or an array of parts", f"{where}.content")
    blocks: list[Block] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, Mapping):
            raise ProtocolError(f"{at} must be an object", at)
        kind = part.get("type")
        if kind in ("text", "refusal"):
            text = part.get(kind)
            if not isinstance(text, str):
                raise ProtocolError(f"{at}.{kind} must be a string", f"{at}.{kind}")
            converted: list[Block] | None = [{"text": text}] if text else []
        else:
            converted = convert(kind, part, at)
        if converted is None:
            refusals.refuse(f"{at}.type", f"content part type {kind!r} is not supported here")
            continue
        blocks.extend(converted)
        if cache_marker is not None and part.get("cache_control") is not None and blocks:
            blocks.append(cache_marker(part["cache_control"], at))
    return blocks


def image_url(part: Mapping[str, Any]) -> Any:
    """The URL of an `image_url` part (an object with `url`, or the URL itself)."""
    image = part.get("image_url")
    return image.get("url") if isinstance(image, Mapping) else image


def tool_function(call: Any, at: str) -> Mapping[str, Any]:
    """The `function` of an assistant's tool call, its name checked."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ProtocolError(f"{at}.function.name must be a string", f"{at}.function.name")
    return function


def tool_arguments(arguments: Any, where: str) -> Any:
    """A tool call's `arguments` (a JSON string, or an object some clients send) as a value; empty is {}."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise ProtocolError(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments")
    if not arguments.strip():
        return {}
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from exc


class Turns:
    """The provider's alternating turns: consecutive items of one role merge into one turn (every
    provider here refuses two user turns in a row, which chat allows, e.g. a tool result then a user text)."""

    def __init__(self, items_key: str) -> None:
        self.items_key = items_key
        self.turns: list[Block] = []

    def add(self, role: str, items: list[Block]) -> None:
        if not items:
            return
        if self.turns and self.turns[-1]["role"] == role:
            self.turns[-1][self.items_key].extend(items)
        else:
            self.turns.append({"role": role, self.items_key: items})


def pack_signed_id(call_id: str, signature: str | None, marker: str) -> str:
    """A tool call id that carries a provider's signature through the client and back.

    Thinking models sign what they produce (Claude its thinking block, Gemini its function calls) and
    want the signature back in the next turn; chat has no field for it, but every client echoes a tool
    call's id verbatim. The id becomes `{marker}{len(id)}-{id}{signature}`, the signature in URL-safe
    base64 without padding, so it keeps to `[A-Za-z0-9_-]` (Anthropic's tool id alphabet) when the
    call's own id does.
    """
    if not signature:
        return call_id
    compact = signature.replace("+", "-").replace("/", "_").rstrip("=")
    return f"{marker}{len(call_id)}-{call_id}{compact}"


def unpack_signed_id(value: str, marker: str) -> tuple[str, str | None]:
    """(the call's own id, the signature in standard base64, or None) of a `pack_signed_id` id."""
    if not value.startswith(marker):
        return value, None
    length, sep, rest = value[len(marker) :].partition("-")
    if not sep or not length.isdigit() or int(length) >= len(rest):
        return value, None
    size = int(length)
    signature = rest[size:].replace("-", "+").replace("_", "/")
    return rest[:size], signature + "=" * (-len(signature) % 4)


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
