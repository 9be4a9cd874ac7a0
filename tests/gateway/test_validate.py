from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.validate import validate_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        pytest.param("chat", [], None, id="not-an-object"),
        pytest.param("chat", {"messages": CHAT["messages"]}, "model", id="missing-model"),
        pytest.param("chat", {**CHAT, "model": 3}, "model", id="model-not-string"),
        pytest.param("chat", {**CHAT, "model": ""}, "model", id="model-empty"),
        pytest.param("chat", {"model": "m"}, "messages", id="missing-messages"),
        pytest.param("chat", {"model": "m", "messages": []}, "messages", id="empty-messages"),
        pytest.param("chat", {"model": "m", "messages": "hi"}, "messages", id="messages-not-array"),
        pytest.param("chat", {"model": "m", "messages": ["hi"]}, "messages[0]", id="message-not-object"),
        pytest.param(
            "chat", {"model": "m", "messages": [{"role": "boss", "content": "x"}]}, "messages[0].role", id="bad-role"
        ),
        pytest.param(
            "chat", {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", id="missing-content"
        ),
        pytest.param(
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            id="content-wrong-type",
        ),
        pytest.param("chat", {**CHAT, "stream": "yes"}, "stream", id="stream-not-bool"),
        pytest.param(
            "chat",
            {**CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
            id="stream-options-without-stream",
        ),
        pytest.param("chat", {**CHAT, "max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
        pytest.param("chat", {**CHAT, "max_tokens": "10"}, "max_tokens", id="max-tokens-string"),
        pytest.param("chat", {**CHAT, "max_tokens": True}, "max_tokens", id="max-tokens-bool"),
        pytest.param("chat", {**CHAT, "n": -1}, "n", id="n-negative"),
        pytest.param("chat", {**CHAT, "temperature": "hot"}, "temperature", id="temperature-string"),
        pytest.param("chat", {**CHAT, "user": 7}, "user", id="user-not-string"),
        pytest.param("completions", {"model": "m"}, "prompt", id="missing-prompt"),
        pytest.param("completions", {"model": "m", "prompt": 5}, "prompt", id="prompt-number"),
        pytest.param("completions", {"model": "m", "prompt": [1, "a"]}, "prompt", id="prompt-mixed"),
        pytest.param("embeddings", {"model": "m"}, "input", id="missing-input"),
        pytest.param("embeddings", {"model": "m", "input": ""}, "input", id="empty-input"),
    ],
)
def test_bad_bodies_name_the_field(api: Any, body: Any, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_body(api, body)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("api", "body"),
    [
        pytest.param("chat", CHAT, id="chat-minimal"),
        pytest.param("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, id="chat-stream"),
        pytest.param(
            "chat",
            {
                "model": "m",
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": []},
                    {"role": "user", "content": [{"type": "text", "text": "x"}]},
                ],
            },
            id="chat-parts-and-tool-calls",
        ),
        pytest.param("completions", {"model": "m", "prompt": "hello"}, id="completion-text"),
        pytest.param("completions", {"model": "m", "prompt": [1, 2, 3]}, id="completion-ids"),
        pytest.param("embeddings", {"model": "m", "input": ["a", "b"]}, id="embeddings-list"),
        pytest.param("chat", {**CHAT, "max_tokens": None, "extra_engine_field": {"x": 1}}, id="unknown-fields-pass"),
    ],
)
def test_good_bodies_pass(api: Any, body: Any) -> None:
    assert validate_body(api, body) is body
