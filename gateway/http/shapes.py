"""Minimal validation of the OpenAI request shapes the gateway must understand to do its job.

Only what admission, routing and accounting read is checked here (model, messages/prompt/input,
stream, stream_options, max_tokens, n), plus what an engine would fail on instead of rejecting
(token ids outside int32, sampling parameters outside OpenAI's documented ranges) and what the
gateway keeps (`model` and `metadata` within bounded sizes); everything else passes through for the
engine to judge. Hand-written checks over the parsed dict: no per-request pydantic on the hot path.

Ranges (OpenAI API reference): temperature [0, 2], top_p [0, 1], n [1, 128], presence_penalty and
frequency_penalty [-2, 2], top_logprobs [0, 20] (with `logprobs: true`), completions `logprobs`
[0, 20] (OpenAI documents 5; vLLM's default `max_logprobs` is 20, and the gateway refuses nothing an
engine behind it accepts), best_of [1, 20] and >= n, metadata at most 16 pairs of strings (keys up
to 64 characters, values up to 512).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import (
    InvalidRequest,
)
from policies.types import ApiKind

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_TOKEN_ID = 2**31 - 1  # engines hold ids as int32: anything above is no token of any vocabulary
MAX_MODEL_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("temperature", 0.0, 2.0),
    ("top_p", 0.0, 1.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
)
_RANGE_FIELDS = frozenset(field for field, _low, _high in _RANGES)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _int_in(body: Mapping[str, Any], field: str, low: int, high: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequest(f"'{field}' must be an integer from {low} to {high}, got {value!r}", param=field)
    return int(value)


def _check_sampling(api: ApiKind, body: Mapping[str, Any]) -> None:
    # one C-level test first: most requests set none of these (the loop then checks them in order)
    if not _RANGE_FIELDS.isdisjoint(body):
        for field, low, high in _RANGES:
            value = body.get(field)
            if value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidRequest(f"'{field}' must be a number", param=field)
            if not low <= value <= high:  # NaN fails too
                raise InvalidRequest(f"'{field}' must be from {low:g} to {high:g}, got {value!r}", param=field)
    # each check only for a field the body sets (a call less per field it does not)
    n = _int_in(body, "n", 1, 128) if "n" in body else None
    if api == "chat":
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest("'logprobs' must be a boolean", param="logprobs")
        if "top_logprobs" in body and _int_in(body, "top_logprobs", 0, 20) is not None and logprobs is not True:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    elif api == "completions":
        _int_in(body, "logprobs", 0, 20)
        best_of = _int_in(body, "best_of", 1, 20)
        if best_of is not None and best_of < (n or 1):
            raise InvalidRequest(f"'best_of' ({best_of}) must be at least 'n' ({n})", param="best_of")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"'metadata' keys are strings of at most {MAX_METADATA_KEY_CHARS} characters and values strings "
                f"of at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _positive_int(body: Mapping[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise InvalidRequest(f"'{field}' must be an integer >= 1, got {value!r}", param=field)
    return int(value)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is None:
            if role != "assistant" and role != "function":
                raise InvalidRequest(f"messages[{i}].content is required", param=f"messages[{i}].content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}] must be an object with a 'type'",
                        param=f"messages[{i}].content[{j}]",
                    )
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content"
            )


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return
        if all(isinstance(p, str) for p in prompt):
            return
    raise InvalidRequest(
        f"'prompt' must be a string, an array of strings or an array of token ids (0 to {MAX_TOKEN_ID})",
        param="prompt",
    )


def _check_input(value: Any) -> None:
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_is_token_id(v) for v in value):
            return
        if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
            return
    raise InvalidRequest(
        f"'input' must be a non-empty string or array of strings/token ids (token ids from 0 to {MAX_TOKEN_ID})",
        param="input",
    )


def validate_body(api: ApiKind, body: Any) -> dict[str, Any]:
    """Check the fields the gateway reads; returns the body (a dict) or raises InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequest(f"'model' must be at most {MAX_MODEL_CHARS} characters", param="model")
    if api == "chat":
        _check_messages(body.get("messages"))
    elif api == "completions":
        if "prompt" not in body:
            raise InvalidRequest("'prompt' is required", param="prompt")
        _check_prompt(body["prompt"])
    else:
        if "input" not in body:
            raise InvalidRequest("'input' is required", param="input")
        _check_input(body["input"])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise InvalidRequest("'stream_options.include_usage' must be a boolean", param="stream_options")
    if "max_tokens" in body:  # the helpers only for the fields a body sets
        _positive_int(body, "max_tokens")
    if "max_completion_tokens" in body:
        _positive_int(body, "max_completion_tokens")
    _check_sampling(api, body)
    metadata = body.get("metadata")
    if metadata is not None:
        _check_metadata(metadata)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", param="user")
    return body
