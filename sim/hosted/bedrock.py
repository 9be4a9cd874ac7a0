"""Bedrock Runtime stand-in: Converse and ConverseStream, SigV4-checked, with cache points and throttling.

`python -m sim.hosted bedrock --port N`. POST /model/{modelId}/converse answers JSON and
/model/{modelId}/converse-stream the `application/vnd.amazon.eventstream` framing, in the shapes
boto3's `bedrock-runtime` client parses (it is the tests' client). Like the service:

- every call must be SigV4-signed for service `bedrock` (any access key id; the secret is
  `--api-key`), checked by recomputing the signature with botocore; a Bedrock API key
  (`Authorization: Bearer <--api-key>`) is accepted too. Unsigned calls get
  MissingAuthenticationTokenException, mis-signed ones InvalidSignatureException (403).
- the body is validated (alternating turns starting with a user turn, one member per content
  block, tool blocks only with a `toolConfig`, a thinking budget of at least 1024 under
  `maxTokens`, and with thinking on, the assistant turn that the final tool results answer
  starting with its thinking block, signature intact): ValidationException (400).
- prompt caching follows cache points in Converse's prefix order (tools, system, messages): a
  prefix of at least 1024 tokens seen before and alive is a cache read, else a write (5 minutes,
  or 1 hour with `ttl: 1h`); usage reports `inputTokens` without the cached parts, as Bedrock does.
- over `--rpm` / `--tpm` (input plus `maxTokens`) a call gets ThrottlingException (429); Bedrock
  sends no quota headers, so neither does the stand-in. `--fail-after-tokens` breaks a stream with a
  `modelStreamErrorException` frame (a non-streamed answer that long gets ModelErrorException).

Answers are seeded words (`sim.hosted.common.Talker`): text, a `toolUse` when the tool choice asks
for one (or, on `auto`, when the last user turn holds no tool result), JSON following an
`outputConfig` schema, and `reasoningContent` first when thinking is enabled.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from backends.hosted.aws import encode_event, encode_exception, verify
from sim.hosted.common import (
    CONFIG,
    FAULTS,
    TALLY,
    Latency,
    PromptCache,
    RateLimiter,
    StandinConfig,
    Talker,
    base_app,
    count_tokens,
    json_response,
)

MIN_CACHE_TOKENS = 1024
IMAGE_TOKENS = 1600
_ERROR_NS = "http://internal.amazon.com/coral/com.amazon.bedrock/"
_STATUS = {
    "ValidationException": 400,
    "MissingAuthenticationTokenException": 403,
    "IncompleteSignatureException": 403,
    "InvalidSignatureException": 403,
    "UnrecognizedClientException": 403,
    "AccessDeniedException": 403,
    "ResourceNotFoundException": 404,
    "ThrottlingException": 429,
    "ModelErrorException": 424,
    "InternalServerException": 500,
    "ModelNotReadyException": 429,
    "ModelTimeoutException": 408,
    "ServiceUnavailableException": 503,
}
# A fault a test queues (POST /standin/faults {"status": N}) → the exception Bedrock answers with;
# 529 (Anthropic's "overloaded") is Bedrock's ModelNotReadyException, itself sent as a 429.
_FAULTS = {
    400: ("ValidationException", "Malformed input request."),
    403: ("AccessDeniedException", "You don't have access to the model with the specified model ID."),
    404: ("ResourceNotFoundException", "The requested resource could not be found."),
    408: ("ModelTimeoutException", "The request took too long to process."),
    424: ("ModelErrorException", "The model failed to process the request."),
    429: ("ThrottlingException", "Too many requests, please wait before trying again."),
    500: ("InternalServerException", "The server encountered an internal error."),
    503: ("ServiceUnavailableException", "The service is unavailable. Please try again later."),
    529: ("ModelNotReadyException", "The model is not ready to serve requests. Please try again later."),
}

_LIMITER: web.AppKey[RateLimiter] = web.AppKey("bedrock_limiter", RateLimiter)
_CACHE: web.AppKey[PromptCache] = web.AppKey("bedrock_cache", PromptCache)


class _Refused(Exception):
    def __init__(self, name: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.message = message
        self.status = status or _STATUS.get(name, 400)


def _error(name: str, message: str, status: int | None = None) -> web.Response:
    return json_response(
        {"message": message},
        status=status or _STATUS.get(name, 400),
        headers={"x-amzn-ErrorType": f"{name}:{_ERROR_NS}", "x-amzn-RequestId": str(uuid.uuid4())},
    )


# --- validation ------------------------------------------------------------------------------------

_BLOCK_MEMBERS = {"text", "image", "document", "toolUse", "toolResult", "cachePoint", "reasoningContent", "video"}


def _one_member(block: Any, where: str, allowed: set[str]) -> str:
    if not isinstance(block, Mapping) or len(block) != 1:
        raise _Refused("ValidationException", f"{where}: a content block must set exactly one member")
    (member,) = block.keys()
    if member not in allowed:
        raise _Refused("ValidationException", f"{where}: unknown content block member {member!r}")
    return str(member)


def _check_cache_point(value: Any, where: str) -> None:
    if not isinstance(value, Mapping) or value.get("type") != "default" or value.get("ttl") not in (None, "5m", "1h"):
        raise _Refused("ValidationException", f"{where}.cachePoint: type must be 'default' (ttl '5m' or '1h')")


def _validate(body: Any) -> None:
    if not isinstance(body, Mapping):
        raise _Refused("ValidationException", "The request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Refused("ValidationException", "messages: at least one message is required")
    tool_config = body.get("toolConfig")
    tools_given = isinstance(tool_config, Mapping) and bool(tool_config.get("tools"))
    previous = None
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ("user", "assistant"):
            raise _Refused("ValidationException", f"{where}.role must be 'user' or 'assistant'")
        if i == 0 and role != "user":
            raise _Refused("ValidationException", "A conversation must start with a user message.")
        if role == previous:
            raise _Refused("ValidationException", "A conversation must alternate between user and assistant roles.")
        previous = role
        content = message.get("content")
        if not isinstance(content, list) or not content:
            raise _Refused("ValidationException", f"{where}.content must be a non-empty list")
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            member = _one_member(block, at, _BLOCK_MEMBERS)
            value = block[member]
            if member == "text" and (not isinstance(value, str) or not value.strip()):
                raise _Refused("ValidationException", f"{at}.text: text content blocks must be non-empty")
            if member in ("toolUse", "toolResult") and not tools_given:
                raise _Refused(
                    "ValidationException",
                    "The toolConfig field must be defined when using toolUse and toolResult content blocks.",
                )
            if member == "image":
                source = value.get("source") if isinstance(value, Mapping) else None
                if value.get("format") not in ("png", "jpeg", "gif", "webp") or not isinstance(source, Mapping):
                    raise _Refused("ValidationException", f"{at}.image: format and source are required")
                if "bytes" in source:
                    try:
                        base64.b64decode(source["bytes"], validate=True)
                    except (ValueError, TypeError) as exc:
                        raise _Refused("ValidationException", f"{at}.image.source.bytes is not base64") from exc
            if member == "cachePoint":
                _check_cache_point(value, at)
    for j, block in enumerate(body.get("system") or []):
        member = _one_member(block, f"system.{j}", {"text", "cachePoint", "guardContent"})
        if member == "cachePoint":
            _check_cache_point(block[member], f"system.{j}")
    inference = body.get("inferenceConfig") or {}
    max_tokens = inference.get("maxTokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise _Refused("ValidationException", "inferenceConfig.maxTokens must be at least 1")
    if isinstance(tool_config, Mapping):
        for k, tool in enumerate(tool_config.get("tools") or []):
            member = _one_member(tool, f"toolConfig.tools.{k}", {"toolSpec", "cachePoint", "systemTool"})
            if member == "toolSpec":
                spec = tool["toolSpec"]
                if not isinstance(spec.get("name"), str) or not isinstance(spec.get("inputSchema"), Mapping):
                    raise _Refused("ValidationException", f"toolConfig.tools.{k}.toolSpec needs name and inputSchema")
    thinking = (body.get("additionalModelRequestFields") or {}).get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            raise _Refused(
                "ValidationException", "thinking.budget_tokens: Input should be greater than or equal to 1024"
            )
        if max_tokens is not None and budget >= max_tokens:
            raise _Refused("ValidationException", "`max_tokens` must be greater than `thinking.budget_tokens`")


# --- the answer ------------------------------------------------------------------------------------


def _block_tokens(block: Mapping[str, Any]) -> int:
    if "text" in block:
        return count_tokens(str(block["text"]))
    if "image" in block:
        return IMAGE_TOKENS
    if "cachePoint" in block:
        return 0
    return count_tokens(orjson.dumps(block, option=orjson.OPT_SORT_KEYS))


def _prompt(body: Mapping[str, Any]) -> tuple[int, list[tuple[bytes, int, float]]]:
    """(prompt tokens, cache breakpoints in prefix order: tools, system, messages)."""
    sequence: list[Any] = list((body.get("toolConfig") or {}).get("tools") or [])
    sequence += list(body.get("system") or [])
    for message in body["messages"]:
        sequence.append({"role": message["role"]})
        sequence += list(message["content"])
    tokens = 0
    points: list[tuple[bytes, int, float]] = []
    prefix: list[Any] = []
    for block in sequence:
        if "cachePoint" in block:
            if tokens >= MIN_CACHE_TOKENS:
                ttl = 3600.0 if block["cachePoint"].get("ttl") == "1h" else 300.0
                points.append((PromptCache.digest(prefix), tokens, ttl))
            continue
        prefix.append(block)
        if "role" not in block:
            tokens += _block_tokens(block)
    return max(tokens, 1), points


def _example(schema: Any, talker: Talker, key: str) -> Any:
    """A value following a JSON schema (the required properties, or all when none are required)."""
    if not isinstance(schema, Mapping):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        names = schema.get("required") or list(props)
        return {name: _example(props.get(name, {"type": "string"}), talker, key + name) for name in names}
    if kind == "array":
        return [_example(schema.get("items") or {"type": "string"}, talker, key + "[]")]
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    return "".join(talker.words(key, 2)).strip()


class _Plan:
    """What the stand-in will answer to one request."""

    def __init__(self, body: Mapping[str, Any], cfg: StandinConfig) -> None:
        talker = Talker(cfg.seed)
        key = orjson.dumps(body["messages"], option=orjson.OPT_SORT_KEYS).decode()
        inference = body.get("inferenceConfig") or {}
        limit = int(inference.get("maxTokens") or 4096)
        thinking = (body.get("additionalModelRequestFields") or {}).get("thinking") or {}
        self.reasoning: list[str] = []
        if thinking.get("type") == "enabled":
            count = min(int(thinking.get("budget_tokens", 1024)), max(cfg.max_output_tokens // 2, 1), limit - 1)
            self.reasoning = talker.words("think" + key, count)
        room = max(limit - len(self.reasoning), 1)
        self.tool: dict[str, Any] | None = self._tool_call(body, talker, key)
        self.words: list[str] = []
        self.stop_reason = "end_turn"
        schema_text = (
            ((body.get("outputConfig") or {}).get("textFormat") or {}).get("structure", {}).get("jsonSchema", {})
        ).get("schema")
        if self.tool is not None:
            self.stop_reason = "tool_use"
        elif schema_text:
            schema = orjson.loads(schema_text)
            text = orjson.dumps(_example(schema, talker, key)).decode()
            self.words = [text[i : i + 4] for i in range(0, len(text), 4)]
        else:
            length = talker.length(key, room, cfg.max_output_tokens)
            self.words = talker.words(key, length)
            if length >= room:
                self.stop_reason = "max_tokens"
            stops = inference.get("stopSequences") or []
            text = ""
            for n, word in enumerate(self.words):
                text += word
                if any(s and s in text for s in stops):
                    self.words = self.words[:n]
                    self.stop_reason = "stop_sequence"
                    break
        self.tool_tokens = count_tokens(orjson.dumps(self.tool["input"])) if self.tool else 0
        self.output_tokens = len(self.reasoning) + len(self.words) + self.tool_tokens

    @staticmethod
    def _tool_call(body: Mapping[str, Any], talker: Talker, key: str) -> dict[str, Any] | None:
        config = body.get("toolConfig") or {}
        specs = [t["toolSpec"] for t in config.get("tools") or [] if "toolSpec" in t]
        if not specs:
            return None
        choice = config.get("toolChoice") or {"auto": {}}
        if "tool" in choice:
            spec = next((s for s in specs if s["name"] == choice["tool"].get("name")), None)
            if spec is None:
                raise _Refused("ValidationException", "toolChoice.tool.name is not one of the tools")
        elif "any" in choice:
            spec = specs[0]
        else:
            last = body["messages"][-1]
            if last["role"] != "user" or any("toolResult" in b for b in last["content"]):
                return None
            spec = specs[0]
        schema = (spec.get("inputSchema") or {}).get("json") or {}
        return {
            "toolUseId": "tooluse_" + uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:22],
            "name": spec["name"],
            "input": _example(schema, talker, key + spec["name"]),
        }


def _usage(prompt: int, cached: Any, output: int) -> dict[str, Any]:
    read, write, write_1h = cached.read_tokens, cached.write_tokens, cached.write_1h_tokens
    usage: dict[str, Any] = {
        "inputTokens": prompt - read - write - write_1h,
        "outputTokens": output,
        "totalTokens": prompt + output,
    }
    if read or write or write_1h:
        usage["cacheReadInputTokens"] = read
        usage["cacheWriteInputTokens"] = write + write_1h
    details = [{"ttl": ttl, "inputTokens": n} for ttl, n in (("5m", write), ("1h", write_1h)) if n]
    if details:
        usage["cacheDetails"] = details
    return usage


def thinking_signature(text: str) -> str:
    """The signature the stand-in puts on a thinking block (a keyed digest of its text, as opaque as Claude's)."""
    return base64.b64encode(hashlib.blake2b(text.encode(), key=b"standin-thinking", digest_size=48).digest()).decode()


def _check_thinking_turn(body: Mapping[str, Any]) -> None:
    """With thinking on, the assistant turn that the final tool results answer must start with the
    thinking block it was given, signature intact (as Claude on Bedrock requires)."""
    thinking = (body.get("additionalModelRequestFields") or {}).get("thinking") or {}
    messages = body["messages"]
    if thinking.get("type") != "enabled" or len(messages) < 2:
        return
    last, previous = messages[-1], messages[-2]
    if last["role"] != "user" or not any("toolResult" in b for b in last["content"]):
        return
    first = previous["content"][0]
    text = ((first.get("reasoningContent") or {}).get("reasoningText") or {}) if isinstance(first, Mapping) else {}
    if not text:
        raise _Refused(
            "ValidationException",
            "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`. When "
            "`thinking` is enabled, a final `assistant` message must start with a thinking block.",
        )
    if text.get("signature") != thinking_signature(str(text.get("text", ""))):
        raise _Refused("ValidationException", "Invalid `signature` in `thinking` block")


def _content(plan: _Plan) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    if plan.reasoning:
        signature = thinking_signature("".join(plan.reasoning))
        content.append(
            {"reasoningContent": {"reasoningText": {"text": "".join(plan.reasoning), "signature": signature}}}
        )
    if plan.words:
        content.append({"text": "".join(plan.words)})
    if plan.tool is not None:
        content.append({"toolUse": plan.tool})
    return content


# --- handlers --------------------------------------------------------------------------------------


def _authenticate(request: web.Request, body: bytes, cfg: StandinConfig) -> None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        if auth[7:] != cfg.api_key:
            raise _Refused("UnrecognizedClientException", "Invalid API Key format: Must start with pre-defined prefix")
        return
    url = f"http://{request.headers.get('Host', request.host)}{request.raw_path}"
    verdict = verify(
        request.method,
        url,
        request.headers,
        body,
        lambda _akid: cfg.api_key,
        now=datetime.datetime.now(datetime.UTC),
    )
    if verdict.error is not None:
        raise _Refused(verdict.error, verdict.message)


async def _prepare(request: web.Request) -> tuple[str, dict[str, Any], _Plan, int, Any]:
    cfg = request.app[CONFIG]
    model = request.match_info["model"]
    raw = await request.read()
    _authenticate(request, raw, cfg)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Refused(
            "ValidationException", "Malformed input request, please reformat your input and try again."
        ) from exc
    _validate(body)
    _check_thinking_turn(body)
    if cfg.models and model not in cfg.models:
        raise _Refused("ValidationException", "The provided model identifier is invalid.")
    fault = request.app[FAULTS].take()
    if fault is not None:
        raise _Refused(*_FAULTS.get(fault, ("InternalServerException", "The server encountered an internal error.")))
    prompt, points = _prompt(body)
    plan = _Plan(body, cfg)
    limit = int((body.get("inferenceConfig") or {}).get("maxTokens") or 4096)
    verdict = request.app[_LIMITER].admit(prompt + limit)
    if not verdict.allowed:
        raise _Refused("ThrottlingException", "Too many requests, please wait before trying again.")
    cached = request.app[_CACHE].account(points)
    return model, body, plan, prompt, cached


def _record(request: web.Request, model: str, plan: _Plan, prompt: int, cached: Any) -> None:
    request.app[TALLY].record(
        model,
        input_tokens=prompt,
        output_tokens=plan.output_tokens,
        cache_read_tokens=cached.read_tokens,
        cache_write_tokens=cached.write_tokens,
        cache_write_1h_tokens=cached.write_1h_tokens,
        reasoning_tokens=len(plan.reasoning),
    )


async def _converse(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    started = time.monotonic()
    try:
        model, _body, plan, prompt, cached = await _prepare(request)
    except _Refused as refused:
        request.app[TALLY].refuse(request.match_info["model"])
        return _error(refused.name, refused.message, refused.status)
    if cfg.fail_after_tokens and plan.output_tokens > cfg.fail_after_tokens:
        request.app[TALLY].refuse(model)
        return _error("ModelErrorException", "The model failed to process the request.")
    await Latency(cfg.ttft_ms, cfg.tpot_ms).whole(plan.output_tokens)
    _record(request, model, plan, prompt, cached)
    answer = {
        "output": {"message": {"role": "assistant", "content": _content(plan)}},
        "stopReason": plan.stop_reason,
        "usage": _usage(prompt, cached, plan.output_tokens),
        "metrics": {"latencyMs": int((time.monotonic() - started) * 1000)},
    }
    return json_response(answer, headers={"x-amzn-RequestId": str(uuid.uuid4())})


async def _converse_stream(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    started = time.monotonic()
    try:
        model, _body, plan, prompt, cached = await _prepare(request)
    except _Refused as refused:
        request.app[TALLY].refuse(request.match_info["model"])
        return _error(refused.name, refused.message, refused.status)
    response = web.StreamResponse(
        headers={"Content-Type": "application/vnd.amazon.eventstream", "x-amzn-RequestId": str(uuid.uuid4())}
    )
    await response.prepare(request)
    latency = Latency(cfg.ttft_ms, cfg.tpot_ms)
    sent = 0

    async def event(name: str, payload: dict[str, Any]) -> None:
        await response.write(encode_event(name, orjson.dumps(payload)))

    async def token() -> bool:
        """Wait for the next token; False once the stream must break off."""
        nonlocal sent
        await (latency.first_token() if sent == 0 else latency.next_token())
        sent += 1
        if cfg.fail_after_tokens and sent > cfg.fail_after_tokens:
            # billed for what was sent, as a provider bills a broken stream
            request.app[TALLY].record(model, input_tokens=prompt, output_tokens=sent - 1)
            payload = {"message": "The model stream failed.", "originalStatusCode": 500}
            await response.write(encode_exception("modelStreamErrorException", orjson.dumps(payload)))
            return False
        return True

    await event("messageStart", {"role": "assistant"})
    index = 0
    if plan.reasoning:
        for word in plan.reasoning:
            if not await token():
                return await _end(response)
            await event(
                "contentBlockDelta", {"contentBlockIndex": index, "delta": {"reasoningContent": {"text": word}}}
            )
        signature = thinking_signature("".join(plan.reasoning))
        await event(
            "contentBlockDelta", {"contentBlockIndex": index, "delta": {"reasoningContent": {"signature": signature}}}
        )
        await event("contentBlockStop", {"contentBlockIndex": index})
        index += 1
    if plan.words:
        for word in plan.words:
            if not await token():
                return await _end(response)
            await event("contentBlockDelta", {"contentBlockIndex": index, "delta": {"text": word}})
        await event("contentBlockStop", {"contentBlockIndex": index})
        index += 1
    if plan.tool is not None:
        start = {"toolUse": {"toolUseId": plan.tool["toolUseId"], "name": plan.tool["name"]}}
        await event("contentBlockStart", {"contentBlockIndex": index, "start": start})
        arguments = orjson.dumps(plan.tool["input"]).decode()
        for i in range(0, len(arguments), 4):  # four bytes a token, as `count_tokens` counts them
            if not await token():
                return await _end(response)
            await event(
                "contentBlockDelta", {"contentBlockIndex": index, "delta": {"toolUse": {"input": arguments[i : i + 4]}}}
            )
        await event("contentBlockStop", {"contentBlockIndex": index})
    await event("messageStop", {"stopReason": plan.stop_reason})
    _record(request, model, plan, prompt, cached)
    metrics = {"latencyMs": int((time.monotonic() - started) * 1000)}
    await event("metadata", {"usage": _usage(prompt, cached, plan.output_tokens), "metrics": metrics})
    return await _end(response)


async def _end(response: web.StreamResponse) -> web.StreamResponse:
    await response.write_eof()
    return response


def build_app(cfg: StandinConfig) -> web.Application:
    app = base_app("bedrock", cfg)
    app[_LIMITER] = RateLimiter(cfg.rpm, cfg.tpm)
    app[_CACHE] = PromptCache()
    app.router.add_post("/model/{model}/converse", _converse)
    app.router.add_post("/model/{model}/converse-stream", _converse_stream)
    return app
