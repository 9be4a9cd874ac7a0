"""Azure OpenAI stand-in: chat completions by deployment and on the v1 API, on loopback.

- `POST /openai/deployments/{deployment}/chat/completions?api-version=YYYY-MM-DD[-preview]` (a missing
  `api-version` answers 404 "Resource not found", as Azure does; an unknown one 400) and
  `POST /openai/v1/chat/completions` with the deployment as `model` (`api-version` optional).
- Authentication by `api-key` or `Authorization: Bearer` (an Entra ID token, or the key on v1); the
  401 text is Azure's. `--models` lists the deployments; others answer `DeploymentNotFound`.
- The body checked as the API checks it: unknown top-level fields ("Unrecognized request argument
  supplied"), unknown message or content-part properties (so a `cache_control` left in is caught),
  a `tool` message that answers no `tool_calls`.
- Automatic prompt caching: prompts of 1024 tokens and more are cached at message boundaries; a later
  prompt with the same prefix reads it, in 128-token steps, reported as
  `prompt_tokens_details.cached_tokens` (no writes are billed).
- Answers carry Azure's additions (`prompt_filter_results`, `content_filter_results`, a leading
  filter-only stream chunk); the usage chunk comes when `stream_options.include_usage` asks;
  `reasoning_effort` adds reasoning tokens to the completion count.
- Limits: `x-ratelimit-*` headers, and a 429 with `retry-after` / `retry-after-ms` over `--rpm` /
  `--tpm`; queued faults answer 500 / 503 / 429 in Azure's error shape.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
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

OLDEST_VERSION = "2023-05-15"
_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
MIN_CACHE_TOKENS = 1024
CACHE_STEP = 128
CACHE_TTL_S = 600.0
REASONING_TOKENS = {"minimal": 0, "none": 0, "low": 16, "medium": 48, "high": 128, "xhigh": 256}
_TOP_LEVEL = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "data_sources", "user_security_context",
}  # fmt: skip
_MESSAGE_KEYS = {
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "refusal",
    "audio",
    "annotations",
}
_PART_KEYS = {"type", "text", "image_url", "input_audio", "file", "refusal"}
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_FILTER = {
    name: {"filtered": False, "severity": "safe"} for name in ("hate", "self_harm", "sexual", "violence")
}  # the content-filter verdicts Azure attaches to prompts and choices
_AUTH_401 = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key "
    "for an active subscription and use a correct regional API endpoint for your resource."
)


class Refused(Exception):
    def __init__(self, status: int, error: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(str(error.get("message")))
        self.status = status
        self.error = error
        self.headers = dict(headers or {})


def _invalid(message: str, param: str | None = None) -> Refused:
    return Refused(400, {"message": message, "type": "invalid_request_error", "param": param, "code": None})


@dataclass(slots=True)
class _State:
    limiter: RateLimiter
    cache: PromptCache


STATE: web.AppKey[_State] = web.AppKey("azure_state", _State)


# --- checks ----------------------------------------------------------------------------------------


def _check_auth(request: web.Request, cfg: StandinConfig) -> None:
    key = request.headers.get("api-key")
    auth = request.headers.get("authorization", "")
    if key is None and auth.lower().startswith("bearer "):
        key = auth[7:]
    if key != cfg.api_key:
        raise Refused(401, {"code": "401", "message": _AUTH_401})


def _check_version(version: str | None, required: bool) -> None:
    if version is None:
        if required:
            raise Refused(404, {"code": "404", "message": "Resource not found"})
        return
    if version in ("preview", "latest") and not required:
        return
    if not _VERSION.match(version) or version < OLDEST_VERSION:
        raise Refused(400, {"code": "BadRequest", "message": f"API version not supported: {version}"})


def _check_body(body: Any, cfg: StandinConfig, deployment: str | None) -> tuple[dict[str, Any], str]:
    if not isinstance(body, dict):
        raise _invalid("We could not parse the JSON body of your request.")
    for name in body:
        if name not in _TOP_LEVEL:
            raise _invalid(f"Unrecognized request argument supplied: {name}")
    name = deployment or body.get("model")
    if not isinstance(name, str) or not name:
        raise _invalid("you must provide a model parameter", "model")
    if cfg.models and name not in cfg.models:
        message = (
            "The API deployment for this resource does not exist. If you created the deployment within the "
            "last 5 minutes, please wait a moment and try again."
        )
        raise Refused(404, {"code": "DeploymentNotFound", "message": message})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' is a required property", "messages")
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            raise _invalid(f"Invalid value for 'messages[{i}].role'", f"messages[{i}].role")
        for key in message:
            if key not in _MESSAGE_KEYS:
                raise _invalid(f"Unrecognized request argument supplied: messages[{i}].{key}", f"messages[{i}].{key}")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                extra = [k for k in part if k not in _PART_KEYS] if isinstance(part, Mapping) else ["?"]
                if extra:
                    where = f"messages[{i}].content[{j}].{extra[0]}"
                    raise _invalid(f"Unrecognized request argument supplied: {where}", where)
        if message["role"] == "assistant":
            open_calls = {str(c.get("id")) for c in message.get("tool_calls") or ()}
        elif message["role"] == "tool" and message.get("tool_call_id") not in open_calls:
            raise _invalid(
                "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                "with 'tool_calls'.",
                f"messages.[{i}].role",
            )
    for name_limit in ("max_tokens", "max_completion_tokens"):
        value = body.get(name_limit)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _invalid(f"Invalid '{name_limit}': integer below minimum value.", name_limit)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise _invalid("max_tokens and max_completion_tokens cannot both be set", "max_tokens")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise _invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    return body, name


# --- prompt and answer -----------------------------------------------------------------------------


def _message_tokens(message: Mapping[str, Any]) -> int:
    content = message.get("content")
    text_tokens = count_tokens(content) if isinstance(content, str) else count_tokens(orjson.dumps(content or ""))
    extra = {k: v for k, v in message.items() if k not in ("content",)}
    return 4 + text_tokens + count_tokens(orjson.dumps(extra, option=orjson.OPT_SORT_KEYS))


def _account_prompt(body: Mapping[str, Any], deployment: str, cache: PromptCache) -> tuple[int, int]:
    """(prompt tokens, cached tokens): breakpoints at every message boundary past the minimum."""
    total = count_tokens(orjson.dumps(body.get("tools") or [], option=orjson.OPT_SORT_KEYS)) if body.get("tools") else 0
    rolling = PromptCache.digest(deployment, body.get("tools"))
    points: list[tuple[bytes, int, float]] = []
    for message in body["messages"]:
        total += _message_tokens(message)
        rolling = PromptCache.digest(rolling.hex(), message)
        if total >= MIN_CACHE_TOKENS:
            points.append((rolling, total, CACHE_TTL_S))
    read = cache.account(points).read_tokens
    if read:
        read = MIN_CACHE_TOKENS + (read - MIN_CACHE_TOKENS) // CACHE_STEP * CACHE_STEP
    return total, read


@dataclass(slots=True)
class _Choice:
    text: str | None
    words: list[str]
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    tokens: int


def _wants_tool(body: Mapping[str, Any]) -> dict[str, Any] | None:
    tools = [t for t in body.get("tools") or () if isinstance(t, Mapping) and t.get("type") == "function"]
    if not tools:
        return None
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if isinstance(choice, Mapping):
        wanted = (choice.get("function") or {}).get("name")
        return dict(next((t for t in tools if t["function"].get("name") == wanted), tools[0])["function"])
    if choice == "auto" and body["messages"][-1].get("role") != "user":
        return None
    return dict(tools[0]["function"])


def _choice(body: Mapping[str, Any], index: int, cfg: StandinConfig) -> _Choice:
    talker = Talker(cfg.seed)
    key = orjson.dumps([body.get("messages"), index], option=orjson.OPT_SORT_KEYS)
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 1_000_000
    tool = _wants_tool(body)
    if tool is not None:
        arguments = orjson.dumps(sample_json(tool.get("parameters"), talker.words(key, 4)) or {}).decode()
        function = {"name": tool.get("name"), "arguments": arguments}
        call = {"id": "call_" + os.urandom(12).hex(), "type": "function", "function": function}
        return _Choice(None, [], [call], "tool_calls", count_tokens(arguments))
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        text = orjson.dumps(sample_json((fmt.get("json_schema") or {}).get("schema"), talker.words(key, 4))).decode()
        words = [text]
        n = count_tokens(text)
    elif fmt.get("type") == "json_object":
        text = orjson.dumps({"answer": "".join(talker.words(key, 4))}).decode()
        words = [text]
        n = count_tokens(text)
    else:
        n = talker.length(key, int(limit), cfg.max_output_tokens)
        words = talker.words(key, n)
        text = "".join(words)
    finish = "length" if n >= int(limit) else "stop"
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    cut = [text.find(s) for s in stops if s and s in text]
    if cut:
        text = text[: min(cut)]
        words = split_words(text) if len(words) > 1 else [text]
        n = len(words) if len(words) > 1 else count_tokens(text)
        finish = "stop"
    return _Choice(text, words, [], finish, n)


def _usage(prompt: int, cached: int, completion: int, reasoning: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion + reasoning,
        "total_tokens": prompt + completion + reasoning,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


# --- limits ----------------------------------------------------------------------------------------


def _limit_headers(limit: Limit) -> dict[str, str]:
    reset = f"{max(math.ceil(limit.reset_s), 1)}s"
    headers = {
        "x-ratelimit-limit-requests": str(limit.requests_limit or 1_000_000),
        "x-ratelimit-remaining-requests": str(limit.requests_remaining),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": str(limit.tokens_limit or 1_000_000_000),
        "x-ratelimit-remaining-tokens": str(limit.tokens_remaining),
        "x-ratelimit-reset-tokens": reset,
    }
    if not limit.allowed:
        seconds = max(math.ceil(limit.retry_after_s), 1)
        headers["retry-after"] = str(seconds)
        headers["retry-after-ms"] = str(int(limit.retry_after_s * 1000) or 1000)
    return headers


def _too_many(version: str, seconds: int) -> dict[str, Any]:
    message = (
        f"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {version} have "
        f"exceeded token rate limit of your current AIServices S0 pricing tier. Please retry after {seconds} "
        "seconds."
    )
    return {"code": "429", "message": message}


_FAULTS = {
    500: {"code": "InternalServerError", "message": "The server had an error while processing your request."},
    503: {"code": "ServiceUnavailable", "message": "The service is temporarily unable to process your request."},
}


# --- handlers --------------------------------------------------------------------------------------


def _headers() -> dict[str, str]:
    request_id = os.urandom(16).hex()
    return {"apim-request-id": request_id, "x-request-id": request_id, "x-ms-region": "Sweden Central"}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    state = request.app[STATE]
    deployment = request.match_info.get("deployment")
    version = request.query.get("api-version")
    name = deployment or "?"
    try:
        _check_version(version, required=deployment is not None)
        _check_auth(request, cfg)
        try:
            raw = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise _invalid("We could not parse the JSON body of your request.") from None
        body, name = _check_body(raw, cfg, deployment)
        fault = request.app[FAULTS].take()
        if fault == 429:
            raise Refused(429, _too_many(version or "v1", 1), {"retry-after": "1", "retry-after-ms": "1000"})
        if fault is not None:
            raise Refused(fault if fault in _FAULTS else 503, _FAULTS.get(fault, _FAULTS[503]))
        limit_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or cfg.max_output_tokens
        prompt_estimate = sum(_message_tokens(m) for m in body["messages"])
        limit = state.limiter.admit(prompt_estimate + int(limit_tokens))
        if not limit.allowed:
            headers = _limit_headers(limit)
            raise Refused(429, _too_many(version or "v1", int(headers["retry-after"])), headers)
    except Refused as refused:
        request.app[TALLY].refuse(name)
        return json_response({"error": refused.error}, status=refused.status, headers={**_headers(), **refused.headers})
    prompt, cached = _account_prompt(body, name, state.cache)
    n = int(body.get("n") or 1)
    choices = [_choice(body, i, cfg) for i in range(n)]
    reasoning = REASONING_TOKENS.get(str(body.get("reasoning_effort")), 0)
    completion = sum(c.tokens for c in choices)
    headers = {**_headers(), **_limit_headers(limit)}
    completion_id = "chatcmpl-" + os.urandom(12).hex()
    model_name = name if deployment is None else "gpt-4o-2024-11-20"
    if body.get("stream"):
        return await _stream(request, body, choices, (prompt, cached, reasoning), completion_id, model_name, headers)
    await Latency(cfg.ttft_ms, cfg.tpot_ms).whole(completion)
    _record(request, name, prompt, cached, completion + reasoning, reasoning)
    answer = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": "fp_standin",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": _FILTER}],
        "choices": [
            {
                "index": i,
                "message": _message(c),
                "finish_reason": c.finish_reason,
                "logprobs": None,
                "content_filter_results": _FILTER if c.text is not None else {},
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(prompt, cached, completion, reasoning),
    }
    return json_response(answer, headers=headers)


def _message(choice: _Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None, "annotations": []}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


def _record(request: web.Request, name: str, prompt: int, cached: int, output: int, reasoning: int) -> None:
    request.app[TALLY].record(
        name, input_tokens=prompt, output_tokens=output, cache_read_tokens=cached, reasoning_tokens=reasoning
    )


def _data(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _stream(
    request: web.Request,
    body: Mapping[str, Any],
    choices: list[_Choice],
    counts: tuple[int, int, int],
    completion_id: str,
    model_name: str,
    headers: dict[str, str],
) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    prompt, cached, reasoning = counts
    latency = Latency(cfg.ttft_ms, cfg.tpot_ms)
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache", **headers})
    await response.prepare(request)
    created = int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        choice["content_filter_results"] = _FILTER if delta.get("content") else {}
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
        payload |= {"system_fingerprint": "fp_standin", "choices": [choice]}
        return _data(payload)

    leading = {"id": "", "object": "", "created": 0, "model": "", "choices": []}
    leading["prompt_filter_results"] = [{"prompt_index": 0, "content_filter_results": _FILTER}]
    await response.write(_data(leading))
    await latency.first_token()
    sent = 0
    for index, choice in enumerate(choices):
        await response.write(chunk(index, {"role": "assistant", "content": "", "refusal": None}))
        pieces: list[dict[str, Any]] = []
        for k, call in enumerate(choice.tool_calls):
            head = {"index": k, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            pieces.append({"tool_calls": [head]})
            arguments = call["function"]["arguments"]
            step = max(len(arguments) // 3, 1)
            pieces.extend(
                {"tool_calls": [{"index": k, "function": {"arguments": arguments[i : i + step]}}]}
                for i in range(0, len(arguments), step)
            )
        pieces.extend({"content": w} for w in choice.words)
        for piece in pieces:
            if sent:
                await latency.next_token()
            await response.write(chunk(index, piece))
            sent += 1
            if cfg.fail_after_tokens and sent >= cfg.fail_after_tokens:
                _record(request, str(body.get("model") or model_name), prompt, cached, sent, 0)
                error = {"message": "The server had an error while processing your request.", "type": "server_error"}
                await response.write(_data({"error": {**error, "param": None, "code": "500"}}))
                await response.write_eof()
                return response
        await response.write(chunk(index, {}, choice.finish_reason))
    completion = sum(c.tokens for c in choices)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
        usage |= {"choices": [], "usage": _usage(prompt, cached, completion, reasoning)}
        await response.write(_data(usage))
    await response.write(b"data: [DONE]\n\n")
    name = request.match_info.get("deployment") or str(body.get("model"))
    _record(request, name, prompt, cached, completion + reasoning, reasoning)
    await response.write_eof()
    return response


def build_app(cfg: StandinConfig) -> web.Application:
    app = base_app("azure", cfg)
    app[STATE] = _State(limiter=RateLimiter(cfg.rpm, cfg.tpm), cache=PromptCache())
    app.router.add_post("/openai/deployments/{deployment}/chat/completions", chat_completions)
    app.router.add_post("/openai/v1/chat/completions", chat_completions)
    return app
