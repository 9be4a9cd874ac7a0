"""Minimal validation of the OpenAI request shapes the gateway must understand to do its job.

Only what admission, routing and accounting read is checked here (model, messages/prompt/input,
stream, stream_options, max_tokens, n); everything else passes through for the engine to judge.
Hand-written checks over the parsed dict: no per-request pydantic on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest
from policies.types import ApiKind

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        if all(_is_int(t) and t >= 0 for t in prompt):
            return
        if all(isinstance(p, str) for p in prompt):
            return
    raise InvalidRequest("'prompt' must be a string, an array of strings or an array of token ids", param="prompt")


def _check_input(value: Any) -> None:
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_is_int(v) for v in value):
            return
        if all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value):
            return
    raise InvalidRequest("'input' must be a non-empty string or array of strings/token ids", param="input")


def validate_body(api: ApiKind, body: Any) -> dict[str, Any]:
    """Check the fields the gateway reads; returns the body (a dict) or raises InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
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
    _positive_int(body, "max_tokens")
    _positive_int(body, "max_completion_tokens")
    _positive_int(body, "n")
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise InvalidRequest(f"'{field}' must be a number", param=field)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", param="user")
    return body
