"""Anthropic Messages API ⇄ chat completions: requests, messages, the event stream and errors.

Request: `system` (a string or text blocks) becomes a leading system message; content blocks
`text`, `image` (base64 → data URL, or url), `tool_use` (→ an assistant tool call), `tool_result`
(→ a tool message; images in it follow as a user message), `thinking` / `redacted_thinking`
(dropped: the chat template has no place for them); `tools` (`input_schema` → `parameters`),
`tool_choice` (`auto`, `any` → `required`, `tool` → a named function, `none`), `stop_sequences` →
`stop`, `max_tokens` (required, as Anthropic requires). Anything else with a `type` is refused.

Usage follows Anthropic's accounting: `input_tokens` excludes prompt tokens read from cache,
reported apart as `cache_read_input_tokens` (the total prompt is their sum).
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from backends.protocols import ProtocolError, typed_event, with_cost
from backends.types import answer_choices, call_index, object_field, objects, usage_count

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# --- request -------------------------------------------------------------------------------------


def _image_url(source: Any, where: str) -> str:
    if not isinstance(source, Mapping):
        raise ProtocolError(f"{where}.source must be an object", f"{where}.source")
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    raise ProtocolError(f"{where}.source must be a base64 or url image source", f"{where}.source")


def _tool_result_text(content: Any, where: str) -> tuple[str, list[str]]:
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or an array of blocks", f"{where}.content")
    texts: list[str] = []
    images: list[str] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "image":
            images.append(_image_url(block.get("source"), f"{where}.content[{k}]"))
        else:
            raise ProtocolError(f"{where}.content[{k}].type {kind!r} is not supported", f"{where}.content[{k}].type")
    return "\n".join(texts), images


def _convert_message(message: Any, i: int, out: list[dict[str, Any]]) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ProtocolError(f"{where} must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ProtocolError(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or an array of blocks", f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    tool_messages: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise ProtocolError(f"{at}.text must be a string", f"{at}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use":
            if role != "assistant" or not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ProtocolError(f"{at}: tool_use needs an id and a name, in an assistant message", at)
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ProtocolError(f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
            text, images = _tool_result_text(block.get("content"), at)
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            if images:
                tool_messages.append(
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]}
                )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise ProtocolError(f"{at}.type {kind!r} is not a supported content block", f"{at}.type")
    out.extend(tool_messages)
    if not parts and not calls:
        return
    chat: dict[str, Any] = {"role": role}
    if parts and all(p["type"] == "text" for p in parts):
        chat["content"] = "".join(p["text"] for p in parts)
    else:
        chat["content"] = parts or None
    if calls:
        chat["tool_calls"] = calls
    out.append(chat)


def _system_text(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for k, block in enumerate(system):
            if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ProtocolError(f"system[{k}] must be a text block", f"system[{k}]")
            texts.append(block["text"])
        return "\n".join(texts)
    raise ProtocolError("'system' must be a string or an array of text blocks", "system")


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("'tools' must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ProtocolError(f"tools[{i}].type {kind!r} is not supported (only custom tools)", f"tools[{i}].type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"tools[{i}].name is required", f"tools[{i}].name")
        if not isinstance(schema, Mapping):
            raise ProtocolError(f"tools[{i}].input_schema must be an object", f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": name, "parameters": dict(schema)}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ProtocolError("tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'", "tool_choice")


def to_chat(body: Mapping[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The chat completions request equivalent to a Messages (or count_tokens) request."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("model: Field required", "model")
    messages_in = body.get("messages")
    if not isinstance(messages_in, list) or not messages_in:
        raise ProtocolError("messages: must be a non-empty array", "messages")
    max_tokens = body.get("max_tokens")
    if not count_only and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ProtocolError("max_tokens: Field required (an integer >= 1)", "max_tokens")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(messages_in):
        _convert_message(message, i, messages)
    chat: dict[str, Any] = {"model": model, "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = chat_tool_choice(body.get("tool_choice")) or "auto"
    if count_only:
        return chat
    chat["max_tokens"] = max_tokens
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError("stop_sequences must be an array of strings", "stop_sequences")
        chat["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- response ------------------------------------------------------------------------------------


def usage_object(usage: Mapping[str, Any] | None, prompt_estimate: int = 0) -> dict[str, Any]:
    usage = usage if isinstance(usage, Mapping) else {}
    details = object_field(usage, "prompt_tokens_details")
    cached = usage_count(details.get("cached_tokens"))
    prompt = usage_count(usage.get("prompt_tokens")) or prompt_estimate
    return {
        "input_tokens": max(prompt - cached, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage_count(usage.get("completion_tokens")),
        **with_cost(usage),
    }


def stop_reason(choice: Mapping[str, Any], stop_sequences: Iterable[str] = ()) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): vLLM reports the matched stop string as the choice's stop_reason."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in set(stop_sequences):
        return "stop_sequence", matched
    if not isinstance(finish, str):  # an engine's `finish_reason` that is no reason
        return ("end_turn" if finish else None), None
    return (_STOP_REASONS.get(finish, "end_turn") if finish else None), None


def _tool_input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def from_chat(
    chat: Mapping[str, Any], request: Mapping[str, Any], message_id: str | None = None, model: str | None = None
) -> dict[str, Any]:
    choices = answer_choices(chat)
    choice = choices[0] if choices else {}
    message = object_field(choice, "message")
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": str(message["content"])})
    for call in objects(message.get("tool_calls")):
        function = object_field(call, "function")
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or new_id("toolu")),
                "name": str(function.get("name", "")),
                "input": _tool_input(str(function.get("arguments", ""))),
            }
        )
    reason, sequence = stop_reason(choice, request.get("stop_sequences") or ())
    return {
        "id": message_id or new_id(),
        "type": "message",
        "role": "assistant",
        "model": model or str(chat.get("model", "")),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_object(chat.get("usage")),
    }


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


# --- stream --------------------------------------------------------------------------------------


class MessagesStream:
    """Chat completion chunks in, Anthropic stream events out (SSE-framed bytes).

    `start(prompt_tokens)` sends `message_start` (usage as estimated: chat streams tell the real
    count only at the end) and a `ping`; `feed(chunk)` per chat chunk; `finish()` closes the open
    block and sends `message_delta` (stop reason, usage) and `message_stop`; `fail()` an `error`.
    """

    def __init__(self, request: Mapping[str, Any], model: str, message_id: str | None = None) -> None:
        self.request = request
        self.model = model
        self.message_id = message_id or new_id()
        self.index = -1
        self.block: str | None = None  # "text" | "tool_use" | None
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.finish_choice: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.prompt_estimate = 0
        self.ended = False

    def start(self, prompt_tokens: int = 0) -> bytes:
        self.prompt_estimate = prompt_tokens
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage_object(None, prompt_tokens), "output_tokens": 0},
        }
        return typed_event({"type": "message_start", "message": message}) + typed_event({"type": "ping"})

    def _stop_block(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return typed_event({"type": "content_block_stop", "index": self.index})

    def _start_block(self, block: dict[str, Any]) -> bytes:
        out = self._stop_block()
        self.index += 1
        self.block = block["type"]
        return out + typed_event({"type": "content_block_start", "index": self.index, "content_block": block})

    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        usage = chunk.get("usage")
        if type(usage) is dict and usage:
            self.usage = dict(usage)
        choices = answer_choices(chunk)
        if not choices:
            return b""
        choice = choices[0]
        delta = object_field(choice, "delta")
        out = b""
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.block != "text":
                out += self._start_block({"type": "text", "text": ""})
            out += typed_event(
                {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}
            )
        for call in objects(delta.get("tool_calls")):
            position = call_index(call)
            function = object_field(call, "function")
            if position not in self.calls:
                block = {
                    "type": "tool_use",
                    "id": str(call.get("id") or new_id("toolu")),
                    "name": str(function.get("name") or ""),
                    "input": {},
                }
                out += self._start_block(block)
                self.calls[position] = self.index
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments and self.calls[position] == self.index:
                out += typed_event(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    }
                )
        if choice.get("finish_reason"):
            self.finish_choice = {"finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason")}
        return out

    def finish(self) -> bytes:
        self.ended = True
        reason, sequence = stop_reason(
            self.finish_choice or {"finish_reason": "stop"}, self.request.get("stop_sequences") or ()
        )
        usage = usage_object(self.usage, self.prompt_estimate)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}
        return self._stop_block() + typed_event(delta) + typed_event({"type": "message_stop"})

    def fail(self, message: str, status: int = 500) -> bytes:
        self.ended = True
        return typed_event(error_body(status, message))


# --- errors and headers --------------------------------------------------------------------------


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str, request_id: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}, "request_id"}` (Anthropic's error shape)."""
    body: dict[str, Any] = {"type": "error", "error": {"type": kind or error_type(status), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@functools.lru_cache(maxsize=4096)  # the gateway's own reset values (a few per bucket state)
def duration_s(text: str) -> float | None:
    """Seconds of a Go-style duration (`1s`, `6m0s`, `12ms`), as OpenAI's reset headers write them."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


# x-ratelimit-{what}-{kind} -> (anthropic-ratelimit-{kind}-{what}, whether the value is a reset)
_RATELIMIT_NAMES = {
    f"x-ratelimit-{what}-{kind}": (f"anthropic-ratelimit-{kind}-{what}", what == "reset")
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens")
}


@functools.lru_cache(maxsize=256)
def _instant(unix_s: int) -> str:
    return datetime.datetime.fromtimestamp(unix_s, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ratelimit_headers(headers: Iterable[tuple[str, str]], now_unix_s: float) -> list[tuple[str, str]]:
    """`anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` from OpenAI's `x-ratelimit-*`
    (reset as an RFC 3339 instant, as Anthropic writes it). Parsed durations and written instants
    are cached: a response's headers cost a few dict lookups, not a parse and a format each."""
    out: list[tuple[str, str]] = []
    for name, value in headers:
        found = _RATELIMIT_NAMES.get(name) or _RATELIMIT_NAMES.get(name.lower())
        if found is None:
            continue
        anthropic_name, is_reset = found
        if is_reset:
            seconds = duration_s(value)
            if seconds is None:
                continue
            value = _instant(math.floor(now_unix_s + seconds))
        out.append((anthropic_name, value))
    return out
