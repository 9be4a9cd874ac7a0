"""The Anthropic stand-in checked by the official `anthropic` SDK: its shapes are the SDK's shapes."""

from __future__ import annotations

import uuid
from typing import Any

import anthropic
import httpx
import pytest

from tests.sim.hosted.standin import StandIn, standin

pytestmark = pytest.mark.e2e  # each test starts a stand-in process

TOOL: Any = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def client(url: str, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=kwargs.pop("api_key", "test-key"), max_retries=0, **kwargs)


def long_system(tag: str) -> str:
    """A system prompt past the 1024-token caching minimum, unique per test."""
    return f"[{tag}] " + "You are a careful assistant who answers briefly. " * 120


def test_plain_message(anthropic_standin: StandIn) -> None:
    raw = client(anthropic_standin.url).messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=20, messages=[{"role": "user", "content": "Hello"}]
    )
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 20
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert int(raw.headers["anthropic-ratelimit-requests-remaining"]) > 0
    assert raw.headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
    assert raw.headers["request-id"].startswith("req_")


def test_same_prompt_same_answer(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    args: dict[str, Any] = {"model": "m", "max_tokens": 30, "messages": [{"role": "user", "content": "Same"}]}
    assert sdk.messages.create(**args).content == sdk.messages.create(**args).content


def test_stream_matches_final_message(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    with sdk.messages.stream(model="m", max_tokens=12, messages=[{"role": "user", "content": "Stream"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens == len(text.split(" "))
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequence(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    args: dict[str, Any] = {"model": "m", "max_tokens": 30, "messages": [{"role": "user", "content": "Stop"}]}
    first = sdk.messages.create(**args)
    assert first.content[0].type == "text"
    words = first.content[0].text.split(" ")
    cut = sdk.messages.create(**args, stop_sequences=[" " + words[3]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == " " + words[3]
    assert cut.content[0].type == "text" and cut.content[0].text == " ".join(words[:3])


def test_tool_use_round_trip(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    question: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = sdk.messages.create(model="m", max_tokens=50, tools=[TOOL], messages=question)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    follow = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    second = sdk.messages.create(model="m", max_tokens=50, tools=[TOOL], messages=follow)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"


def test_streamed_tool_use_assembles(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    with sdk.messages.stream(
        model="m",
        max_tokens=50,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    use = final.content[0]
    assert use.type == "tool_use" and isinstance(use.input, dict) and "city" in use.input


def test_thinking_block(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    with sdk.messages.stream(
        model="m",
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Think"}],
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    thinking = final.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert final.usage.output_tokens_details is not None
    assert 0 < final.usage.output_tokens_details.thinking_tokens < final.usage.output_tokens


def test_structured_output(anthropic_standin: StandIn) -> None:
    schema: Any = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    message = client(anthropic_standin.url).messages.create(
        model="m",
        max_tokens=100,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "JSON please"}],
    )
    import json

    assert message.content[0].type == "text"
    assert set(json.loads(message.content[0].text)) == {"name", "age"}


def test_cache_write_then_read(anthropic_standin: StandIn) -> None:
    sdk = client(anthropic_standin.url)
    system: Any = [{"type": "text", "text": long_system(uuid.uuid4().hex), "cache_control": {"type": "ephemeral"}}]
    args: dict[str, Any] = {"model": "m", "max_tokens": 5, "system": system}
    first = sdk.messages.create(**args, messages=[{"role": "user", "content": "One"}])
    second = sdk.messages.create(**args, messages=[{"role": "user", "content": "Two"}])
    written = first.usage.cache_creation_input_tokens
    assert written and written >= 1024 and first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation is not None and first.usage.cache_creation.ephemeral_5m_input_tokens == written
    assert second.usage.cache_read_input_tokens == written and second.usage.cache_creation_input_tokens == 0


def test_one_hour_cache_and_lookback(anthropic_standin: StandIn) -> None:
    """A 1 h breakpoint is written as a 1 h write; a later request whose breakpoint moved on reads the
    earlier prefix (Anthropic looks back over earlier block boundaries)."""
    sdk = client(anthropic_standin.url)
    text = long_system(uuid.uuid4().hex)
    mark = {"type": "ephemeral", "ttl": "1h"}
    turn: Any = {"role": "user", "content": [{"type": "text", "text": text, "cache_control": mark}]}
    first = sdk.messages.create(model="m", max_tokens=5, messages=[turn])
    assert first.usage.cache_creation is not None
    written = first.usage.cache_creation.ephemeral_1h_input_tokens
    assert written >= 1024 and first.usage.cache_creation.ephemeral_5m_input_tokens == 0
    moved: Any = [
        {"role": "user", "content": [{"type": "text", "text": text}]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [{"type": "text", "text": "And then?", "cache_control": {"type": "ephemeral"}}]},
    ]
    second = sdk.messages.create(model="m", max_tokens=5, messages=moved)
    assert second.usage.cache_read_input_tokens == written
    assert second.usage.cache_creation_input_tokens and second.usage.cache_creation_input_tokens > 0


def test_count_tokens(anthropic_standin: StandIn) -> None:
    counted = client(anthropic_standin.url).messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "x" * 400}]
    )
    assert counted.input_tokens == 100


def raw_post(url: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=10)


def test_refuses_what_the_api_refuses(anthropic_standin: StandIn) -> None:
    url = anthropic_standin.url
    ok_headers = {"x-api-key": "test-key", "anthropic-version": "2023-06-01"}
    hello = [{"role": "user", "content": "Hi"}]
    missing = raw_post(url, {"model": "m", "messages": hello}, ok_headers)
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    assert missing.json()["error"]["type"] == "invalid_request_error" and missing.json()["type"] == "error"
    no_version = raw_post(url, {"model": "m", "max_tokens": 5, "messages": hello}, {"x-api-key": "test-key"})
    assert no_version.status_code == 400 and "anthropic-version" in no_version.json()["error"]["message"]
    no_key = raw_post(url, {"model": "m", "max_tokens": 5, "messages": hello}, {"anthropic-version": "2023-06-01"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    beta = raw_post(url, {"model": "m", "max_tokens": 5, "messages": hello}, {**ok_headers, "anthropic-beta": "nope-1"})
    assert beta.status_code == 400
    known_beta = {**ok_headers, "anthropic-beta": "extended-cache-ttl-2025-04-11"}
    assert raw_post(url, {"model": "m", "max_tokens": 5, "messages": hello}, known_beta).status_code == 200
    old = raw_post(url, {"model": "m", "max_tokens": 5, "temperature": 0.5, "messages": hello}, ok_headers)
    assert old.status_code == 200
    dangling = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": "no result"},
    ]
    unanswered = raw_post(url, {"model": "m", "max_tokens": 5, "messages": dangling}, ok_headers)
    assert unanswered.status_code == 400 and "tool_result" in unanswered.json()["error"]["message"]


def test_sdk_errors(anthropic_standin: StandIn) -> None:
    hello: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.AuthenticationError):
        client(anthropic_standin.url, api_key="wrong").messages.create(model="m", max_tokens=5, messages=hello)
    with pytest.raises(anthropic.BadRequestError, match="temperature"):  # the SDK's own version rejects sampling
        client(anthropic_standin.url).messages.create(
            model="m", max_tokens=5, messages=hello, extra_body={"temperature": 0.5}
        )
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client(anthropic_standin.url).messages.create(
            model="m", max_tokens=1000, messages=hello, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    anthropic_standin.fault(529)
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        client(anthropic_standin.url).messages.create(model="m", max_tokens=5, messages=hello)
    assert overloaded.value.status_code == 529
    assert isinstance(overloaded.value.body, dict) and overloaded.value.body["error"]["type"] == "overloaded_error"


def test_rate_limited() -> None:
    hello: Any = [{"role": "user", "content": "Hi"}]
    with standin("anthropic", "--rpm", "2") as running:
        sdk = client(running.url)
        for _ in range(2):
            sdk.messages.create(model="m", max_tokens=5, messages=hello)
        with pytest.raises(anthropic.RateLimitError) as limited:
            sdk.messages.create(model="m", max_tokens=5, messages=hello)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
        usage = running.usage()
    assert usage["total"]["requests"] == 2 and usage["total"]["refused"] == 1  # type: ignore[index]


def test_mid_stream_error() -> None:
    with standin("anthropic", "--fail-after-tokens", "3") as running:
        sdk = client(running.url)
        hello: Any = [{"role": "user", "content": "Hi"}]
        with (
            pytest.raises(anthropic.APIStatusError, match="Overloaded"),
            sdk.messages.stream(model="m", max_tokens=30, messages=hello) as stream,
        ):
            for _ in stream:
                pass


def test_usage_tally() -> None:
    with standin("anthropic", "--models", "claude-a,claude-b") as running:
        sdk = client(running.url)
        one = sdk.messages.create(model="claude-a", max_tokens=7, messages=[{"role": "user", "content": "A"}])
        with pytest.raises(anthropic.NotFoundError):
            sdk.messages.create(model="claude-z", max_tokens=7, messages=[{"role": "user", "content": "Z"}])
        tally: Any = running.usage()
    assert tally["provider"] == "anthropic"
    assert tally["models"]["claude-a"]["input_tokens"] == one.usage.input_tokens
    assert tally["models"]["claude-a"]["output_tokens"] == one.usage.output_tokens
