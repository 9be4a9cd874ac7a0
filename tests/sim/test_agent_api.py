"""The simulated engine's /v1/responses and /v1/messages, driven by the official clients."""
# mypy: disable-error-code="arg-type, call-overload, misc, list-item, index"
# (the SDKs' TypedDict parameters are passed plain dicts here on purpose: what a user's code sends)

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import aiohttp
import jsonschema
import openai
import pydantic
import pytest

from sim.server import SimInstance

if TYPE_CHECKING:  # imported where used: the SDK takes a second to import, once per test worker
    import anthropic

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


class Answer(pydantic.BaseModel):
    title: str
    score: int
    tags: list[str]


def _openai(engine: SimInstance) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def _anthropic(engine: SimInstance) -> anthropic.AsyncAnthropic:
    import anthropic

    return anthropic.AsyncAnthropic(base_url=engine.url, api_key="unused", max_retries=0)


@pytest.mark.slow
async def test_responses_create_stream_parse_and_continue(engine: SimInstance) -> None:
    model = engine.engine.config.served_model_name
    async with _openai(engine) as client:
        first = await client.responses.create(
            model=model, input="Hello there", instructions="Be kind", max_output_tokens=16
        )
        assert first.status in ("completed", "incomplete") and first.output_text
        assert first.usage is not None and 0 < first.usage.output_tokens <= 16

        async with client.responses.stream(model=model, input="Stream it", max_output_tokens=2000) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == final.output_text and final.usage is not None

        parsed = await client.responses.parse(model=model, input="rate it", text_format=Answer)
        assert isinstance(parsed.output_parsed, Answer)

        call = await client.responses.create(model=model, input="define cat", tools=[TOOL], tool_choice="required")
        item = next(i for i in call.output if i.type == "function_call")
        jsonschema.validate(json.loads(item.arguments), TOOL["parameters"])
        follow = await client.responses.create(
            model=model,
            previous_response_id=call.id,
            input=[{"type": "function_call_output", "call_id": item.call_id, "output": "a small animal"}],
            tools=[TOOL],
        )
        assert follow.output_text and follow.usage is not None
        assert follow.usage.input_tokens > call.usage.input_tokens
        again = await client.responses.retrieve(call.id)
        assert again.id == call.id

        try:
            await client.responses.create(model=model, input=[{"type": "computer_call"}])
        except openai.BadRequestError as exc:
            assert "computer_call" in str(exc)
        else:
            raise AssertionError("an unknown item type must be a 400")


@pytest.mark.slow
async def test_messages_create_stream_tools_and_count(engine: SimInstance) -> None:
    import anthropic

    model = engine.engine.config.served_model_name
    async with _anthropic(engine) as client:
        message = await client.messages.create(
            model=model, max_tokens=12, system="terse", messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.type == "message" and message.content[0].type == "text"
        assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 12

        async with client.messages.stream(
            model=model, max_tokens=10, messages=[{"role": "user", "content": "Stream"}]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text and final.content[0].text == text  # type: ignore[union-attr]

        tools = [{"name": "lookup", "description": "d", "input_schema": TOOL["parameters"]}]
        tooled = await client.messages.create(
            model=model,
            max_tokens=100,
            tools=tools,
            tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "look up cat"}],
        )
        use = next(b for b in tooled.content if b.type == "tool_use")
        assert tooled.stop_reason == "tool_use" and "word" in use.input

        async with client.messages.stream(
            model=model,
            max_tokens=100,
            tools=tools,
            tool_choice={"type": "tool", "name": "lookup"},
            messages=[{"role": "user", "content": "look up dog"}],
        ) as stream:
            streamed = await stream.get_final_message()
        block = next(b for b in streamed.content if b.type == "tool_use")
        jsonschema.validate(block.input, TOOL["parameters"])

        count = await client.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": "Hi"}], system="terse"
        )
        assert count.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)

        try:
            await client.messages.create(
                model=model, max_tokens=5, messages=[{"role": "user", "content": [{"type": "video"}]}]
            )
        except anthropic.BadRequestError as exc:
            assert exc.body["type"] == "error" and exc.body["error"]["type"] == "invalid_request_error"
        else:
            raise AssertionError("an unknown block type must be a 400")


async def test_messages_requires_max_tokens(engine: SimInstance) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"model": engine.engine.config.served_model_name, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(engine.url + "/v1/messages", json=body) as resp:
            assert resp.status == 400
            error = await resp.json()
    assert error["type"] == "error" and "max_tokens" in error["error"]["message"]
