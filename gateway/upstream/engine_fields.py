"""What an engine's answer may carry to the client: the API's own fields, not vLLM's additions.

vLLM writes fields of its own into its answers; a strict client (one that refuses unknown fields)
then refuses the answer. The relay (`relay.py`) takes them out after the gateway has read what it
needs from them (usage, `kv_transfer_params`, `metrics`), and only touches an answer or a stream
event that holds one: a stream event is tested for them as bytes first (one regex search in C, so most
events are never parsed here); a non-streamed answer, parsed already, is looked at as a dict.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# vLLM's own fields in its answers (vllm/entrypoints/openai/*/protocol.py, .../anthropic/protocol.py),
# none of them in the API's schema: a strict client refuses an answer that carries them. The transfer
# parameters (the gateway's prefill/decode business) and a chat or completions choice's `stop_reason`
# (the matched stop string; `finish_reason` says "stop") never reach the client; the others only when
# they hold something, which the client asked for with vLLM's own request fields (where the pool
# forwards them). `metrics` stays: an engine sends it only when its operator runs it with
# `--enable-per-request-metrics`. Only the top level and chat/completions choices are looked at: an
# Anthropic message's own `stop_reason` is its API's.
_ENGINE_ALWAYS = ("kv_transfer_params", "ec_transfer_params")
_ENGINE_UNASKED = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "input_messages", "output_messages")
_CHOICE_ALWAYS = ("stop_reason",)
_CHOICE_UNASKED = ("token_ids", "routed_experts")
# a choice's message (or a chunk's delta): vLLM's `reasoning` (older versions: `reasoning_content`)
# holds the reasoning parser's output; empty, it is one more unknown field
_MESSAGE_UNASKED = ("reasoning", "reasoning_content")
_ENGINE_NAMES = (*_ENGINE_ALWAYS, *_ENGINE_UNASKED, *_CHOICE_ALWAYS, *_CHOICE_UNASKED, *_MESSAGE_UNASKED)
# any of the names as a JSON key ("name", quotes included): one pass of the regex engine over the
# event, where a substring test per name scanned it a dozen times (about 4x the time for an event)
_ENGINE_MARK = re.compile(b'"(?:' + b"|".join(re.escape(name.encode()) for name in _ENGINE_NAMES) + b')"')


def carries_engine_fields(data: bytes) -> bool:
    """Whether an answer or event may hold one of vLLM's own fields (as a quoted key, in C)."""
    return _ENGINE_MARK.search(data) is not None


def drop_engine_fields(answer: dict[str, Any]) -> bool:
    """Take vLLM's own fields out of a chat or completions answer or chunk, at the top and in each
    choice; whether anything was taken."""
    dropped = _drop(answer, _ENGINE_ALWAYS, _ENGINE_UNASKED)
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            dropped = _drop(choice, _CHOICE_ALWAYS, _CHOICE_UNASKED) or dropped
            message = choice.get("message", choice.get("delta"))
            if isinstance(message, dict):
                dropped = _drop(message, (), _MESSAGE_UNASKED) or dropped
    return dropped


def _drop(node: dict[str, Any], always: tuple[str, ...], unasked: tuple[str, ...]) -> bool:
    dropped = False
    for name in always:
        if name in node:
            del node[name]
            dropped = True
    for name in unasked:
        if name in node and node[name] is None:
            del node[name]
            dropped = True
    return dropped


def without_engine_fields(event: bytes) -> bytes:
    """One `data:` event without vLLM's own fields (the event as it was when it holds none)."""
    try:
        chunk = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return event
    if isinstance(chunk, dict) and drop_engine_fields(chunk):
        return b"data: " + orjson.dumps(chunk)
    return event
