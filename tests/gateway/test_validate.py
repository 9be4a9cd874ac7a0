from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.http.shapes import validate_body

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
    error = caught.value.body()["error"]
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"


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


@pytest.mark.parametrize(
    ("api", "extra", "param"),
    [
        pytest.param("chat", {"temperature": 2.5}, "temperature", id="temperature-above-2"),
        pytest.param("chat", {"temperature": -0.1}, "temperature", id="temperature-negative"),
        pytest.param("chat", {"top_p": 1.5}, "top_p", id="top-p-above-1"),
        pytest.param("chat", {"top_p": -1}, "top_p", id="top-p-negative"),
        pytest.param("chat", {"presence_penalty": 3}, "presence_penalty", id="presence-above-2"),
        pytest.param("chat", {"frequency_penalty": -2.5}, "frequency_penalty", id="frequency-below-minus-2"),
        pytest.param("chat", {"n": 129}, "n", id="n-above-128"),
        pytest.param("chat", {"logprobs": 3}, "logprobs", id="chat-logprobs-not-bool"),
        pytest.param("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top-logprobs-above-20"),
        pytest.param("chat", {"top_logprobs": 2}, "top_logprobs", id="top-logprobs-without-logprobs"),
        pytest.param("completions", {"logprobs": 21}, "logprobs", id="completions-logprobs-above-20"),
        pytest.param("completions", {"logprobs": -1}, "logprobs", id="completions-logprobs-negative"),
        pytest.param("completions", {"best_of": 2, "n": 3}, "best_of", id="best-of-below-n"),
        pytest.param("chat", {"model": "m" * 257}, "model", id="model-too-long"),
        pytest.param("chat", {"metadata": {"k": 1}}, "metadata", id="metadata-value-not-string"),
        pytest.param("chat", {"metadata": {"k": "v" * 513}}, "metadata", id="metadata-value-too-long"),
        pytest.param("chat", {"metadata": {str(i): "v" for i in range(17)}}, "metadata", id="metadata-too-many"),
        pytest.param("chat", {"metadata": "x"}, "metadata", id="metadata-not-object"),
    ],
)
def test_parameters_outside_their_documented_ranges_are_400(api: Any, extra: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = CHAT if api == "chat" else {"model": "m", "prompt": "hi"}
    with pytest.raises(InvalidRequest) as caught:
        validate_body(api, {**base, **extra})
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({**CHAT, "temperature": 0, "top_p": 1, "n": 128}, id="edges-of-ranges"),
        pytest.param({**CHAT, "presence_penalty": -2, "frequency_penalty": 2.0}, id="penalty-edges"),
        pytest.param({**CHAT, "logprobs": True, "top_logprobs": 20}, id="top-logprobs-20"),
        pytest.param({**CHAT, "metadata": {"team": "a" * 512}}, id="metadata-at-bounds"),
    ],
)
def test_parameters_at_the_edges_of_their_ranges_pass(body: dict[str, Any]) -> None:
    assert validate_body("chat", body) is body


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        pytest.param("embeddings", {"model": "m", "input": [-5, 3]}, "input", id="embedding-negative-id"),
        pytest.param("embeddings", {"model": "m", "input": [[1], [-1]]}, "input", id="embedding-negative-id-nested"),
        pytest.param("embeddings", {"model": "m", "input": [2**31]}, "input", id="embedding-id-above-int32"),
        pytest.param("embeddings", {"model": "m", "input": [[]]}, "input", id="embedding-empty-nested"),
        pytest.param("completions", {"model": "m", "prompt": [2**40]}, "prompt", id="prompt-id-above-int32"),
    ],
)
def test_token_ids_no_engine_could_hold_are_400(api: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_body(api, body)
    assert caught.value.param == param
