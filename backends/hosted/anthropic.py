"""Chat completions ⇄ Anthropic's Messages API (`POST /v1/messages`), for pools with `engine: anthropic`.

Request (chat → Messages):
- `system` / `developer` messages become the top-level `system` blocks, wherever they stood (Messages
  has no mid-conversation system turn); `user` parts `text` and `image_url` (a data URL becomes a
  base64 source, any other URL a url source) become blocks; an assistant's `tool_calls` become
  `tool_use` blocks (arguments parsed as JSON); `tool` messages become `tool_result` blocks of one user
  turn (consecutive turns of one role are merged, as Anthropic requires the results of a turn's
  calls together).
- `cache_control` on a content part, on a message (its last block) or on a tool passes through as it is.
- `tools` (`parameters` → `input_schema`), `tool_choice` (`auto`, `none`, `required` → `any`, a named
  function → `tool`), `parallel_tool_calls: false` → `disable_parallel_tool_use`.
- `response_format` `json_schema` → `output_config.format`; `json_object` has no counterpart (refused).
- `stop` → `stop_sequences`; `max_completion_tokens` / `max_tokens` → `max_tokens` (Anthropic requires
  it: `DEFAULT_MAX_TOKENS` when the chat body has neither, plus the thinking budget when thinking is
  on); `user` / `safety_identifier` → `metadata.user_id`; `temperature` (Anthropic's range is 0..1,
  above is refused) and `top_p` pass on API version 2023-06-01 and are refused on 2026-10-21, which
  rejects sampling parameters.
- `reasoning_effort` → `thinking: {type: enabled, budget_tokens}`: `minimal`/`none` leave thinking off,
  `low` 1024 (Anthropic's minimum), `medium` 4096, `high` 16384, `xhigh` 32768, `max` 65536; the budget is capped
  at `max_tokens - 1` (thinking counts towards `max_tokens`, as reasoning counts towards
  `max_completion_tokens`), and a `max_tokens` that leaves less than the minimum is refused.
- Refused (`Untranslatable`, or listed in `dropped` when the target allows dropping): `n` > 1,
  `logprobs`, `top_logprobs`, `logit_bias`, `seed`, `presence_penalty` / `frequency_penalty` other than
  0, `audio` / `modalities` other than text, `prediction`, `web_search_options`, `store: true`,
  `verbosity`, `functions` (legacy), content parts other than text and images, a message `name`, and
  any field the codec does not know. Hints that do not change the answer are ignored:
  `stream_options` (Anthropic always reports usage), `prompt_cache_key`, `store: false`,
  `service_tier: auto`, `metadata`.

Answer (Messages → chat): text blocks join into `content`, `tool_use` blocks become `tool_calls`,
`thinking` text goes to `reasoning_content` (the field vLLM and DeepSeek use). Stop reasons:
`end_turn` / `stop_sequence` / `pause_turn` → `stop`, `max_tokens` / `model_context_window_exceeded`
→ `length`, `tool_use` → `tool_calls`, `refusal` → `content_filter`.

Usage: Anthropic counts `input_tokens` after the last cache breakpoint only; the whole prompt is
`input_tokens + cache_read_input_tokens + cache_creation_input_tokens`, with the writes split 5 m / 1 h
by the `cache_creation` object when present; reasoning tokens come from
`output_tokens_details.thinking_tokens` when the API reports them.

Credentials are not part of the call: the transport adds `x-api-key` (or a bearer token), like
`target.extra_headers`. Completions carry `created: 0` (codecs do not read the clock; the transport
stamps it).
"""

from __future__ import annotations

import datetime
import email.utils
from collections.abc import Mapping
from typing import Any

import orjson

from backends.hosted.base import (
    ProviderError,
    ProviderStreamError,
    ProviderTarget,
    ProviderUsage,
    RateLimitState,
    Untranslatable,
    UpstreamCall,
)
from backends.hosted.chat_in import Refusals, header
from backends.protocols import split_event
from backends.types import EventBuffer, usage_count

DEFAULT_VERSION = "2023-06-01"
SAMPLING_FREE_VERSION = "2026-10-21"  # from this version on, temperature / top_p / top_k are rejected
DEFAULT_MAX_TOKENS = 4096
MIN_THINKING_BUDGET = 1024
THINKING_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": 65536}
NO_THINKING = ("none", "minimal")

_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_KINDS = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "request_too_large": "invalid_request_error",
    "rate_limit_error": "rate_limit_error",
    "billing_error": "insufficient_quota",
    "timeout_error": "timeout_error",
    "api_error": "server_error",
    "overloaded_error": "overloaded_error",
}
_STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
_STATUS_KINDS |= {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}

# Fields handled below, and hints ignored because they do not change the answer.
_HANDLED = {
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "stop", "temperature", "top_p", "user", "safety_identifier",
    "reasoning_effort", "n", "logprobs", "top_logprobs", "logit_bias", "seed", "presence_penalty",
    "frequency_penalty", "store", "service_tier", "modalities",
}  # fmt: skip
_IGNORED = {"stream_options", "prompt_cache_key", "metadata"}
# Fields that are never refused whatever their value: a body of only these skips the refusal checks.
_NEVER_REFUSED = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "tools", "tool_choice",
     "parallel_tool_calls", "response_format", "stop", "user", "safety_identifier", "reasoning_effort"}
    | _IGNORED
)  # fmt: skip


def _image_block(url: str) -> dict[str, Any]:
    if url.startswith("data:"):
        prefix, _, data = url.partition(",")
        media_type = prefix[5:].split(";")[0] or "image/png"
        if ";base64" not in prefix:
            raise Untranslatable("image data URLs must be base64", "image_url")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _with_cache(block: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    if "cache_control" in part:
        block["cache_control"] = part["cache_control"]
    return block


def _content_blocks(content: Any, where: str, refusals: Refusals, images: bool = True) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise Untranslatable(f"{where}.content must be a string or an array of parts", f"{where}.content")
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            blocks.append(_with_cache({"type": "text", "text": part["text"]}, part))
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            blocks.append({"type": "text", "text": part["refusal"]})
        elif kind == "image_url" and images:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            if not isinstance(url, str):
                raise Untranslatable(f"{at}.image_url.url must be a string", f"{at}.image_url")
            if isinstance(image, Mapping) and image.get("detail") not in (None, "auto"):
                refusals.refuse(f"{at}.image_url.detail", "Anthropic has no image detail setting")
            blocks.append(_with_cache(_image_block(url), part))
        else:
            refusals.refuse(f"{at}.type", f"content part {kind!r} has no Anthropic counterpart here")
    return blocks


def _tool_result(message: Mapping[str, Any], where: str, refusals: Refusals) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise Untranslatable(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    if isinstance(content, str):
        block["content"] = content
    else:
        parts = _content_blocks(content, where, refusals)
        block["content"] = [{k: v for k, v in p.items() if k != "cache_control"} for p in parts]
        marks = [p["cache_control"] for p in parts if "cache_control" in p]
        if marks:
            block["cache_control"] = marks[-1]
    if "cache_control" in message:
        block["cache_control"] = message["cache_control"]
    return block


def _tool_use(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise Untranslatable(f"{where} must be a function call with a name", where)
    arguments = function.get("arguments") or "{}"
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        raise Untranslatable(f"{where}.function.arguments is not JSON", f"{where}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise Untranslatable(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"type": "tool_use", "id": str(call.get("id") or ""), "name": function["name"], "input": parsed}


def _messages(chat: Mapping[str, Any], refusals: Refusals) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("messages must be a non-empty array", "messages")
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if type(message) is not dict and not isinstance(message, Mapping):  # dict first: the ABC check is slow
            raise Untranslatable(f"{where} must be an object", where)
        role = message.get("role")
        if "name" in message:
            refusals.refuse(f"{where}.name", "Anthropic messages have no participant names")
        if role in ("system", "developer"):
            blocks = _content_blocks(message.get("content"), where, refusals, images=False)
            if blocks and "cache_control" in message:
                blocks[-1]["cache_control"] = message["cache_control"]
            system.extend(blocks)
        elif role == "user":
            blocks = _content_blocks(message.get("content"), where, refusals)
            if blocks and "cache_control" in message:
                blocks[-1]["cache_control"] = message["cache_control"]
            add("user", blocks)
        elif role == "assistant":
            blocks = _content_blocks(message.get("content"), where, refusals, images=False)
            for k, call in enumerate(message.get("tool_calls") or ()):
                blocks.append(_tool_use(call, f"{where}.tool_calls[{k}]"))
            if blocks and "cache_control" in message:
                blocks[-1]["cache_control"] = message["cache_control"]
            add("assistant", blocks)
        elif role == "tool":
            add("user", [_tool_result(message, where, refusals)])
        else:
            raise Untranslatable(f"{where}.role {role!r} has no Anthropic counterpart", f"{where}.role")
    if not turns:
        raise Untranslatable("messages hold no user or assistant content", "messages")
    return system, turns


def _tools(chat: Mapping[str, Any], refusals: Refusals) -> list[dict[str, Any]] | None:
    tools = chat.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Untranslatable("tools must be an array", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            refusals.refuse(f"tools[{i}].type", "only function tools translate")
            continue
        converted: dict[str, Any] = {
            "name": function.get("name"),
            "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
        }
        if function.get("description"):
            converted["description"] = function["description"]
        if function.get("strict") is True:
            converted["strict"] = True
        if "cache_control" in tool:
            converted["cache_control"] = tool["cache_control"]
        out.append(converted)
    return out


def _tool_choice(chat: Mapping[str, Any]) -> dict[str, Any] | None:
    choice = chat.get("tool_choice")
    parallel = chat.get("parallel_tool_calls")
    out: dict[str, Any] | None
    if choice is None:
        out = None
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "none":
        out = {"type": "none"}
    elif choice == "required":
        out = {"type": "any"}
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        out = {"type": "tool", "name": choice["function"].get("name")}
    else:
        raise Untranslatable(f"tool_choice {choice!r} has no Anthropic counterpart", "tool_choice")
    if parallel is False:
        out = out or {"type": "auto"}
        if out["type"] != "none":
            out["disable_parallel_tool_use"] = True
    return out


def _refuse_fields(chat: Mapping[str, Any], refusals: Refusals, version: str) -> None:
    if _NEVER_REFUSED.issuperset(chat):  # the usual body: nothing below applies
        return
    for name in chat:
        if name not in _HANDLED and name not in _IGNORED:
            refusals.refuse(name, "not a field the Anthropic codec translates")
    if chat.get("n") not in (None, 1):
        refusals.refuse("n", "Anthropic returns one choice")
    for name in ("logprobs", "top_logprobs", "logit_bias"):
        if chat.get(name):
            refusals.refuse(name, "Anthropic has no counterpart")
    if chat.get("seed") is not None:
        refusals.refuse("seed", "Anthropic has no counterpart")
    for name in ("presence_penalty", "frequency_penalty"):
        if chat.get(name) not in (None, 0, 0.0):
            refusals.refuse(name, "Anthropic has no counterpart")
    if chat.get("store") is True:
        refusals.refuse("store", "Anthropic does not store completions")
    if chat.get("service_tier") not in (None, "auto"):
        refusals.refuse("service_tier", "only 'auto' translates")
    if chat.get("modalities") not in (None, ["text"]):
        refusals.refuse("modalities", "Anthropic answers text only")
    sampling_free = version >= SAMPLING_FREE_VERSION
    temperature = chat.get("temperature")
    if temperature is not None and (sampling_free or not 0 <= float(temperature) <= 1):
        refusals.refuse("temperature", "Anthropic takes 0..1, and no sampling parameters from API 2026-10-21")
    if chat.get("top_p") is not None and sampling_free:
        refusals.refuse("top_p", "Anthropic API 2026-10-21 takes no sampling parameters")


def _reasoning(chat: Mapping[str, Any], max_tokens: int, refusals: Refusals) -> dict[str, Any] | None:
    effort = chat.get("reasoning_effort")
    if effort is None or effort in NO_THINKING:
        return None
    if effort not in THINKING_BUDGETS:
        raise Untranslatable(f"reasoning_effort {effort!r} is not a known level", "reasoning_effort")
    budget = min(THINKING_BUDGETS[effort], max_tokens - 1)
    if budget < MIN_THINKING_BUDGET:
        refusals.refuse("reasoning_effort", f"max_tokens leaves less than {MIN_THINKING_BUDGET} tokens of thinking")
        return None
    return {"type": "enabled", "budget_tokens": budget}


def _response_format(fmt: Any, body: dict[str, Any], refusals: Refusals) -> None:
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, Mapping) or not isinstance(schema.get("schema"), Mapping):
            raise Untranslatable("response_format.json_schema.schema must be an object", "response_format")
        body["output_config"] = {"format": {"type": "json_schema", "schema": schema["schema"]}}
    elif isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        refusals.refuse("response_format", f"{fmt.get('type')!r} has no Anthropic counterpart (json_schema does)")


def messages_body(chat: Mapping[str, Any], target: ProviderTarget) -> tuple[dict[str, Any], list[str]]:
    """The Messages request body for a chat body, and the fields dropped (only when the target allows)."""
    refusals = Refusals(target.allow_drop)
    version = target.api_version or DEFAULT_VERSION
    _refuse_fields(chat, refusals, version)
    system, turns = _messages(chat, refusals)
    limit = chat.get("max_completion_tokens") or chat.get("max_tokens")
    if not limit:  # Anthropic requires a limit: the default answer's room, plus the thinking budget's
        limit = DEFAULT_MAX_TOKENS + THINKING_BUDGETS.get(str(chat.get("reasoning_effort")), 0)
    body: dict[str, Any] = {"model": target.model, "max_tokens": int(limit), "messages": turns}
    if system:
        body["system"] = system
    tools = _tools(chat, refusals)
    if tools:
        body["tools"] = tools
    choice = _tool_choice(chat)
    if choice is not None and tools:
        body["tool_choice"] = choice
    stop = chat.get("stop")
    if stop:
        body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if "temperature" in chat and "temperature" not in refusals.dropped and chat["temperature"] is not None:
        body["temperature"] = chat["temperature"]
    if "top_p" in chat and "top_p" not in refusals.dropped and chat["top_p"] is not None:
        body["top_p"] = chat["top_p"]
    user = chat.get("safety_identifier") or chat.get("user")
    if isinstance(user, str) and user:
        body["metadata"] = {"user_id": user}
    thinking = _reasoning(chat, int(limit), refusals)
    if thinking is not None:
        body["thinking"] = thinking
        if "temperature" in body:
            refusals.refuse("temperature", "Anthropic takes no temperature with thinking on")
            body.pop("temperature", None)
    fmt = chat.get("response_format")
    if fmt is not None:
        _response_format(fmt, body, refusals)
    if chat.get("stream"):
        body["stream"] = True
    return body, refusals.dropped


def usage_from(raw: Mapping[str, Any] | None) -> ProviderUsage:
    """ProviderUsage from a Messages `usage` object (the whole prompt = uncached + read + written)."""
    if not raw:
        return ProviderUsage()
    uncached = usage_count(raw.get("input_tokens"))
    read = usage_count(raw.get("cache_read_input_tokens"))
    written = usage_count(raw.get("cache_creation_input_tokens"))
    split = raw.get("cache_creation")
    if split is not None and isinstance(split, Mapping):
        write_1h = usage_count(split.get("ephemeral_1h_input_tokens"))
        write_5m = usage_count(split.get("ephemeral_5m_input_tokens"))
    else:
        write_1h, write_5m = 0, written
    details = raw.get("output_tokens_details")
    reasoning = (
        usage_count(details.get("thinking_tokens")) if details is not None and isinstance(details, Mapping) else 0
    )
    return ProviderUsage(
        input_tokens=uncached + read + write_5m + write_1h,
        output_tokens=usage_count(raw.get("output_tokens")),
        cache_read_tokens=read,
        cache_write_tokens=write_5m,
        cache_write_1h_tokens=write_1h,
        reasoning_tokens=reasoning,
    )


def _completion_message(content: list[Any]) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if type(block) is dict or isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _chunk(message_id: str, model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": message_id,
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


class MessagesStreamDecoder:
    """Anthropic's event stream → chat.completion.chunk dicts (text, tool-call and thinking deltas, usage last)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.message_id = ""
        self._buffer = EventBuffer(crlf=True)  # the provider's stream is input: bounded, read once
        self._usage: dict[str, Any] = {}
        self._tool_index: dict[int, int] = {}  # content block index -> tool call index
        self._stopped = False
        self._finish: str | None = None

    @property
    def usage(self) -> ProviderUsage | None:
        return usage_from(self._usage) if self._usage else None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for raw in self._buffer.feed(data):
            _name, payload = split_event(raw)
            if payload is None:
                continue
            out.extend(self._event(orjson.loads(payload)))
        return out

    def close(self) -> list[dict[str, Any]]:
        if not self._stopped:
            raise ProviderStreamError(
                ProviderError(502, "server_error", "Anthropic stream ended before message_stop", True)
            )
        return []

    def _event(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.message_id = str(message.get("id") or "")
            self.model = str(message.get("model") or self.model)
            self._usage = dict(message.get("usage") or {})
            return [_chunk(self.message_id, self.model, {"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self._tool_index.setdefault(int(event.get("index", 0)), len(self._tool_index))
                call = {"index": index, "id": block.get("id"), "type": "function"}
                call["function"] = {"name": block.get("name"), "arguments": ""}
                return [_chunk(self.message_id, self.model, {"tool_calls": [call]})]
            if block.get("type") == "text" and block.get("text"):
                return [_chunk(self.message_id, self.model, {"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                return [_chunk(self.message_id, self.model, {"content": delta.get("text", "")})]
            if dtype == "thinking_delta":
                return [_chunk(self.message_id, self.model, {"reasoning_content": delta.get("thinking", "")})]
            if dtype == "input_json_delta":
                index = self._tool_index.get(int(event.get("index", 0)), 0)
                call = {"index": index, "function": {"arguments": delta.get("partial_json", "")}}
                return [_chunk(self.message_id, self.model, {"tool_calls": [call]})]
            return []  # signature_delta, citations_delta: no chat counterpart
        if kind == "message_delta":
            self._usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            reason = (event.get("delta") or {}).get("stop_reason")
            if reason:
                self._finish = _FINISH.get(reason, "stop")
                return [_chunk(self.message_id, self.model, {}, self._finish)]
            return []
        if kind == "message_stop":
            self._stopped = True
            final = _chunk(self.message_id, self.model, {})
            final["choices"] = []
            final["usage"] = usage_from(self._usage).chat_usage()
            return [final]
        if kind == "error":
            error = event.get("error") or {}
            raise ProviderStreamError(
                _error_from(str(error.get("type") or "api_error"), str(error.get("message") or ""), None)
            )
        return []  # ping and events added later


def _error_from(
    anthropic_type: str, message: str, status: int | None, retry_after: float | None = None
) -> ProviderError:
    kind = _KINDS.get(anthropic_type) or (
        _STATUS_KINDS.get(status or 0) or ("server_error" if (status or 500) >= 500 else "invalid_request_error")
    )
    if anthropic_type == "overloaded_error" or status == 529:
        status = 503
    elif status is None:
        status = {"rate_limit_error": 429, "invalid_request_error": 400}.get(anthropic_type, 500)
    retryable = status in (408, 429) or status >= 500
    return ProviderError(status=status, kind=kind, message=message, retryable=retryable, retry_after_s=retry_after)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = header(headers, "retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _reset_s(
    resets: Mapping[str, float], extra: Mapping[str, str], remaining: str, retry: float | None
) -> float | None:
    """`retry` when the provider sent one; else the latest reset among exhausted limits; else the soonest."""
    if retry is not None:
        return retry
    exhausted = [s for kind, s in resets.items() if extra.get(remaining.format(kind)) == "0"]
    if exhausted:
        return max(exhausted)
    return min(resets.values()) if resets else None


class AnthropicCodec:
    """The `ProviderCodec` for Anthropic's Messages API."""

    name = "anthropic"

    def request(self, chat: Mapping[str, Any], target: ProviderTarget) -> UpstreamCall:
        body, dropped = messages_body(chat, target)
        headers = [
            ("content-type", "application/json"),
            ("anthropic-version", target.api_version or DEFAULT_VERSION),
        ]
        if body.get("stream"):
            headers.append(("accept", "text/event-stream"))
        if target.beta:
            headers.append(("anthropic-beta", ",".join(target.beta)))
        headers.extend(target.extra_headers.items())
        return UpstreamCall(
            "POST", "/v1/messages", tuple(headers), orjson.dumps(body), bool(body.get("stream")), tuple(dropped)
        )

    def answer(self, body: bytes, target: ProviderTarget) -> tuple[dict[str, Any], ProviderUsage]:
        message = orjson.loads(body)
        usage = usage_from(message.get("usage"))
        completion = {
            "id": message.get("id"),
            "object": "chat.completion",
            "created": 0,
            "model": message.get("model") or target.model,
            "choices": [
                {
                    "index": 0,
                    "message": _completion_message(message.get("content") or []),
                    "logprobs": None,
                    "finish_reason": _FINISH.get(message.get("stop_reason") or "end_turn", "stop"),
                }
            ],
            "usage": usage.chat_usage(),
        }
        return completion, usage

    def stream(self, target: ProviderTarget) -> MessagesStreamDecoder:
        return MessagesStreamDecoder(target.model)

    def error(self, status: int, headers: Mapping[str, str], body: bytes) -> ProviderError:
        try:
            parsed = orjson.loads(body)
            error = parsed.get("error") if isinstance(parsed, Mapping) else None
        except orjson.JSONDecodeError:
            error = None
        if isinstance(error, Mapping):
            return _error_from(
                str(error.get("type") or ""), str(error.get("message") or ""), status, _retry_after(headers)
            )
        return _error_from("", body.decode("utf-8", "replace")[:500] or f"HTTP {status}", status, _retry_after(headers))

    def rate_limits(self, headers: Mapping[str, str]) -> RateLimitState:
        """`anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{remaining,reset}` and `retry-after`.

        Resets are RFC 3339 instants; they become seconds against the answer's own `Date` header (the
        codec reads no clock), else they stay in `extra` only. `reset_s` is `retry-after` when sent, else
        the latest reset among exhausted limits (all must reset before a call fits), else the soonest.
        """
        state = RateLimitState(
            requests_remaining=_int(header(headers, "anthropic-ratelimit-requests-remaining")),
            tokens_remaining=_int(header(headers, "anthropic-ratelimit-tokens-remaining")),
            input_tokens_remaining=_int(header(headers, "anthropic-ratelimit-input-tokens-remaining")),
            output_tokens_remaining=_int(header(headers, "anthropic-ratelimit-output-tokens-remaining")),
        )
        now: datetime.datetime | None = None
        date = header(headers, "date")
        if date:
            try:
                now = email.utils.parsedate_to_datetime(date)
            except (TypeError, ValueError):
                now = None
        resets: dict[str, float] = {}
        for name, value in headers.items():
            lower = name.lower()
            if not lower.startswith("anthropic-ratelimit-"):
                continue
            state.extra[lower] = value
            if lower.endswith("-reset") and now is not None:
                try:
                    instant = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
                except ValueError:
                    continue
                resets[lower.removesuffix("-reset")] = max((instant - now).total_seconds(), 0.0)
        state.reset_s = _reset_s(resets, state.extra, "{}-remaining", _retry_after(headers))
        return state
