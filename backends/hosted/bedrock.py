"""Amazon Bedrock Converse / ConverseStream ⇄ chat completions.

Request (chat → Converse): `system` / `developer` messages become `system` text blocks (hoisted,
in order: Converse has no system turn inside the conversation); user and assistant content parts
become `text` / `image` blocks (images only as `data:` URLs → bytes, or `s3://` URIs → `s3Location`:
Bedrock fetches nothing from the web, so an `https` image is refused); assistant `tool_calls` become
`toolUse` blocks and `tool` messages `toolResult` blocks in a user turn (consecutive turns of one
role are merged, as Converse wants them alternating); `tools` → `toolConfig.tools[].toolSpec`,
`tool_choice` `auto` / `required` / a named function → `auto` / `any` / `tool` (`none` drops the
tools when no turn uses them, else is refused); `response_format` `json_schema` →
`outputConfig.textFormat`; `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `stop` →
`inferenceConfig`; `user` / `metadata` → `requestMetadata`; inline `file` parts (data URLs of pdf,
csv, doc(x), xls(x), html, txt, md) → `document` blocks. `cache_control` on a content part, a
message or a tool puts a `cachePoint` (with its `ttl` when `1h`) right after it.

`reasoning_effort` → Anthropic models' extended thinking (`additionalModelRequestFields.thinking`):
minimal 1024, low 2048, medium 8192, high 24576 budget tokens, `none` none; the budget stays under
the request's token limit (chat's limit counts reasoning too), and a limit too small for the 1024
minimum is refused. Other model families have no budget knob in Converse: refused. With thinking
on, Claude wants a tool loop's assistant turn back starting with the thinking block it signed: the
signature rides in the first tool call's id (`pack_call_id`) and the text in the turn's
`reasoning_content`; a tool loop whose turn comes back without them cannot think (refused, or
dropped when allowed).

Refused (`Untranslatable`, or listed as dropped when the target allows): `n` > 1, `logprobs`,
`top_logprobs`, `seed`, `logit_bias`, non-zero penalties, `parallel_tool_calls: false`,
`response_format: json_object`, audio parts, uploaded `file_id` files and other document types,
web image URLs and any field this codec does not know.

Answer: text blocks join into `content`, `toolUse` into `tool_calls`, `reasoningContent` into
`reasoning_content`; `stopReason` → `finish_reason`. Usage: Converse's `inputTokens` excludes cache
reads and writes (reported as `cacheReadInputTokens` / `cacheWriteInputTokens`, the 1 h share in
`cacheDetails`), so the whole prompt is their sum. The stream is the eventstream framing
(`backends.hosted.aws`); its exception frames raise `ProviderStreamError`. The codec is
pure: ids are derived from the answer's bytes and `created` is 0 (the transport stamps both).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson

from backends.hosted.aws import EventMessage, EventStreamDecoder, EventStreamError
from backends.hosted.base import (
    ProviderError,
    ProviderStreamError,
    ProviderTarget,
    ProviderUsage,
    RateLimitState,
    Untranslatable,
    UpstreamCall,
)
from backends.hosted.chat_in import (
    Refusals,
    Turns,
    content_parts,
    image_url,
    pack_signed_id,
    tool_arguments,
    tool_function,
    unpack_signed_id,
)
from backends.protocols import ProtocolError
from backends.types import usage_count

__all__ = ["THINKING_BUDGETS", "BedrockCodec", "BedrockStreamDecoder", "endpoint_url", "pack_call_id", "unpack_call_id"]

THINKING_BUDGETS: dict[str, int] = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 24576}
_MIN_THINKING = 1024

_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
    "malformed_model_output": "stop",
    "malformed_tool_use": "stop",
}
_IMAGE_FORMATS = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/jpg": "jpeg",
    "image/gif": "gif",
    "image/webp": "webp",
}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,(?P<data>.*)$", re.S)

# exception name (x-amzn-ErrorType's first part) → (answer status, OpenAI-style kind, worth a fallback)
_ERRORS: dict[str, tuple[int, str, bool]] = {
    "ValidationException": (400, "invalid_request_error", False),
    "ConflictException": (400, "invalid_request_error", False),
    "ServiceQuotaExceededException": (429, "rate_limit_error", True),
    "AccessDeniedException": (403, "permission_error", False),
    "UnrecognizedClientException": (401, "authentication_error", False),
    "InvalidSignatureException": (401, "authentication_error", False),
    "IncompleteSignatureException": (401, "authentication_error", False),
    "MissingAuthenticationTokenException": (401, "authentication_error", False),
    "ExpiredTokenException": (401, "authentication_error", False),
    "ResourceNotFoundException": (404, "not_found_error", False),
    "ModelTimeoutException": (504, "timeout_error", True),
    "ThrottlingException": (429, "rate_limit_error", True),
    "ModelNotReadyException": (503, "overloaded_error", True),
    "ModelErrorException": (502, "api_error", True),
    "ModelStreamErrorException": (502, "api_error", True),
    "InternalServerException": (500, "api_error", True),
    "ServiceUnavailableException": (503, "overloaded_error", True),
}

# Chat fields this codec translates (or that carry nothing for the provider: `model`, `stream*`).
_KNOWN = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "stream",
    "stream_options",
    "reasoning_effort",
    "user",
    "metadata",
    "n",
    "logprobs",
    "top_logprobs",
    "seed",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "store",
}


def _cache_point(marker: Any, where: str) -> dict[str, Any]:
    if not isinstance(marker, Mapping) or marker.get("type", "ephemeral") != "ephemeral":
        raise ProtocolError(f"{where}.cache_control must be {{'type': 'ephemeral'}}", f"{where}.cache_control")
    point: dict[str, Any] = {"type": "default"}
    ttl = marker.get("ttl")
    if ttl is not None:
        if ttl not in ("5m", "1h"):
            raise ProtocolError(f"{where}.cache_control.ttl must be '5m' or '1h'", f"{where}.cache_control.ttl")
        point["ttl"] = ttl
    return {"cachePoint": point}


def _image_block(url: Any, where: str, refusals: Refusals) -> dict[str, Any] | None:
    if not isinstance(url, str):
        raise ProtocolError(f"{where}.image_url.url must be a string", f"{where}.image_url.url")
    if url.startswith("s3://"):
        ext = url.rsplit(".", 1)[-1].lower()
        fmt = {"jpg": "jpeg"}.get(ext, ext)
        if fmt not in _IMAGE_FORMATS.values():
            raise ProtocolError(f"{where}: cannot tell the image format of {url!r}", f"{where}.image_url.url")
        return {"image": {"format": fmt, "source": {"s3Location": {"uri": url}}}}
    match = _DATA_URL.match(url)
    if match is None:
        refusals.refuse(f"{where}.image_url", "Bedrock takes images as bytes or s3:// URIs, not web URLs")
        return None
    mime = (match.group("mime") or "").lower()
    image_format = _IMAGE_FORMATS.get(mime)
    if image_format is None:
        raise ProtocolError(f"{where}: image type {mime!r} is not png, jpeg, gif or webp", f"{where}.image_url.url")
    data = match.group("data").strip()
    try:
        base64.b64decode(data, validate=True)
    except ValueError as exc:
        raise ProtocolError(f"{where}: the data URL is not valid base64", f"{where}.image_url.url") from exc
    return {"image": {"format": image_format, "source": {"bytes": data}}}


_DOCUMENT_FORMATS = {
    "application/pdf": "pdf",
    "text/csv": "csv",
    "application/msword": "doc",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": "docx",
    "application/vnd.ms-excel": "xls",
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": "xlsx",
    "text/html": "html",
    "text/plain": "txt",
    "text/markdown": "md",
}
_DOCUMENT_NAME = re.compile(r"[^A-Za-z0-9\-()\[\] ]+")


def _document_block(file: Any, where: str, refusals: Refusals) -> dict[str, Any] | None:
    """Chat's inline `file` part (a data URL) → a `document` block; an uploaded `file_id` is refused."""
    data = file.get("file_data") if isinstance(file, Mapping) else None
    if not isinstance(data, str):
        refusals.refuse(f"{where}.file", "only inline file_data (a data URL) can be sent")
        return None
    match = _DATA_URL.match(data)
    document_format = _DOCUMENT_FORMATS.get((match.group("mime") or "").lower()) if match else None
    if match is None or document_format is None:
        refusals.refuse(f"{where}.file", "Bedrock takes pdf, csv, doc(x), xls(x), html, txt and md documents")
        return None
    stem = str(file.get("filename") or "document").rsplit(".", 1)[0]
    name = " ".join(_DOCUMENT_NAME.sub(" ", stem).split()) or "document"  # Bedrock's name alphabet
    return {"document": {"format": document_format, "name": name, "source": {"bytes": match["data"].strip()}}}


def _content_blocks(content: Any, where: str, refusals: Refusals, *, images: bool = True) -> list[dict[str, Any]]:
    """A chat message's content as Converse blocks (text, image, document, cachePoint)."""

    def convert(kind: Any, part: Mapping[str, Any], at: str) -> list[dict[str, Any]] | None:
        if kind == "image_url" and images:
            block = _image_block(image_url(part), at, refusals)
        elif kind == "file" and images:
            block = _document_block(part.get("file"), at, refusals)
        else:
            return None
        return [block] if block is not None else []

    return content_parts(content, where, refusals, convert, cache_marker=_cache_point)


def _tool_result_blocks(content: Any, where: str, refusals: Refusals) -> list[dict[str, Any]]:
    blocks = [b for b in _content_blocks(content, where, refusals) if "cachePoint" not in b]
    return blocks or [{"text": ""}]


def _messages(chat_messages: Any, refusals: Refusals) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    """(system blocks, Converse messages, whether any turn holds tool blocks)."""
    if not isinstance(chat_messages, list) or not chat_messages:
        raise ProtocolError("messages must be a non-empty array", "messages")
    system: list[dict[str, Any]] = []
    turns = Turns("content")
    uses_tools = False

    for i, message in enumerate(chat_messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ProtocolError(f"{where} must be an object", where)
        role = message.get("role")
        if role in ("system", "developer"):
            blocks = _content_blocks(message.get("content"), where, refusals, images=False)
            if message.get("cache_control") is not None and blocks:
                blocks.append(_cache_point(message["cache_control"], where))
            system.extend(blocks)
            continue
        if role == "user":
            blocks = _content_blocks(message.get("content"), where, refusals)
        elif role == "assistant":
            blocks = _content_blocks(message.get("content"), where, refusals, images=False)
            signature = None
            for k, call in enumerate(message.get("tool_calls") or []):
                at = f"{where}.tool_calls[{k}]"
                function = tool_function(call, at)
                if not isinstance(call.get("id"), str):
                    raise ProtocolError(f"{at}.id must be a string", f"{at}.id")
                call_id, carried = unpack_call_id(call["id"])
                signature = signature or carried
                blocks.append(
                    {
                        "toolUse": {
                            "toolUseId": call_id,
                            "name": function["name"],
                            "input": tool_arguments(function.get("arguments"), at),
                        }
                    }
                )
                uses_tools = True
            reasoning = message.get("reasoning_content")
            if signature and isinstance(reasoning, str) and reasoning:
                # the thinking block the model signed, rebuilt: a tool loop's turn must start with it
                blocks.insert(0, {"reasoningContent": {"reasoningText": {"text": reasoning, "signature": signature}}})
        elif role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ProtocolError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            result = {
                "toolResult": {
                    "toolUseId": unpack_call_id(message["tool_call_id"])[0],
                    "content": _tool_result_blocks(message.get("content"), where, refusals),
                }
            }
            blocks = [result]
            uses_tools = True
            role = "user"
        else:
            raise ProtocolError(f"{where}.role {role!r} is not supported", f"{where}.role")
        if message.get("cache_control") is not None and blocks:
            blocks.append(_cache_point(message["cache_control"], where))
        turns.add(str(role), blocks)
    if not turns.turns:
        raise ProtocolError("messages holds no user or assistant content", "messages")
    return system, turns.turns, uses_tools


def _tools(chat: Mapping[str, Any], uses_tools: bool, refusals: Refusals) -> dict[str, Any] | None:
    tools = chat.get("tools")
    choice = chat.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ProtocolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ProtocolError("tools must be an array", "tools")
    if choice == "none":
        if uses_tools:
            refusals.refuse("tool_choice", "'none' cannot be said while the conversation holds tool calls")
        else:
            return None
    specs: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            refusals.refuse(f"{at}.type", "only function tools are supported")
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ProtocolError(f"{at}.function.name must be a string", f"{at}.function.name")
        spec: dict[str, Any] = {
            "name": function["name"],
            "inputSchema": {"json": function.get("parameters") or {"type": "object", "properties": {}}},
        }
        if function.get("description"):
            spec["description"] = function["description"]
        if function.get("strict") is not None:
            spec["strict"] = bool(function["strict"])
        specs.append({"toolSpec": spec})
        if tool.get("cache_control") is not None:
            specs.append(_cache_point(tool["cache_control"], at))
    config: dict[str, Any] = {"tools": specs}
    if choice in (None, "auto", "none"):
        pass
    elif choice == "required":
        config["toolChoice"] = {"any": {}}
    elif isinstance(choice, Mapping) and isinstance((choice.get("function") or {}).get("name"), str):
        config["toolChoice"] = {"tool": {"name": choice["function"]["name"]}}
    else:
        raise ProtocolError("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return config


def _token_limit(chat: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = chat.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProtocolError(f"{name} must be a positive integer", name)
            return value
    return None


def _loop_lacks_thinking(turns: list[dict[str, Any]]) -> bool:
    """Whether the conversation ends in tool results answering an assistant turn without its thinking
    block (Claude with thinking on refuses that turn: it must start with the block it signed)."""
    if len(turns) < 2 or turns[-1]["role"] != "user" or turns[-2]["role"] != "assistant":
        return False
    if not any("toolResult" in block for block in turns[-1]["content"]):
        return False
    return "reasoningContent" not in turns[-2]["content"][0]


_SIGNED = "bts-"


def pack_call_id(call_id: str, signature: str | None) -> str:
    """The first call's id of a tool loop's assistant turn carries the turn's thinking signature: Claude
    with thinking on wants that turn back starting with the thinking block it signed."""
    return pack_signed_id(call_id, signature, _SIGNED)


def unpack_call_id(value: str) -> tuple[str, str | None]:
    """(the call's own id, the thinking signature or None)"""
    return unpack_signed_id(value, _SIGNED)


def _is_anthropic(model: str) -> bool:
    return "anthropic." in model or (model.startswith("arn:") and "anthropic" in model)


def endpoint_url(region: str) -> str:
    """Bedrock Runtime's public endpoint in `region` (a pool's default base URL; VPC endpoints differ)."""
    return f"https://bedrock-runtime.{region}.amazonaws.com"


class BedrockCodec:
    """Chat completions ⇄ Converse (`/model/{id}/converse`) and ConverseStream (`/converse-stream`)."""

    name = "bedrock"

    def request(self, chat: Mapping[str, Any], target: ProviderTarget) -> UpstreamCall:
        refusals = Refusals(target.allow_drop, "Bedrock Converse")
        for key in chat:
            if key not in _KNOWN:
                refusals.refuse(key, "unknown field")
        if chat.get("n") not in (None, 1):
            refusals.refuse("n", "one choice per call")
        if chat.get("logprobs"):
            refusals.refuse("logprobs", "no log probabilities")
        if chat.get("top_logprobs") is not None:
            refusals.refuse("top_logprobs", "no log probabilities")
        if chat.get("seed") is not None:
            refusals.refuse("seed", "no sampling seed")
        if chat.get("logit_bias"):
            refusals.refuse("logit_bias", "no logit bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if chat.get(name):
                refusals.refuse(name, "no penalties")
        if chat.get("parallel_tool_calls") is False:
            refusals.refuse("parallel_tool_calls", "parallel tool calls cannot be turned off")
        if chat.get("store"):
            refusals.refuse("store", "nothing is stored")

        system, messages, uses_tools = _messages(chat.get("messages"), refusals)
        body: dict[str, Any] = {"messages": messages}
        if system:
            body["system"] = system
        inference: dict[str, Any] = {}
        limit = _token_limit(chat)
        if limit is not None:
            inference["maxTokens"] = limit
        for name, key in (("temperature", "temperature"), ("top_p", "topP")):
            value = chat.get(name)
            if value is not None:
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise ProtocolError(f"{name} must be a number", name)
                inference[key] = value
        stop = chat.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ProtocolError("stop must be a string or an array of strings", "stop")
            if stops:
                inference["stopSequences"] = stops
        if inference:
            body["inferenceConfig"] = inference
        tool_config = _tools(chat, uses_tools, refusals)
        if tool_config is not None:
            body["toolConfig"] = tool_config
        elif uses_tools:
            raise ProtocolError("the conversation holds tool calls: Bedrock needs `tools` beside them", "tools")

        response_format = chat.get("response_format")
        if isinstance(response_format, Mapping):
            kind = response_format.get("type")
            if kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
                    raise ProtocolError("response_format.json_schema.schema must be an object", "response_format")
                definition: dict[str, Any] = {"schema": orjson.dumps(spec["schema"]).decode()}
                if spec.get("name"):
                    definition["name"] = spec["name"]
                if spec.get("description"):
                    definition["description"] = spec["description"]
                body["outputConfig"] = {"textFormat": {"type": "json_schema", "structure": {"jsonSchema": definition}}}
            elif kind == "json_object":
                refusals.refuse("response_format", "JSON mode without a schema")
            elif kind != "text":
                raise ProtocolError(f"response_format.type {kind!r} is not supported", "response_format.type")

        effort = chat.get("reasoning_effort")
        if effort is not None and effort != "none":
            if effort not in THINKING_BUDGETS:
                raise ProtocolError(
                    f"reasoning_effort must be one of none, {', '.join(THINKING_BUDGETS)}", "reasoning_effort"
                )
            if not _is_anthropic(target.model):
                refusals.refuse("reasoning_effort", f"no thinking budget for {target.model}")
            elif _loop_lacks_thinking(messages):
                refusals.refuse(
                    "reasoning_effort",
                    "a tool loop's assistant turn must start with its signed thinking block; send the "
                    "turn's reasoning_content and tool call ids back as they came",
                )
            else:
                budget = THINKING_BUDGETS[effort]
                if limit is not None:
                    budget = min(budget, limit - 1)
                if budget < _MIN_THINKING:
                    raise Untranslatable(
                        f"reasoning_effort needs a token limit over {_MIN_THINKING} (the smallest thinking budget)",
                        "reasoning_effort",
                    )
                body["additionalModelRequestFields"] = {"thinking": {"type": "enabled", "budget_tokens": budget}}

        metadata: dict[str, str] = {}
        if isinstance(chat.get("metadata"), Mapping):
            metadata.update({str(k): str(v) for k, v in chat["metadata"].items()})
        if isinstance(chat.get("user"), str):
            metadata["user"] = chat["user"]
        if metadata:
            body["requestMetadata"] = metadata

        stream = bool(chat.get("stream"))
        path = f"/model/{quote(target.model, safe='')}/{'converse-stream' if stream else 'converse'}"
        headers = [("content-type", "application/json"), ("accept", "application/json")]
        if stream:
            headers[1] = ("accept", "application/vnd.amazon.eventstream")
        headers.extend((k.lower(), v) for k, v in target.extra_headers.items())
        return UpstreamCall(
            method="POST",
            path=path,
            headers=tuple(headers),
            body=orjson.dumps(body),
            stream=stream,
            dropped=tuple(refusals.dropped),
        )

    def answer(self, body: bytes, target: ProviderTarget) -> tuple[dict[str, Any], ProviderUsage]:
        data = orjson.loads(body)
        message = (data.get("output") or {}).get("message") or {}
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        signature: str | None = None
        for block in message.get("content") or []:
            if "text" in block:
                texts.append(block["text"])
            elif "toolUse" in block:
                use = block["toolUse"]
                calls.append(
                    {
                        "id": use.get("toolUseId", f"call_{len(calls)}"),
                        "type": "function",
                        "function": {"name": use.get("name", ""), "arguments": orjson.dumps(use.get("input")).decode()},
                    }
                )
            elif "reasoningContent" in block:
                text_block = block["reasoningContent"].get("reasoningText") or {}
                if text_block.get("text"):
                    reasoning.append(text_block["text"])
                signature = signature or text_block.get("signature")
        chat_message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            calls[0]["id"] = pack_call_id(calls[0]["id"], signature)
            chat_message["tool_calls"] = calls
        if reasoning:
            chat_message["reasoning_content"] = "".join(reasoning)
        usage = usage_from(data.get("usage") or {}, reasoning_text="".join(reasoning))
        completion = {
            "id": "chatcmpl-" + hashlib.blake2b(body, digest_size=12).hexdigest(),
            "object": "chat.completion",
            "created": 0,
            "model": target.model,
            "choices": [
                {
                    "index": 0,
                    "message": chat_message,
                    "finish_reason": _FINISH.get(str(data.get("stopReason")), "stop"),
                    "logprobs": None,
                }
            ],
            "usage": usage.chat_usage(),
        }
        return completion, usage

    def stream(self, target: ProviderTarget) -> BedrockStreamDecoder:
        return BedrockStreamDecoder(target.model)

    def error(self, status: int, headers: Mapping[str, str], body: bytes) -> ProviderError:
        lowered = {k.lower(): v for k, v in headers.items()}
        name = lowered.get("x-amzn-errortype", "").split(":", 1)[0]
        message = ""
        try:
            data = orjson.loads(body) if body else {}
            if isinstance(data, Mapping):
                message = str(data.get("message") or data.get("Message") or "")
                if not name and isinstance(data.get("__type"), str):
                    name = data["__type"].rsplit("#", 1)[-1]
        except orjson.JSONDecodeError:
            message = body.decode("utf-8", "replace")[:500]
        return error_from(name, status, message or f"Bedrock answered {status}", _retry_after(lowered))

    def rate_limits(self, headers: Mapping[str, str]) -> RateLimitState:
        """Bedrock publishes no remaining-quota headers: only a throttled answer's `retry-after`, if any."""
        lowered = {k.lower(): v for k, v in headers.items()}
        return RateLimitState(reset_s=_retry_after(lowered))


def _retry_after(lowered: Mapping[str, str]) -> float | None:
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None


def error_from(name: str, status: int, message: str, retry_after_s: float | None = None) -> ProviderError:
    """A Bedrock exception (by name: `ThrottlingException`, or the stream's `throttlingException`)."""
    canonical = name[:1].upper() + name[1:]
    known = _ERRORS.get(canonical)
    if known is None:
        retryable = status >= 500 or status == 429
        kind = "rate_limit_error" if status == 429 else "api_error" if status >= 500 else "invalid_request_error"
        known = (status if status >= 400 else 502, kind, retryable)
    return ProviderError(
        status=known[0],
        kind=known[1],
        message=f"{canonical}: {message}" if canonical else message,
        retryable=known[2],
        retry_after_s=retry_after_s,
    )


def usage_from(usage: Mapping[str, Any], reasoning_text: str = "") -> ProviderUsage:
    """Converse usage → the whole prompt (input + cache reads + cache writes), 1 h writes apart."""
    read = usage_count(usage.get("cacheReadInputTokens"))
    write = usage_count(usage.get("cacheWriteInputTokens"))
    write_1h = sum(usage_count(d.get("inputTokens")) for d in usage.get("cacheDetails") or [] if d.get("ttl") == "1h")
    write_1h = min(write_1h, write)
    # Converse does not count reasoning tokens apart; an estimate from the text (4 bytes a token)
    # keeps them visible rather than hidden inside the output count.
    reasoning = min(-(-len(reasoning_text.encode()) // 4), usage_count(usage.get("outputTokens")))
    return ProviderUsage(
        input_tokens=usage_count(usage.get("inputTokens")) + read + write,
        output_tokens=usage_count(usage.get("outputTokens")),
        cache_read_tokens=read,
        cache_write_tokens=write - write_1h,
        cache_write_1h_tokens=write_1h,
        reasoning_tokens=reasoning,
    )


class BedrockStreamDecoder:
    """ConverseStream eventstream frames → chat.completion.chunk dicts (usage in the last one)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._frames = EventStreamDecoder()
        # ConverseStream carries no id, and the codec reads no clock or randomness: the transport
        # stamps its own id on the chunks (as it stamps `created`).
        self._id = "chatcmpl-bedrock"
        self._started = False
        self._tool_index: dict[int, int] = {}  # contentBlockIndex → tool call index
        self._reasoning_bytes = 0
        self._signature: str | None = None  # the thinking block's, carried in the first tool call's id
        self._finish: str | None = None
        self._usage: ProviderUsage | None = None
        self._done = False

    @property
    def usage(self) -> ProviderUsage | None:
        return self._usage

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        try:
            frames = self._frames.feed(data)
        except EventStreamError as exc:
            raise ProviderStreamError(ProviderError(502, "api_error", f"corrupt Bedrock stream: {exc}", True)) from exc
        out: list[dict[str, Any]] = []
        for frame in frames:
            out.extend(self._frame(frame))
        return out

    def _frame(self, frame: EventMessage) -> list[dict[str, Any]]:
        kind = frame.event_type or ""
        if frame.message_type != "event":
            message = ""
            try:
                message = str(orjson.loads(frame.payload).get("message", ""))
            except (orjson.JSONDecodeError, AttributeError):
                message = frame.payload.decode("utf-8", "replace")[:500]
            raise ProviderStreamError(error_from(kind, 500, message))
        payload = orjson.loads(frame.payload) if frame.payload else {}
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            out.append(self._chunk({"role": "assistant", "content": ""}))
        if kind == "contentBlockStart":
            start = (payload.get("start") or {}).get("toolUse")
            if start is not None:
                index = len(self._tool_index)
                self._tool_index[int(payload.get("contentBlockIndex", 0))] = index
                call_id = str(start.get("toolUseId") or f"call_{index}")
                call = {
                    "index": index,
                    "id": pack_call_id(call_id, self._signature) if index == 0 else call_id,
                    "type": "function",
                    "function": {"name": start.get("name"), "arguments": ""},
                }
                out.append(self._chunk({"tool_calls": [call]}))
        elif kind == "contentBlockDelta":
            delta = payload.get("delta") or {}
            block = int(payload.get("contentBlockIndex", 0))
            if "text" in delta:
                out.append(self._chunk({"content": delta["text"]}))
            elif "toolUse" in delta:
                index = self._tool_index.get(block, 0)
                fragment = {"index": index, "function": {"arguments": delta["toolUse"].get("input", "")}}
                out.append(self._chunk({"tool_calls": [fragment]}))
            elif "reasoningContent" in delta:
                text = delta["reasoningContent"].get("text")
                self._signature = self._signature or delta["reasoningContent"].get("signature")
                if text:
                    self._reasoning_bytes += len(text.encode())
                    out.append(self._chunk({"reasoning_content": text}))
        elif kind == "messageStop":
            self._finish = _FINISH.get(str(payload.get("stopReason")), "stop")
            out.append(self._chunk({}, self._finish))
        elif kind == "metadata":
            usage = usage_from(payload.get("usage") or {})
            reasoning = min(-(-self._reasoning_bytes // 4), usage.output_tokens)
            self._usage = ProviderUsage(
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens,
                cache_write_1h_tokens=usage.cache_write_1h_tokens,
                reasoning_tokens=reasoning,
            )
            chunk = self._chunk({})
            chunk["choices"] = []
            chunk["usage"] = self._usage.chat_usage()
            out.append(chunk)
            self._done = True
        return out

    def close(self) -> list[dict[str, Any]]:
        if self._frames.pending or self._finish is None:
            raise ProviderStreamError(
                ProviderError(502, "api_error", "the Bedrock stream ended before messageStop", retryable=True)
            )
        return []
