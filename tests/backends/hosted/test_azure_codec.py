"""The Azure OpenAI codec on its own: addresses, field checks, Azure's additions taken out, errors and limits."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.azure_openai import DEFAULT_API_VERSION, AzureOpenAICodec
from backends.hosted.base import ProviderStreamError, ProviderTarget, Untranslatable

CODEC = AzureOpenAICodec()
HELLO: Any = [{"role": "user", "content": "Hi"}]
FILTER = {"hate": {"filtered": False, "severity": "safe"}}


def test_deployment_and_v1_paths() -> None:
    call = CODEC.request({"model": "alias", "messages": HELLO}, ProviderTarget(model="gpt 4o"))
    assert call.path == f"/openai/deployments/gpt%204o/chat/completions?api-version={DEFAULT_API_VERSION}"
    assert orjson.loads(call.body)["model"] == "gpt 4o" and not call.stream
    dated = CODEC.request({"messages": HELLO}, ProviderTarget(model="d", api_version="2025-04-01-preview"))
    assert dated.path.endswith("?api-version=2025-04-01-preview")
    v1 = CODEC.request({"messages": HELLO}, ProviderTarget(model="d", api_version="v1", extra_headers={"api-key": "k"}))
    assert v1.path == "/openai/v1/chat/completions" and dict(v1.headers)["api-key"] == "k"
    preview = CODEC.request({"messages": HELLO}, ProviderTarget(model="d", api_version="preview"))
    assert preview.path == "/openai/v1/chat/completions?api-version=preview"


def test_fields_pass_cache_marks_go_and_stream_asks_for_usage() -> None:
    chat = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}
        ],
        "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": {"type": "ephemeral"}}],
        "n": 2,
        "seed": 3,
        "logprobs": True,
        "reasoning_effort": "low",
        "stream": True,
    }
    call = CODEC.request(chat, ProviderTarget(model="d"))
    body = orjson.loads(call.body)
    assert call.stream and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["content"][0] == {"type": "text", "text": "Hi"}
    assert body["tools"][0] == {"type": "function", "function": {"name": "f"}}
    assert (body["n"], body["seed"], body["logprobs"], body["reasoning_effort"]) == (2, 3, True, "low")


def test_refusals_and_drops() -> None:
    with pytest.raises(Untranslatable) as search:
        CODEC.request({"messages": HELLO, "web_search_options": {}}, ProviderTarget(model="d"))
    assert search.value.param == "web_search_options"
    with pytest.raises(Untranslatable) as unknown:
        CODEC.request({"messages": HELLO, "top_k": 5}, ProviderTarget(model="d"))
    assert unknown.value.param == "top_k"
    with pytest.raises(Untranslatable):
        CODEC.request({"messages": []}, ProviderTarget(model="d"))
    dropped = CODEC.request(
        {"messages": HELLO, "top_k": 5, "web_search_options": {}}, ProviderTarget(model="d", allow_drop=True)
    )
    assert set(dropped.dropped) == {"top_k", "web_search_options"} and "top_k" not in orjson.loads(dropped.body)


def test_answer_without_azure_additions() -> None:
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o-2024-11-20",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": FILTER}],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "finish_reason": "stop",
                "logprobs": None,
                "content_filter_results": FILTER,
            }
        ],
        "usage": {
            "prompt_tokens": 2000,
            "completion_tokens": 30,
            "total_tokens": 2030,
            "prompt_tokens_details": {"cached_tokens": 1152},
            "completion_tokens_details": {"reasoning_tokens": 10},
        },
    }
    completion, usage = CODEC.answer(orjson.dumps(answer), ProviderTarget(model="d"))
    assert "prompt_filter_results" not in completion and "content_filter_results" not in completion["choices"][0]
    ChatCompletion.model_validate(completion)
    assert (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens, usage.reasoning_tokens) == (
        2000,
        30,
        1152,
        10,
    )


def data(*payloads: Any) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n" for p in payloads)


def test_stream_decoder() -> None:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    stream = data(
        {"id": "", "object": "", "created": 0, "model": "", "choices": [], "prompt_filter_results": []},
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, "content_filter_results": FILTER}
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
        b"[DONE]",
    )
    decoder = CODEC.stream(ProviderTarget(model="m"))
    chunks = [c for i in range(0, len(stream), 11) for c in decoder.feed(stream[i : i + 11])] + decoder.close()
    assert len(chunks) == 4 and all("content_filter_results" not in c["choices"][0] for c in chunks if c["choices"])
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert decoder.usage is not None and decoder.usage.input_tokens == 5
    broken = CODEC.stream(ProviderTarget(model="m"))
    with pytest.raises(ProviderStreamError) as failed:
        broken.feed(data({"error": {"message": "The server had an error", "type": "server_error", "code": "500"}}))
    assert failed.value.error.status == 500 and failed.value.error.retryable
    cut = CODEC.stream(ProviderTarget(model="m"))
    cut.feed(stream[: stream.index(b"data: [DONE]")])
    with pytest.raises(ProviderStreamError):
        cut.close()


def test_errors_and_rate_limits() -> None:
    limited = CODEC.error(
        429, {"retry-after-ms": "1500", "retry-after": "2"}, orjson.dumps({"error": {"code": "429", "message": "slow"}})
    )
    assert (limited.status, limited.kind, limited.retryable, limited.retry_after_s) == (
        429,
        "rate_limit_error",
        True,
        1.5,
    )
    missing = CODEC.error(404, {}, orjson.dumps({"error": {"code": "DeploymentNotFound", "message": "no"}}))
    assert (missing.kind, missing.retryable) == ("not_found_error", False)
    filtered = CODEC.error(400, {}, orjson.dumps({"error": {"code": "content_filter", "message": "filtered"}}))
    assert (filtered.kind, filtered.retryable) == ("content_filter", False)
    state = CODEC.rate_limits(
        {
            "x-ratelimit-remaining-requests": "9",
            "x-ratelimit-remaining-tokens": "900",
            "x-ratelimit-reset-tokens": "6m0s",
            "x-ratelimit-reset-requests": "1s",
        }
    )
    assert (state.requests_remaining, state.tokens_remaining, state.reset_s) == (9, 900, 1.0)


def test_reset_waits_for_the_exhausted_limit() -> None:
    headers = {
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "20s",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "1s",
    }
    assert CODEC.rate_limits(headers).reset_s == 20.0
    assert CODEC.rate_limits({**headers, "retry-after-ms": "250"}).reset_s == 0.25
