"""The Bedrock codec as pure functions: chat → Converse bodies, refusals, answers, streams and errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.hosted.aws import encode_event, encode_exception
from backends.hosted.base import ProviderStreamError, ProviderTarget, Untranslatable
from backends.hosted.bedrock import BedrockCodec, endpoint_url, pack_call_id, unpack_call_id

CODEC = BedrockCodec()
CLAUDE = ProviderTarget(model="anthropic.claude-3-5-haiku-20241022-v1:0")
NOVA = ProviderTarget(model="amazon.nova-lite-v1:0")
PNG = "iVBORw0KGgo="


def body(chat: dict[str, Any], target: ProviderTarget = CLAUDE) -> dict[str, Any]:
    call = CODEC.request(chat, target)
    data: dict[str, Any] = orjson.loads(call.body)
    return data


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_path_encodes_the_model_id_and_picks_the_operation() -> None:
    call = CODEC.request({"messages": [user()]}, CLAUDE)
    assert call.method == "POST"
    assert call.path == "/model/anthropic.claude-3-5-haiku-20241022-v1%3A0/converse"
    assert not call.stream
    streamed = CODEC.request({"messages": [user()], "stream": True}, CLAUDE)
    assert streamed.path.endswith("/converse-stream") and streamed.stream
    assert ("accept", "application/vnd.amazon.eventstream") in streamed.headers


def test_system_messages_are_hoisted_and_sampling_goes_to_inference_config() -> None:
    data = body(
        {
            "messages": [{"role": "system", "content": "be brief"}, user(), {"role": "developer", "content": "rule"}],
            "max_completion_tokens": 100,
            "temperature": 0.2,
            "top_p": 0.9,
            "stop": "END",
            "user": "u-1",
        }
    )
    assert data["system"] == [{"text": "be brief"}, {"text": "rule"}]
    assert data["messages"] == [{"role": "user", "content": [{"text": "hi"}]}]
    assert data["inferenceConfig"] == {"maxTokens": 100, "temperature": 0.2, "topP": 0.9, "stopSequences": ["END"]}
    assert data["requestMetadata"] == {"user": "u-1"}


def test_tool_calls_and_results_become_tool_use_blocks_in_alternating_turns() -> None:
    data = body(
        {
            "messages": [
                user("weather in Paris and Rome?"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city":"Paris"}'}},
                        {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city":"Rome"}'}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "w"}},
        }
    )
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user"]
    assert data["messages"][1]["content"][0] == {
        "toolUse": {"toolUseId": "c1", "name": "w", "input": {"city": "Paris"}}
    }
    assert data["messages"][2]["content"] == [
        {"toolResult": {"toolUseId": "c1", "content": [{"text": "sunny"}]}},
        {"toolResult": {"toolUseId": "c2", "content": [{"text": "rain"}]}},
    ]
    spec = data["toolConfig"]["tools"][0]["toolSpec"]
    assert spec["name"] == "w" and spec["description"] == "weather"
    assert spec["inputSchema"] == {"json": {"type": "object", "properties": {}}}
    assert data["toolConfig"]["toolChoice"] == {"tool": {"name": "w"}}


def test_tool_choice_required_is_any_and_none_drops_unused_tools() -> None:
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    assert body({"messages": [user()], "tools": tools, "tool_choice": "required"})["toolConfig"]["toolChoice"] == {
        "any": {}
    }
    assert "toolConfig" not in body({"messages": [user()], "tools": tools, "tool_choice": "none"})


def test_cache_control_becomes_cache_points_after_the_marked_block() -> None:
    marker = {"type": "ephemeral"}
    data = body(
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "long system", "cache_control": marker}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "doc", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                        {"type": "text", "text": "question"},
                    ],
                },
            ],
            "tools": [{"type": "function", "function": {"name": "w"}, "cache_control": marker}],
        }
    )
    assert data["system"] == [{"text": "long system"}, {"cachePoint": {"type": "default"}}]
    assert data["messages"][0]["content"] == [
        {"text": "doc"},
        {"cachePoint": {"type": "default", "ttl": "1h"}},
        {"text": "question"},
    ]
    assert data["toolConfig"]["tools"][1] == {"cachePoint": {"type": "default"}}


def test_images_go_as_bytes_or_s3_and_web_urls_are_refused() -> None:
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "s3://bucket/cat.jpg"}},
    ]
    content = body({"messages": [{"role": "user", "content": parts}]})["messages"][0]["content"]
    assert content == [
        {"image": {"format": "png", "source": {"bytes": PNG}}},
        {"image": {"format": "jpeg", "source": {"s3Location": {"uri": "s3://bucket/cat.jpg"}}}},
    ]
    web = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, {"type": "text", "text": "?"}],
    }
    with pytest.raises(Untranslatable) as refused:
        CODEC.request({"messages": [web]}, CLAUDE)
    assert refused.value.param == "messages[0].content[0].image_url"


def test_json_schema_output_goes_to_output_config() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    data = body(
        {
            "messages": [user()],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
    )
    definition = data["outputConfig"]["textFormat"]["structure"]["jsonSchema"]
    assert data["outputConfig"]["textFormat"]["type"] == "json_schema"
    assert orjson.loads(definition["schema"]) == schema and definition["name"] == "x"


def test_reasoning_effort_is_a_thinking_budget_under_the_token_limit() -> None:
    data = body({"messages": [user()], "reasoning_effort": "high", "max_tokens": 8000})
    assert data["additionalModelRequestFields"] == {"thinking": {"type": "enabled", "budget_tokens": 7999}}
    data = body({"messages": [user()], "reasoning_effort": "low", "max_tokens": 8000})
    assert data["additionalModelRequestFields"]["thinking"]["budget_tokens"] == 2048
    assert "additionalModelRequestFields" not in body({"messages": [user()], "reasoning_effort": "none"})
    with pytest.raises(Untranslatable, match="token limit"):
        CODEC.request({"messages": [user()], "reasoning_effort": "low", "max_tokens": 500}, CLAUDE)
    with pytest.raises(Untranslatable) as refused:
        CODEC.request({"messages": [user()], "reasoning_effort": "low"}, NOVA)
    assert refused.value.param == "reasoning_effort"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("seed", 7),
        ("logit_bias", {"1": 2}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
        ("top_k", 5),
    ],
)
def test_untranslatable_fields_are_refused_by_name_or_listed_when_dropping_is_allowed(field: str, value: Any) -> None:
    chat = {"messages": [user()], field: value}
    with pytest.raises(Untranslatable) as refused:
        CODEC.request(chat, CLAUDE)
    assert refused.value.param == field
    call = CODEC.request(chat, ProviderTarget(model=CLAUDE.model, allow_drop=True))
    assert call.dropped == (field,)


def test_harmless_defaults_are_not_refused() -> None:
    call = CODEC.request(
        {"messages": [user()], "n": 1, "logprobs": False, "parallel_tool_calls": True, "store": False}, CLAUDE
    )
    assert call.dropped == ()


def test_an_answer_becomes_a_chat_completion_with_cache_and_reasoning_usage() -> None:
    answer = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [
                    {"reasoningContent": {"reasoningText": {"text": "hmm let me see", "signature": "s"}}},
                    {"text": "Calling."},
                    {"toolUse": {"toolUseId": "t1", "name": "w", "input": {"city": "Paris"}}},
                ],
            }
        },
        "stopReason": "tool_use",
        "usage": {
            "inputTokens": 10,
            "outputTokens": 20,
            "totalTokens": 1530,
            "cacheReadInputTokens": 1000,
            "cacheWriteInputTokens": 500,
            "cacheDetails": [{"ttl": "1h", "inputTokens": 500}],
        },
        "metrics": {"latencyMs": 5},
    }
    completion, usage = CODEC.answer(orjson.dumps(answer), CLAUDE)
    parsed = ChatCompletion.model_validate(completion)
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert parsed.choices[0].message.content == "Calling."
    assert parsed.choices[0].message.tool_calls[0].function.arguments == '{"city":"Paris"}'  # type: ignore[index,union-attr]
    assert completion["choices"][0]["message"]["reasoning_content"] == "hmm let me see"
    assert (usage.input_tokens, usage.cache_read_tokens, usage.cache_write_tokens, usage.cache_write_1h_tokens) == (
        1510,
        1000,
        0,
        500,
    )
    assert usage.output_tokens == 20 and 0 < usage.reasoning_tokens <= 20
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == 1000


def _frames(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(encode_event(name, orjson.dumps(payload)) for name, payload in events)


def test_a_stream_becomes_chunks_with_text_tool_deltas_and_usage_last() -> None:
    data = _frames(
        ("messageStart", {"role": "assistant"}),
        ("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hel"}}),
        ("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "lo"}}),
        ("contentBlockStop", {"contentBlockIndex": 0}),
        ("contentBlockStart", {"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "t1", "name": "w"}}}),
        ("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"ci'}}}),
        ("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": 'ty":"P"}'}}}),
        ("contentBlockStop", {"contentBlockIndex": 1}),
        ("messageStop", {"stopReason": "tool_use"}),
        ("metadata", {"usage": {"inputTokens": 5, "outputTokens": 7, "totalTokens": 12}, "metrics": {"latencyMs": 1}}),
    )
    decoder = CODEC.stream(CLAUDE)
    chunks = []
    for i in range(0, len(data), 7):  # frames split across reads
        chunks.extend(decoder.feed(data[i : i + 7]))
    chunks.extend(decoder.close())
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == "Hello"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"] == "t1" and calls[0]["function"]["name"] == "w"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"P"}'
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 12
    assert decoder.usage is not None and decoder.usage.output_tokens == 7


def test_an_exception_frame_mid_stream_raises_the_providers_error() -> None:
    decoder = CODEC.stream(CLAUDE)
    decoder.feed(_frames(("messageStart", {"role": "assistant"})))
    with pytest.raises(ProviderStreamError) as raised:
        decoder.feed(encode_exception("throttlingException", b'{"message":"Too many tokens"}'))
    assert raised.value.error.kind == "rate_limit_error" and raised.value.error.retryable


def test_a_stream_cut_before_message_stop_is_an_error() -> None:
    decoder = CODEC.stream(CLAUDE)
    decoder.feed(_frames(("messageStart", {"role": "assistant"})) + encode_event("contentBlockDelta", b"{}")[:9])
    with pytest.raises(ProviderStreamError, match="before messageStop"):
        decoder.close()


@pytest.mark.parametrize(
    ("status", "name", "kind", "retryable", "answer_status"),
    [
        (429, "ThrottlingException", "rate_limit_error", True, 429),
        (429, "ModelNotReadyException", "overloaded_error", True, 503),
        (400, "ValidationException", "invalid_request_error", False, 400),
        (403, "ExpiredTokenException", "authentication_error", False, 401),
        (503, "ServiceUnavailableException", "overloaded_error", True, 503),
    ],
)
def test_errors_are_read_from_the_error_type_header(
    status: int, name: str, kind: str, retryable: bool, answer_status: int
) -> None:
    headers = {"X-Amzn-ErrorType": f"{name}:http://internal.amazon.com/coral/com.amazon.bedrock/", "Retry-After": "3"}
    error = CODEC.error(status, headers, b'{"message":"nope"}')
    assert (error.status, error.kind, error.retryable) == (answer_status, kind, retryable)
    assert error.message == f"{name}: nope" and error.retry_after_s == 3.0


def test_a_thinking_signature_rides_in_the_first_tool_call_id_and_rebuilds_the_block() -> None:
    signature = "c2lnbmF0dXJl+/=="
    answer = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [
                    {"reasoningContent": {"reasoningText": {"text": "think", "signature": signature}}},
                    {"toolUse": {"toolUseId": "tooluse_1", "name": "w", "input": {}}},
                ],
            }
        },
        "stopReason": "tool_use",
        "usage": {"inputTokens": 1, "outputTokens": 2, "totalTokens": 3},
    }
    completion, _ = CODEC.answer(orjson.dumps(answer), CLAUDE)
    message = completion["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    assert set(call_id) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
    assert unpack_call_id(call_id) == ("tooluse_1", signature)
    loop = {
        "messages": [
            user("weather?"),
            {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": message["tool_calls"]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "w"}}],
        "reasoning_effort": "low",
        "max_tokens": 4000,
    }
    data = body(loop)
    assert data["messages"][1]["content"][0] == {
        "reasoningContent": {"reasoningText": {"text": "think", "signature": signature}}
    }
    assert data["messages"][1]["content"][1]["toolUse"]["toolUseId"] == "tooluse_1"
    assert data["messages"][2]["content"][0]["toolResult"]["toolUseId"] == "tooluse_1"
    assert data["additionalModelRequestFields"]["thinking"]["budget_tokens"] == 2048
    assert pack_call_id("x", None) == "x" and unpack_call_id("bts-9-short") == ("bts-9-short", None)


def test_a_tool_loop_without_its_thinking_block_cannot_think() -> None:
    loop = {
        "messages": [
            user("weather?"),
            {
                "role": "assistant",
                "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "w"}}],
        "reasoning_effort": "low",
        "max_tokens": 4000,
    }
    with pytest.raises(Untranslatable) as refused:
        CODEC.request(loop, CLAUDE)
    assert refused.value.param == "reasoning_effort"
    call = CODEC.request(loop, ProviderTarget(model=CLAUDE.model, allow_drop=True))
    assert call.dropped == ("reasoning_effort",)
    assert "additionalModelRequestFields" not in orjson.loads(call.body)


def test_inline_documents_become_document_blocks_and_uploaded_files_are_refused() -> None:
    part = {
        "type": "file",
        "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "Q3 report_v2.pdf"},
    }
    content = body({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "sum up"}]}]})["messages"][
        0
    ]["content"]
    assert content[0] == {"document": {"format": "pdf", "name": "Q3 report v2", "source": {"bytes": "JVBERi0="}}}
    uploaded = {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}
    with pytest.raises(Untranslatable) as refused:
        CODEC.request({"messages": [uploaded]}, CLAUDE)
    assert refused.value.param == "messages[0].content[0].file"


def test_the_regional_endpoint() -> None:
    assert endpoint_url("eu-central-1") == "https://bedrock-runtime.eu-central-1.amazonaws.com"
