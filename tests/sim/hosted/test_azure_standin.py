"""The Azure OpenAI stand-in checked by the official `openai` SDK's `AzureOpenAI` (and `OpenAI` on the v1 API)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.sim.hosted.standin import StandIn, standin

pytestmark = pytest.mark.e2e  # each test starts a stand-in process

VERSION = "2024-10-21"
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def azure(url: str, **kwargs: Any) -> openai.AzureOpenAI:
    if "azure_ad_token" not in kwargs:
        kwargs.setdefault("api_key", "test-key")
    return openai.AzureOpenAI(azure_endpoint=url, api_version=VERSION, max_retries=0, **kwargs)


def test_deployment_completion(azure_standin: StandIn) -> None:
    raw = azure(azure_standin.url).chat.completions.with_raw_response.create(
        model="gpt-4o-prod", messages=[{"role": "user", "content": "Hello"}], max_tokens=10
    )
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    assert 0 < completion.usage.completion_tokens <= 10
    assert completion.model_extra and "prompt_filter_results" in completion.model_extra
    assert int(raw.headers["x-ratelimit-remaining-requests"]) > 0 and raw.headers["apim-request-id"]


def test_entra_bearer_and_v1_api(azure_standin: StandIn) -> None:
    hello: Any = [{"role": "user", "content": "Hi"}]
    by_token = azure(azure_standin.url, azure_ad_token="test-key").chat.completions.create(
        model="dep", messages=hello, max_completion_tokens=4
    )
    assert by_token.choices[0].message.content
    v1 = openai.OpenAI(base_url=azure_standin.url + "/openai/v1/", api_key="test-key", max_retries=0)
    answer = v1.chat.completions.create(model="dep", messages=hello, max_tokens=4)
    assert answer.model == "dep" and answer.choices[0].message.content


def test_stream_with_usage(azure_standin: StandIn) -> None:
    stream = azure(azure_standin.url).chat.completions.create(
        model="dep",
        messages=[{"role": "user", "content": "Stream"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices == [] and chunks[0].model_extra and "prompt_filter_results" in chunks[0].model_extra
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(text.split(" "))


def test_tools_round_trip_and_stream(azure_standin: StandIn) -> None:
    sdk = azure(azure_standin.url)
    question: list[Any] = [{"role": "user", "content": "Weather?"}]
    first = sdk.chat.completions.create(model="dep", messages=question, tools=[TOOL])
    calls: Any = first.choices[0].message.tool_calls
    call = calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.type == "function"
    assert "city" in json.loads(call.function.arguments)
    follow = [
        *question,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    second = sdk.chat.completions.create(model="dep", messages=follow, tools=[TOOL])
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    stream = sdk.chat.completions.create(
        model="dep", messages=question, tools=[TOOL], tool_choice="required", stream=True
    )
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[union-attr]
        for c in stream
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert "city" in json.loads(arguments)


def test_json_schema_and_n(azure_standin: StandIn) -> None:
    schema: Any = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = azure(azure_standin.url).chat.completions.create(
        model="dep",
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        n=2,
    )
    assert len(answer.choices) == 2
    assert json.loads(answer.choices[0].message.content or "") == {"ok": True}


def test_automatic_cache_read(azure_standin: StandIn) -> None:
    sdk = azure(azure_standin.url)
    system = f"[{uuid.uuid4().hex}] " + "Answer as briefly as you can, in plain words. " * 120
    first = sdk.chat.completions.create(
        model="dep", messages=[{"role": "system", "content": system}, {"role": "user", "content": "One"}]
    )
    second = sdk.chat.completions.create(
        model="dep", messages=[{"role": "system", "content": system}, {"role": "user", "content": "Two"}]
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached is not None and cached >= 1024 and (cached - 1024) % 128 == 0
    assert cached <= second.usage.prompt_tokens


def test_refusals_and_errors(azure_standin: StandIn) -> None:
    url = azure_standin.url
    hello: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError) as denied:
        azure(url, api_key="wrong").chat.completions.create(model="dep", messages=hello)
    assert "Access denied" in str(denied.value)
    path = url + "/openai/deployments/dep/chat/completions"
    no_version = httpx.post(path, json={"messages": hello}, headers={"api-key": "test-key"})
    assert no_version.status_code == 404 and no_version.json()["error"]["code"] == "404"
    marked: Any = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}
    ]
    with pytest.raises(openai.BadRequestError, match="cache_control"):
        azure(url).chat.completions.create(model="dep", messages=marked)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        azure(url).chat.completions.create(model="dep", messages=hello, extra_body={"top_k": 3})
    orphan: Any = [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "?"}]
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        azure(url).chat.completions.create(model="dep", messages=orphan)
    azure_standin.fault(503)
    with pytest.raises(openai.InternalServerError) as unavailable:
        azure(url).chat.completions.create(model="dep", messages=hello)
    assert unavailable.value.status_code == 503


def test_deployment_not_found_and_rate_limit() -> None:
    hello: Any = [{"role": "user", "content": "Hi"}]
    with standin("azure", "--models", "dep", "--rpm", "1") as running:
        sdk = azure(running.url)
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.chat.completions.create(model="other", messages=hello)
        assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "DeploymentNotFound"
        sdk.chat.completions.create(model="dep", messages=hello)
        with pytest.raises(openai.RateLimitError) as limited:
            sdk.chat.completions.create(model="dep", messages=hello)
        assert int(limited.value.response.headers["retry-after-ms"]) > 0
        assert "exceeded token rate limit" in str(limited.value)
        usage: Any = running.usage()
    assert usage["models"]["dep"]["requests"] == 1 and usage["total"]["refused"] == 2


def test_mid_stream_error() -> None:
    with standin("azure", "--fail-after-tokens", "3") as running:
        stream = azure(running.url).chat.completions.create(
            model="dep", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="server had an error"):
            for _ in stream:
                pass
