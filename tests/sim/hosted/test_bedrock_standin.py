"""The Bedrock stand-in checked by boto3's `bedrock-runtime` client: its shapes are the SDK's shapes.

The stand-in runs as a process (`python -m sim.hosted bedrock`, tests/sim/hosted/standin.py): boto3
is a synchronous client. boto3 signs every call with SigV4; the stand-in verifies the signature.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from tests.sim.hosted.standin import StandIn, standin

pytestmark = pytest.mark.e2e

MODEL = "anthropic.claude-3-5-haiku-20241022-v1:0"
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # over the 1024-token cache minimum
WEATHER = {
    "toolSpec": {
        "name": "get_weather",
        "description": "Weather in a city",
        "inputSchema": {"json": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
}


@pytest.fixture(scope="module")
def bedrock_standin() -> Iterator[StandIn]:
    with standin("bedrock") as running:
        yield running


def client(url: str, secret: str = "test-key") -> Any:
    return boto3.client(
        "bedrock-runtime",
        region_name="us-east-1",
        endpoint_url=url,
        aws_access_key_id="AKIDTEST",
        aws_secret_access_key=secret,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}),
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"text": text}]}


def test_converse_and_converse_stream_answer_the_same_text(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    kwargs: dict[str, Any] = {
        "modelId": MODEL,
        "messages": [user("Hello there")],
        "system": [{"text": "Be brief."}],
        "inferenceConfig": {"maxTokens": 40},
    }
    answer = bedrock.converse(**kwargs)
    assert answer["stopReason"] in ("end_turn", "max_tokens")
    text = answer["output"]["message"]["content"][0]["text"]
    usage = answer["usage"]
    assert usage["totalTokens"] == usage["inputTokens"] + usage["outputTokens"] > 0

    events = list(bedrock.converse_stream(**kwargs)["stream"])
    kinds = [next(iter(e)) for e in events]
    assert kinds[0] == "messageStart" and kinds[-2:] == ["messageStop", "metadata"]
    streamed = "".join(e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e)
    assert streamed == text
    assert events[-1]["metadata"]["usage"] == usage


def test_tools_are_called_and_their_results_answered(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    tools = {"tools": [WEATHER], "toolChoice": {"any": {}}}
    first = bedrock.converse(modelId=MODEL, messages=[user("Weather in Paris?")], toolConfig=tools)
    assert first["stopReason"] == "tool_use"
    use = first["output"]["message"]["content"][0]["toolUse"]
    assert use["name"] == "get_weather" and set(use["input"]) == {"city"}

    follow_up = [
        user("Weather in Paris?"),
        first["output"]["message"],
        {"role": "user", "content": [{"toolResult": {"toolUseId": use["toolUseId"], "content": [{"text": "sunny"}]}}]},
    ]
    second = bedrock.converse(modelId=MODEL, messages=follow_up, toolConfig={"tools": [WEATHER]})
    assert second["stopReason"] in ("end_turn", "max_tokens")
    assert second["output"]["message"]["content"][0]["text"]

    events = list(bedrock.converse_stream(modelId=MODEL, messages=[user("Weather?")], toolConfig=tools)["stream"])
    start = next(e["contentBlockStart"]["start"]["toolUse"] for e in events if "contentBlockStart" in e)
    assert start["name"] == "get_weather"
    arguments = "".join(
        e["contentBlockDelta"]["delta"]["toolUse"]["input"]
        for e in events
        if "contentBlockDelta" in e and "toolUse" in e["contentBlockDelta"]["delta"]
    )
    assert '"city"' in arguments


def test_a_cache_point_is_written_then_read(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    kwargs: dict[str, Any] = {
        "modelId": MODEL,
        "system": [{"text": LONG}, {"cachePoint": {"type": "default"}}],
        "messages": [user("Summarise the cached text.")],
    }
    first = bedrock.converse(**kwargs)["usage"]
    second = bedrock.converse(**kwargs)["usage"]
    assert first["cacheWriteInputTokens"] > 0 and first.get("cacheReadInputTokens", 0) == 0
    assert second["cacheReadInputTokens"] == first["cacheWriteInputTokens"]
    assert second["inputTokens"] == first["inputTokens"]  # what lies after the cache point
    tally = bedrock_standin.usage()["models"][MODEL]  # type: ignore[index]
    assert tally["cache_read_tokens"] >= second["cacheReadInputTokens"]


def test_a_mis_signed_call_is_refused(bedrock_standin: StandIn) -> None:
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        client(bedrock_standin.url, secret="wrong").converse(modelId=MODEL, messages=[user("hi")])
    assert refused.value.response["Error"]["Code"] == "InvalidSignatureException"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_an_unsigned_call_is_refused(bedrock_standin: StandIn) -> None:
    request = urllib.request.Request(
        f"{bedrock_standin.url}/model/{MODEL}/converse",
        data=b'{"messages":[{"role":"user","content":[{"text":"hi"}]}]}',
        headers={"content-type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 403
    assert refused.value.headers["x-amzn-ErrorType"].startswith("MissingAuthenticationTokenException")


def test_an_invalid_conversation_is_a_validation_exception(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        bedrock.converse(modelId=MODEL, messages=[{"role": "assistant", "content": [{"text": "hi"}]}])
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        bedrock.converse(
            modelId=MODEL,
            messages=[user("hi")],
            inferenceConfig={"maxTokens": 500},
            additionalModelRequestFields={"thinking": {"type": "enabled", "budget_tokens": 1024}},
        )
    assert refused.value.response["Error"]["Code"] == "ValidationException"


def test_over_the_rate_limit_is_a_throttling_exception() -> None:
    with standin("bedrock", "--rpm", "1") as running:
        bedrock = client(running.url)
        bedrock.converse(modelId=MODEL, messages=[user("hi")])
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            bedrock.converse(modelId=MODEL, messages=[user("hi")])
        assert refused.value.response["Error"]["Code"] == "ThrottlingException"
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429
        assert running.usage()["total"]["refused"] == 1  # type: ignore[index]


def test_a_stream_breaks_off_with_a_model_stream_error() -> None:
    with standin("bedrock", "--fail-after-tokens", "3") as running:
        stream = client(running.url).converse_stream(modelId=MODEL, messages=[user("hi")])["stream"]
        seen: list[dict[str, Any]] = []
        with pytest.raises(botocore.exceptions.EventStreamError) as broken:
            for event in stream:
                seen.append(event)  # noqa: PERF402 (what arrived before the error)
        assert broken.value.response["Error"]["Code"] == "modelStreamErrorException"
        assert sum("contentBlockDelta" in e for e in seen) == 3


def test_queued_faults_are_bedrocks_own_exceptions(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    bedrock_standin.fault(529)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        bedrock.converse(modelId=MODEL, messages=[user("hi")])
    assert refused.value.response["Error"]["Code"] == "ModelNotReadyException"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429
    bedrock_standin.fault(503)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        bedrock.converse(modelId=MODEL, messages=[user("hi")])
    assert refused.value.response["Error"]["Code"] == "ServiceUnavailableException"
    assert bedrock.converse(modelId=MODEL, messages=[user("hi")])["stopReason"]  # the queue is spent


def test_a_thinking_tool_loop_needs_its_signed_thinking_block_back(bedrock_standin: StandIn) -> None:
    bedrock = client(bedrock_standin.url)
    kwargs: dict[str, Any] = {
        "modelId": MODEL,
        "toolConfig": {"tools": [WEATHER], "toolChoice": {"auto": {}}},
        "inferenceConfig": {"maxTokens": 4000},
        "additionalModelRequestFields": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    }
    first = bedrock.converse(messages=[user("Weather in Paris?")], **kwargs)
    turn = first["output"]["message"]
    assert "reasoningContent" in turn["content"][0]
    use = next(b["toolUse"] for b in turn["content"] if "toolUse" in b)
    result = {
        "role": "user",
        "content": [{"toolResult": {"toolUseId": use["toolUseId"], "content": [{"text": "sunny"}]}}],
    }
    assert bedrock.converse(messages=[user("Weather in Paris?"), turn, result], **kwargs)["stopReason"] == "end_turn"
    stripped = {"role": "assistant", "content": [b for b in turn["content"] if "reasoningContent" not in b]}
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        bedrock.converse(messages=[user("Weather in Paris?"), stripped, result], **kwargs)
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "thinking" in refused.value.response["Error"]["Message"]
