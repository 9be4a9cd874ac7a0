"""Anthropic Messages API stand-in: `POST /v1/messages` (and `/v1/messages/count_tokens`) on loopback.

What a client of the real API meets, so that the gateway's Anthropic pools are tested against the
wire format rather than against our reading of it (the `anthropic` SDK is the check):

- Authentication by `x-api-key` or `Authorization: Bearer` (the SDK 2.x sends the key as a bearer;
  with both, `x-api-key` wins); `anthropic-version` required (2023-06-01 or 2026-10-21, which rejects
  `temperature` / `top_p` / `top_k`); `anthropic-beta` values checked against the known ones.
- The body checked as the API checks it: `max_tokens`, `model` and `messages` required, unknown
  fields refused, block types per role, every `tool_use` answered by a `tool_result` in the next
  turn, at most 4 `cache_control` breakpoints, a thinking budget of at least 1024 below `max_tokens`.
- Prompt caching: each `cache_control` breakpoint (or the top-level `cache_control`, on the last
  block) whose prefix holds at least `MIN_CACHE_TOKENS` is written the first time and read after,
  looking back 20 blocks for an earlier hit; lifetimes `5m` / `1h`; usage reports
  `cache_creation_input_tokens`, `cache_read_input_tokens` and the `cache_creation` split.
- Answers: seeded words; a `tool_use` when tools are offered and the last turn is the user's own
  (or `tool_choice` forces one); a thinking block when thinking is on; JSON when
  `output_config.format` asks; `stop_sequences` honoured. Streams follow the event grammar
  (message_start, ping, content_block_start / delta / stop, message_delta with usage, message_stop);
  `--fail-after-tokens` ends a stream with an `overloaded_error` event.
- Limits: `anthropic-ratelimit-*` headers on every answer, a 429 `rate_limit_error` with `retry-after`
  over `--rpm` / `--tpm`; queued faults (POST /standin/faults) answer 529 `overloaded_error` and so on.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from sim.hosted.common import (
    CONFIG,
    FAULTS,
    TALLY,
    Latency,
    Limit,
    PromptCache,
    RateLimiter,
    StandinConfig,
    Talker,
    base_app,
    count_tokens,
    json_response,
    sample_json,
    split_words,
)

VERSIONS = ("2023-01-01", "2023-06-01", "2026-10-21")
SAMPLING_FREE_VERSION = "2026-10-21"
BETAS = {
    "prompt-caching-2024-07-31",
    "extended-cache-ttl-2025-04-11",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19",
    "output-128k-2025-02-19",
    "context-1m-2025-08-07",
    "structured-outputs-2025-11-13",
    "fast-mode-2026-02-01",
}
MIN_CACHE_TOKENS = 1024
LOOKBACK_BLOCKS = 20
IMAGE_TOKENS = 1000
_TOP_LEVEL = {
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "stream", "metadata",
    "thinking", "output_config", "service_tier", "cache_control", "container", "inference_geo", "speed",
    "diagnostics",
}  # fmt: skip
_SAMPLING = ("temperature", "top_p", "top_k")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
_ERROR_TYPES |= {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
_ERROR_TYPES |= {503: "overloaded_error", 529: "overloaded_error"}
_ERROR_TEXT = {529: "Overloaded", 503: "Overloaded", 500: "Internal server error", 429: "Rate limited"}


class Refused(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    request_id = "req_" + os.urandom(12).hex()
    error = {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}
    body = {"type": "error", "error": error, "request_id": request_id}
    return json_response(body, status=status, headers={"request-id": request_id, **(headers or {})})


@dataclass(slots=True)
class _State:
    limiter: RateLimiter
    cache: PromptCache = field(default_factory=PromptCache)


STATE: web.AppKey[_State] = web.AppKey("anthropic_state", _State)


# --- checks ----------------------------------------------------------------------------------------


def _check_headers(request: web.Request, cfg: StandinConfig) -> str:
    key = request.headers.get("x-api-key")
    if key is None:
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else None
    if key is None:
        raise Refused(401, "x-api-key header is required")
    if key != cfg.api_key:
        raise Refused(401, "invalid x-api-key")
    version = request.headers.get("anthropic-version")
    if version is None:
        raise Refused(400, "anthropic-version: header is required")
    if version not in VERSIONS:
        raise Refused(400, f"anthropic-version: invalid version {version!r}")
    for beta in filter(None, (b.strip() for b in request.headers.get("anthropic-beta", "").split(","))):
        if beta not in BETAS:
            raise Refused(400, f"Unexpected value(s) `{beta}` for the `anthropic-beta` header")
    return version


def _check_cache_control(value: Any, where: str) -> float:
    if not isinstance(value, Mapping) or value.get("type") != "ephemeral":
        raise Refused(400, f"{where}.cache_control.type: Input should be 'ephemeral'")
    ttl = value.get("ttl", "5m")
    if ttl not in ("5m", "1h"):
        raise Refused(400, f"{where}.cache_control.ttl: Input should be '5m' or '1h'")
    return 3600.0 if ttl == "1h" else 300.0


def _check_block(block: Any, role: str, where: str) -> None:
    if not isinstance(block, Mapping):
        raise Refused(400, f"{where}: Input should be a valid dictionary")
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str) or not block["text"]:
            raise Refused(400, f"{where}.text: text content blocks must be non-empty")
    elif kind == "image":
        source = block.get("source")
        media = ("image/jpeg", "image/png", "image/gif", "image/webp")
        base64_ok = isinstance(source, Mapping) and source.get("type") == "base64" and source.get("media_type") in media
        url_ok = isinstance(source, Mapping) and source.get("type") == "url" and isinstance(source.get("url"), str)
        ok = (base64_ok and isinstance(source, Mapping) and isinstance(source.get("data"), str)) or url_ok
        if not ok:
            raise Refused(400, f"{where}.source: invalid image source")
    elif kind == "tool_use":
        if role != "assistant":
            raise Refused(400, f"{where}: tool_use blocks are only allowed in assistant messages")
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise Refused(400, f"{where}: tool_use blocks need an id and a name")
        if not isinstance(block.get("input"), Mapping):
            raise Refused(400, f"{where}.input: Input should be a valid dictionary")
    elif kind == "tool_result":
        if role != "user":
            raise Refused(400, f"{where}: tool_result blocks are only allowed in user messages")
        if not isinstance(block.get("tool_use_id"), str):
            raise Refused(400, f"{where}.tool_use_id: Field required")
    elif kind in ("thinking", "redacted_thinking", "document"):
        if kind != "document" and role != "assistant":
            raise Refused(400, f"{where}: {kind} blocks are only allowed in assistant messages")
    else:
        raise Refused(
            400, f"{where}.type: Input tag {kind!r} found using 'type' does not match any of the expected tags"
        )
    if "cache_control" in block:
        _check_cache_control(block["cache_control"], where)


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content) if isinstance(content, list) else []


def _check_body(body: Any, version: str, cfg: StandinConfig) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Refused(400, "Request body must be a JSON object")
    for name in body:
        if name in _SAMPLING and version < SAMPLING_FREE_VERSION:
            continue
        if name not in _TOP_LEVEL:
            raise Refused(400, f"{name}: Extra inputs are not permitted")
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            raise Refused(400, f"{name}: Field required")
    if not isinstance(body["model"], str) or (cfg.models and body["model"] not in cfg.models):
        raise Refused(404, f"model: {body['model']}")
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise Refused(400, "max_tokens: Input should be a valid integer greater than or equal to 0")
    if "temperature" in body and not (isinstance(body["temperature"], (int, float)) and 0 <= body["temperature"] <= 1):
        raise Refused(400, "temperature: Input should be less than or equal to 1")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "messages: at least one message is required")
    pending: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise Refused(400, f"{where}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise Refused(400, f"{where}.content: Field required")
        role = message["role"]
        blocks = _blocks(content)
        for j, block in enumerate(blocks):
            _check_block(block, role, f"{where}.content.{j}")
        results = {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"}
        if pending and role == "user" and not pending <= results:
            missing = ", ".join(sorted(pending - results))
            raise Refused(
                400, f"{where}: tool_use ids were found without tool_result blocks immediately after: {missing}"
            )
        if role == "user":
            pending = set()
        uses = {b["id"] for b in blocks if b.get("type") == "tool_use"}
        if role == "assistant":
            pending |= uses
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        for j, block in enumerate(system if isinstance(system, list) else [None]):
            if not isinstance(block, Mapping) or block.get("type") != "text":
                raise Refused(400, f"system.{j}.type: Input should be 'text'")
            _check_block(block, "system", f"system.{j}")
    for j, tool in enumerate(body.get("tools") or ()):
        if (
            not isinstance(tool, Mapping)
            or not isinstance(tool.get("name"), str)
            or not isinstance(tool.get("input_schema"), Mapping)
        ):
            raise Refused(400, f"tools.{j}: custom tools need a name and an input_schema")
        if "cache_control" in tool:
            _check_cache_control(tool["cache_control"], f"tools.{j}")
    choice = body.get("tool_choice")
    if choice is not None and (
        not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "any", "tool", "none")
    ):
        raise Refused(400, "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    if isinstance(choice, Mapping) and choice.get("type") == "tool":
        names = {t.get("name") for t in body.get("tools") or ()}
        if choice.get("name") not in names:
            raise Refused(400, f"tool_choice.name: no tool named {choice.get('name')!r}")
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            raise Refused(400, "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024")
        if budget >= max_tokens:
            raise Refused(400, "`max_tokens` must be greater than `thinking.budget_tokens`")
        if "temperature" in body and body["temperature"] != 1:
            raise Refused(400, "`temperature` may only be set to 1 when thinking is enabled")
        if isinstance(choice, Mapping) and choice.get("type") in ("any", "tool"):
            raise Refused(400, "Thinking may not be enabled when tool_choice forces tool use.")
    elif thinking is not None and (
        not isinstance(thinking, Mapping) or thinking.get("type") not in ("disabled", "adaptive")
    ):
        raise Refused(400, "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise Refused(400, "stop_sequences: Input should be a valid list of non-empty strings")
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None and (
        not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), Mapping)
    ):
        raise Refused(400, "output_config.format: Input should be a json_schema format with a schema")
    if "cache_control" in body and body["cache_control"] is not None:
        _check_cache_control(body["cache_control"], "cache_control")
    marks = sum(1 for _, b in _prompt_blocks(body) if isinstance(b, Mapping) and "cache_control" in b)
    marks += 1 if body.get("cache_control") else 0
    if marks > 4:
        raise Refused(400, f"A maximum of 4 blocks with cache_control may be provided. Found {marks}.")
    return body


# --- prompt accounting -----------------------------------------------------------------------------


def _prompt_blocks(body: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The prompt in cache order (tools, system, messages), one entry per block."""
    out: list[tuple[str, Any]] = [("tool", t) for t in body.get("tools") or ()]
    system = body.get("system")
    if isinstance(system, str):
        out.append(("system", {"type": "text", "text": system}))
    elif isinstance(system, list):
        out.extend(("system", b) for b in system)
    for message in body.get("messages") or ():
        if isinstance(message, Mapping):
            out.extend((str(message.get("role")), b) for b in _blocks(message.get("content")))
    return out


def _block_tokens(block: Any) -> int:
    if not isinstance(block, Mapping):
        return count_tokens(orjson.dumps(block))
    if block.get("type") == "text":
        return count_tokens(str(block.get("text", "")))
    if block.get("type") == "image":
        return IMAGE_TOKENS
    clean = {k: v for k, v in block.items() if k != "cache_control"}
    return count_tokens(orjson.dumps(clean, option=orjson.OPT_SORT_KEYS))


@dataclass(frozen=True, slots=True)
class _Prompt:
    tokens: int
    read: int
    write_5m: int
    write_1h: int

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.tokens - self.read - self.write_5m - self.write_1h,
            "cache_creation_input_tokens": self.write_5m + self.write_1h,
            "cache_read_input_tokens": self.read,
            "cache_creation": {"ephemeral_5m_input_tokens": self.write_5m, "ephemeral_1h_input_tokens": self.write_1h},
        }


def _account_prompt(body: Mapping[str, Any], cache: PromptCache) -> _Prompt:
    blocks = _prompt_blocks(body)
    digests: list[bytes] = []
    totals: list[int] = []
    rolling = PromptCache.digest(body.get("model"))
    total = 0
    for role, block in blocks:
        clean = {k: v for k, v in block.items() if k != "cache_control"} if isinstance(block, Mapping) else block
        rolling = PromptCache.digest(rolling.hex(), role, clean)
        total += _block_tokens(block)
        digests.append(rolling)
        totals.append(total)
    marks: list[tuple[int, float]] = []
    for i, (_, block) in enumerate(blocks):
        if isinstance(block, Mapping) and "cache_control" in block:
            marks.append((i, _check_cache_control(block["cache_control"], "block")))
    top = body.get("cache_control")
    if top and blocks:
        marks.append((len(blocks) - 1, _check_cache_control(top, "cache_control")))
    breakpoints = [(digests[i], totals[i], ttl) for i, ttl in sorted(marks) if totals[i] >= MIN_CACHE_TOKENS]
    probes: list[tuple[bytes, int]] = []
    for i, _ in marks:
        probes.extend(
            (digests[j], totals[j]) for j in range(max(i - LOOKBACK_BLOCKS, 0), i) if totals[j] >= MIN_CACHE_TOKENS
        )
    result = cache.account(breakpoints, probes)
    return _Prompt(total, result.read_tokens, result.write_tokens, result.write_1h_tokens)


# --- the answer ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Answer:
    blocks: list[dict[str, Any]]
    output_tokens: int
    thinking_tokens: int
    stop_reason: str
    stop_sequence: str | None


def _prompt_key(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps([body.get("model"), body.get("system"), body.get("messages")], option=orjson.OPT_SORT_KEYS)


def _wants_tool(body: Mapping[str, Any]) -> dict[str, Any] | None:
    tools = body.get("tools") or []
    if not tools:
        return None
    choice = body.get("tool_choice") or {"type": "auto"}
    if choice.get("type") == "none":
        return None
    if choice.get("type") == "tool":
        return dict(next(t for t in tools if t.get("name") == choice.get("name")))
    last = body["messages"][-1]
    answered = last.get("role") != "user" or any(b.get("type") == "tool_result" for b in _blocks(last.get("content")))
    if choice.get("type") == "auto" and answered:
        return None
    return dict(tools[0])


def _answer(body: Mapping[str, Any], cfg: StandinConfig) -> _Answer:
    talker = Talker(cfg.seed)
    key = _prompt_key(body)
    limit = int(body["max_tokens"])
    blocks: list[dict[str, Any]] = []
    used = 0
    thinking_tokens = 0
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        n = min(talker.length(key + b"think", limit, 16), int(thinking["budget_tokens"]))
        text = "".join(talker.words(key + b"think", n))
        blocks.append({"type": "thinking", "thinking": text, "signature": os.urandom(24).hex()})
        used = thinking_tokens = n
    tool = _wants_tool(body)
    if tool is not None:
        words = talker.words(key + b"tool", 4)
        arguments = sample_json(tool.get("input_schema"), words) or {}
        call_id = "toolu_" + os.urandom(12).hex()
        blocks.append({"type": "tool_use", "id": call_id, "name": tool["name"], "input": arguments})
        used += count_tokens(orjson.dumps(arguments))
        return _Answer(blocks, used, thinking_tokens, "tool_use", None)
    room = max(limit - used, 0)
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        text = orjson.dumps(sample_json(fmt["schema"], talker.words(key, 4))).decode()
        n = count_tokens(text)
        words = [text]
    else:
        n = talker.length(key, room, cfg.max_output_tokens) if room else 0
        words = talker.words(key, n)
        text = "".join(words)
    stop_reason = "max_tokens" if n >= room else "end_turn"
    stop_sequence = None
    cut = [(text.find(s), s) for s in body.get("stop_sequences") or () if s in text]
    if cut:
        at, stop_sequence = min(cut)
        text = text[:at]
        n = count_tokens(text) if fmt else len(split_words(text))
        stop_reason = "stop_sequence"
    if text:
        blocks.append({"type": "text", "text": text})
    return _Answer(blocks, used + n, thinking_tokens, stop_reason, stop_sequence)


# --- rate limits -----------------------------------------------------------------------------------


def _instant(seconds_from_now: float) -> str:
    at = datetime.datetime.fromtimestamp(time.time() + seconds_from_now, tz=datetime.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _limit_headers(limit: Limit) -> dict[str, str]:
    reset = _instant(limit.reset_s)
    requests_limit = str(limit.requests_limit or 1_000_000)
    tokens_limit = str(limit.tokens_limit or 1_000_000_000)
    headers = {
        "anthropic-ratelimit-requests-limit": requests_limit,
        "anthropic-ratelimit-requests-remaining": str(limit.requests_remaining),
        "anthropic-ratelimit-requests-reset": reset,
    }
    for kind in ("tokens", "input-tokens", "output-tokens"):
        headers[f"anthropic-ratelimit-{kind}-limit"] = tokens_limit
        headers[f"anthropic-ratelimit-{kind}-remaining"] = str(limit.tokens_remaining)
        headers[f"anthropic-ratelimit-{kind}-reset"] = reset
    if not limit.allowed:
        headers["retry-after"] = str(max(math.ceil(limit.retry_after_s), 1))
    return headers


# --- handlers --------------------------------------------------------------------------------------


async def _read_body(request: web.Request, cfg: StandinConfig) -> tuple[dict[str, Any], str]:
    version = _check_headers(request, cfg)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise Refused(400, "There was an error parsing the body of your request: not valid JSON") from None
    return _check_body(body, version, cfg), version


async def messages(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    state = request.app[STATE]
    tally = request.app[TALLY]
    model = "?"
    try:
        body, _version = await _read_body(request, cfg)
        model = body["model"]
        fault = request.app[FAULTS].take()
        if fault is not None:
            raise Refused(fault, _ERROR_TEXT.get(fault, "Error"), {"retry-after": "1"} if fault == 429 else None)
        prompt_tokens = sum(_block_tokens(b) for _, b in _prompt_blocks(body))
        limit = state.limiter.admit(prompt_tokens + int(body["max_tokens"]))
        if not limit.allowed:
            raise Refused(
                429,
                f"This request would exceed your organization's rate limit of {cfg.rpm or '-'} requests or "
                f"{cfg.tpm or '-'} tokens per minute. Please retry after the reset time.",
                _limit_headers(limit),
            )
    except Refused as refused:
        tally.refuse(model)
        return _error(refused.status, refused.message, refused.headers)
    prompt = _account_prompt(body, state.cache)
    answer = _answer(body, cfg)
    headers = {"request-id": "req_" + os.urandom(12).hex(), **_limit_headers(limit)}
    message_id = "msg_" + os.urandom(12).hex()
    if body.get("stream"):
        return await _stream(request, body, prompt, answer, message_id, headers)
    await Latency(cfg.ttft_ms, cfg.tpot_ms).whole(answer.output_tokens)
    _record(request, model, prompt, answer.output_tokens, answer.thinking_tokens)
    usage = {**prompt.usage(), "output_tokens": answer.output_tokens, "service_tier": "standard"}
    if answer.thinking_tokens:
        usage["output_tokens_details"] = {"thinking_tokens": answer.thinking_tokens}
    message = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": answer.blocks,
        "stop_reason": answer.stop_reason,
        "stop_sequence": answer.stop_sequence,
        "usage": usage,
    }
    return json_response(message, headers=headers)


def _record(request: web.Request, model: str, prompt: _Prompt, output: int, thinking: int) -> None:
    request.app[TALLY].record(
        model,
        input_tokens=prompt.tokens,
        output_tokens=output,
        cache_read_tokens=prompt.read,
        cache_write_tokens=prompt.write_5m,
        cache_write_1h_tokens=prompt.write_1h,
        reasoning_tokens=thinking,
    )


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _pieces(block: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """A block's deltas with the tokens each carries."""
    kind = block["type"]
    if kind == "text":
        return [({"type": "text_delta", "text": w}, 1) for w in split_words(block["text"])]
    if kind == "thinking":
        deltas = [({"type": "thinking_delta", "thinking": w}, 1) for w in split_words(block["thinking"])]
        return [*deltas, ({"type": "signature_delta", "signature": block["signature"]}, 0)]
    raw = orjson.dumps(block["input"]).decode()
    step = max(len(raw) // 3, 1)
    chunks = [raw[i : i + step] for i in range(0, len(raw), step)]
    return [({"type": "input_json_delta", "partial_json": c}, count_tokens(c)) for c in chunks]


def _start_block(block: dict[str, Any]) -> dict[str, Any]:
    if block["type"] == "text":
        return {"type": "text", "text": ""}
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}


async def _stream(
    request: web.Request,
    body: Mapping[str, Any],
    prompt: _Prompt,
    answer: _Answer,
    message_id: str,
    headers: dict[str, str],
) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    latency = Latency(cfg.ttft_ms, cfg.tpot_ms)
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache", **headers})
    await response.prepare(request)
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**prompt.usage(), "output_tokens": 1, "service_tier": "standard"},
    }
    await response.write(_event({"type": "message_start", "message": start}))
    await response.write(_event({"type": "ping"}))
    await latency.first_token()
    sent = 0
    first = True
    for index, block in enumerate(answer.blocks):
        await response.write(
            _event({"type": "content_block_start", "index": index, "content_block": _start_block(block)})
        )
        for delta, tokens in _pieces(block):
            if not first:
                await latency.next_token()
            first = False
            await response.write(_event({"type": "content_block_delta", "index": index, "delta": delta}))
            sent += tokens
            if cfg.fail_after_tokens and sent >= cfg.fail_after_tokens:
                _record(request, str(body["model"]), prompt, sent, 0)
                error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
                await response.write(_event(error))
                await response.write_eof()
                return response
        await response.write(_event({"type": "content_block_stop", "index": index}))
    usage: dict[str, Any] = {**prompt.usage(), "output_tokens": answer.output_tokens}
    usage.pop("cache_creation")
    if answer.thinking_tokens:
        usage["output_tokens_details"] = {"thinking_tokens": answer.thinking_tokens}
    delta = {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence}
    await response.write(_event({"type": "message_delta", "delta": delta, "usage": usage}))
    await response.write(_event({"type": "message_stop"}))
    _record(request, str(body["model"]), prompt, answer.output_tokens, answer.thinking_tokens)
    await response.write_eof()
    return response


async def count_tokens_handler(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    try:
        version = _check_headers(request, cfg)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise Refused(400, "There was an error parsing the body of your request: not valid JSON") from None
        if isinstance(body, dict):
            body.setdefault("max_tokens", 1)
        body = _check_body(body, version, cfg)
    except Refused as refused:
        return _error(refused.status, refused.message, refused.headers)
    return json_response({"input_tokens": sum(_block_tokens(b) for _, b in _prompt_blocks(body))})


def build_app(cfg: StandinConfig) -> web.Application:
    app = base_app("anthropic", cfg)
    app[STATE] = _State(limiter=RateLimiter(cfg.rpm, cfg.tpm))
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens_handler)
    return app
