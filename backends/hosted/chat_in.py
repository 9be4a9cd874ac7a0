"""Reading the chat body every codec starts from: what is the same whichever provider it goes to.

Each codec writes its provider's shapes (Converse blocks, Gemini parts, Anthropic blocks); the walk
over a chat body's content parts, tool calls and turns, the refusal bookkeeping and the header lookup
are one piece of code here, so a fix to how a chat body is read reaches every provider at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from backends.hosted.base import Untranslatable
from backends.protocols.errors import ProtocolError

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
