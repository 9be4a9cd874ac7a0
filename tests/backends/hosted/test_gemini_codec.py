"""The Gemini codec as pure functions: chat → generateContent bodies, refusals, answers, streams and errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.base import ProviderStreamError, ProviderTarget, Untranslatable
from backends.hosted.gemini import GeminiCodec, base_url, pack_call_id, unpack_call_id

CODEC = GeminiCodec()
API = ProviderTarget(model="gemini-2.5-flash")
VERTEX = ProviderTarget(model="projects/p1/locations/us-central1/publishers/google/models/gemini-2.5-flash")


def body(chat: dict[str, Any], target: ProviderTarget = API) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(CODEC.request(chat, target).body)
    return data


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_paths_for_the_gemini_api_and_vertex() -> None:
    assert CODEC.request({"messages": [user()]}, API).path == "/v1beta/models/gemini-2.5-flash:generateContent"
    streamed = CODEC.request({"messages": [user()], "stream": True}, API)
    assert streamed.path == "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse" and streamed.stream
    assert CODEC.request({"messages": [user()]}, VERTEX).path == (
        "/v1/projects/p1/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent"
    )
    pinned = ProviderTarget(model="gemini-2.5-flash", api_version="v1")
    assert CODEC.request({"messages": [user()]}, pinned).path.startswith("/v1/models/")


def test_system_turns_and_generation_config() -> None:
    data = body(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                user(),
                {"role": "assistant", "content": "hello"},
                user("again"),
            ],
            "max_tokens": 64,
            "temperature": 0.3,
            "top_p": 0.8,
            "seed": 5,
            "n": 2,
            "stop": ["END"],
            "presence_penalty": 0.1,
        }
    )
    assert data["systemInstruction"] == {"parts": [{"text": "be brief"}]}
    assert [c["role"] for c in data["contents"]] == ["user", "model", "user"]
    assert data["generationConfig"] == {
        "maxOutputTokens": 64,
        "temperature": 0.3,
        "topP": 0.8,
        "presencePenalty": 0.1,
        "seed": 5,
        "candidateCount": 2,
        "stopSequences": ["END"],
    }


def test_tool_calls_and_results_become_function_parts_named_after_their_call() -> None:
    data = body(
        {
            "messages": [
                user("weather?"),
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "w"}},
        }
    )
    assert data["contents"][1] == {
        "role": "model",
        "parts": [{"functionCall": {"name": "w", "args": {"c": "P"}, "id": "c1"}}],
    }
    assert data["contents"][2]["parts"] == [
        {"functionResponse": {"name": "w", "response": {"output": "sunny"}, "id": "c1"}},
        {"functionResponse": {"name": "w", "response": {"temp": 20}, "id": "c1"}},
    ]
    assert data["tools"] == [{"functionDeclarations": [{"name": "w", "parametersJsonSchema": {"type": "object"}}]}]
    assert data["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["w"]}}


def test_a_tool_result_answering_no_call_is_refused() -> None:
    from backends.protocols import ProtocolError

    with pytest.raises(ProtocolError) as refused:
        CODEC.request({"messages": [user(), {"role": "tool", "tool_call_id": "x", "content": "?"}]}, API)
    assert refused.value.param == "messages[1].tool_call_id"


@pytest.mark.parametrize(("choice", "mode"), [("none", "NONE"), ("required", "ANY")])
def test_tool_choice_modes(choice: str, mode: str) -> None:
    tools = [{"type": "function", "function": {"name": "w"}}]
    data = body({"messages": [user()], "tools": tools, "tool_choice": choice})
    assert data["toolConfig"] == {"functionCallingConfig": {"mode": mode}}


def test_images_inline_or_as_file_uris() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}]
    assert body({"messages": [{"role": "user", "content": parts}]})["contents"][0]["parts"] == [
        {"inlineData": {"mimeType": "image/jpeg", "data": "AAAA"}}
    ]
    gcs = [{"type": "image_url", "image_url": {"url": "gs://bucket/cat.png"}}]
    assert body({"messages": [{"role": "user", "content": gcs}]}, VERTEX)["contents"][0]["parts"] == [
        {"fileData": {"mimeType": "image/png", "fileUri": "gs://bucket/cat.png"}}
    ]
    with pytest.raises(Untranslatable) as refused:
        CODEC.request({"messages": [{"role": "user", "content": gcs}]}, API)
    assert refused.value.param == "messages[0].content[0].image_url"


def test_json_output_and_thinking_and_cached_content() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    data = body(
        {
            "messages": [user()],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            "reasoning_effort": "medium",
            "cached_content": "cachedContents/abc",
        }
    )
    assert data["generationConfig"] == {
        "responseMimeType": "application/json",
        "responseJsonSchema": schema,
        "thinkingConfig": {"thinkingBudget": 8192, "includeThoughts": True},
    }
    assert data["cachedContent"] == "cachedContents/abc"
    off = body({"messages": [user()], "reasoning_effort": "none", "response_format": {"type": "json_object"}})
    assert off["generationConfig"] == {
        "responseMimeType": "application/json",
        "thinkingConfig": {"thinkingBudget": 0, "includeThoughts": False},
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", True),
        ("top_logprobs", 3),
        ("logit_bias", {"1": 1}),
        ("parallel_tool_calls", False),
        ("user", "u-1"),
        ("metadata", {"k": "v"}),
        ("top_k", 4),
    ],
)
def test_untranslatable_fields_are_refused_by_name_or_listed_when_dropping_is_allowed(field: str, value: Any) -> None:
    chat = {"messages": [user()], field: value}
    with pytest.raises(Untranslatable) as refused:
        CODEC.request(chat, API)
    assert refused.value.param == field
    assert CODEC.request(chat, ProviderTarget(model=API.model, allow_drop=True)).dropped == (field,)


def test_an_answer_becomes_a_chat_completion_with_cached_and_thought_tokens() -> None:
    answer = {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "pondering", "thought": True},
                        {"text": "Let me check."},
                        {"functionCall": {"name": "w", "args": {"city": "Paris"}}},
                    ],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 1200,
            "cachedContentTokenCount": 1000,
            "candidatesTokenCount": 30,
            "thoughtsTokenCount": 12,
            "totalTokenCount": 1242,
        },
        "modelVersion": "gemini-2.5-flash",
    }
    completion, usage = CODEC.answer(orjson.dumps(answer), API)
    parsed = ChatCompletion.model_validate(completion)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "w"  # type: ignore[union-attr]
    assert completion["choices"][0]["message"]["reasoning_content"] == "pondering"
    assert (usage.input_tokens, usage.cache_read_tokens, usage.output_tokens, usage.reasoning_tokens) == (
        1200,
        1000,
        42,
        12,
    )
    assert completion["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}


def test_a_blocked_prompt_is_a_content_filter_finish() -> None:
    completion, _ = CODEC.answer(
        b'{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":3}}', API
    )
    assert ChatCompletion.model_validate(completion).choices[0].finish_reason == "content_filter"


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)


def test_a_stream_becomes_chunks_with_usage_last() -> None:
    data = _sse(
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}], "responseId": "r1"},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]}, "index": 0}]},
        {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"functionCall": {"name": "w", "args": {}}}]},
                    "finishReason": "STOP",
                }
            ],
            "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 6, "totalTokenCount": 10},
        },
    )
    decoder = CODEC.stream(API)
    chunks = []
    for i in range(0, len(data), 5):
        chunks.extend(decoder.feed(data[i : i + 5]))
    chunks.extend(decoder.close())
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert {c["id"] for c in chunks} == {"chatcmpl-r1"}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == "Hello"
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["w"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10


def test_an_error_event_mid_stream_raises_and_a_cut_stream_is_an_error() -> None:
    decoder = CODEC.stream(API)
    decoder.feed(_sse({"candidates": [{"content": {"parts": [{"text": "a"}]}}]}))
    with pytest.raises(ProviderStreamError) as raised:
        decoder.feed(_sse({"error": {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}}))
    assert raised.value.error.kind == "overloaded_error" and raised.value.error.retryable
    cut = CODEC.stream(API)
    cut.feed(_sse({"candidates": [{"content": {"parts": [{"text": "a"}]}}]}))
    with pytest.raises(ProviderStreamError, match="before a finishReason"):
        cut.close()


def test_errors_and_their_retry_delay() -> None:
    throttled = {
        "error": {
            "code": 429,
            "message": "quota",
            "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "17s"}],
        }
    }
    error = CODEC.error(429, {}, orjson.dumps(throttled))
    assert (error.status, error.kind, error.retryable, error.retry_after_s) == (429, "rate_limit_error", True, 17.0)
    bad_key = CODEC.error(400, {}, b'{"error":{"code":400,"message":"API key not valid","status":"INVALID_ARGUMENT"}}')
    assert (bad_key.kind, bad_key.retryable) == ("invalid_request_error", False)
    unauthenticated = CODEC.error(401, {}, b'{"error":{"code":401,"message":"expired","status":"UNAUTHENTICATED"}}')
    assert unauthenticated.kind == "authentication_error"
    assert CODEC.error(502, {"Retry-After": "2"}, b"<html>bad gateway</html>").retry_after_s == 2.0


def test_a_thought_signature_rides_in_the_tool_call_id_and_comes_back() -> None:
    signature = "q+/w" * 10 + "AB=="
    answer = {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [{"functionCall": {"name": "w", "args": {}}, "thoughtSignature": signature}],
                },
                "finishReason": "STOP",
            }
        ]
    }
    completion, _ = CODEC.answer(orjson.dumps(answer), API)
    call = completion["choices"][0]["message"]["tool_calls"][0]
    assert set(call["id"]) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
    assert unpack_call_id(call["id"]) == ("call_0_0", signature)
    data = body(
        {
            "messages": [
                user("weather?"),
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
            ]
        }
    )
    assert data["contents"][1]["parts"] == [
        {"functionCall": {"name": "w", "args": {}, "id": "call_0_0"}, "thoughtSignature": signature}
    ]
    assert data["contents"][2]["parts"][0]["functionResponse"]["id"] == "call_0_0"
    assert unpack_call_id("plain-id") == ("plain-id", None) and pack_call_id("plain-id", None) == "plain-id"


def test_audio_and_inline_files_go_inline_and_uploaded_file_ids_are_refused() -> None:
    parts = [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
    ]
    assert body({"messages": [{"role": "user", "content": parts}]})["contents"][0]["parts"] == [
        {"inlineData": {"mimeType": "audio/wav", "data": "UklGRg=="}},
        {"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0="}},
    ]
    uploaded = [{"type": "file", "file": {"file_id": "file-abc"}}]
    with pytest.raises(Untranslatable) as refused:
        CODEC.request({"messages": [{"role": "user", "content": uploaded}]}, API)
    assert refused.value.param == "messages[0].content[0].file"


def test_base_urls_follow_the_api_and_the_vertex_location() -> None:
    assert base_url(API.model) == "https://generativelanguage.googleapis.com"
    assert base_url(VERTEX.model) == "https://us-central1-aiplatform.googleapis.com"
    assert base_url("projects/p/locations/global/publishers/google/models/m") == "https://aiplatform.googleapis.com"
