"""The simulated engine honours what clients ask for: tools, JSON schemas, stop, n, logprobs, seed."""
# mypy: disable-error-code="arg-type, call-overload, misc, list-item, index"
# (the SDKs' TypedDict parameters are passed plain dicts here on purpose: what a user's code sends)

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from sim.server import SimInstance

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _client(engine: SimInstance) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_required_and_named_tool_calls_validate(engine: SimInstance) -> None:
    async with _client(engine) as client:
        model = engine.engine.config.served_model_name
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = await client.chat.completions.create(
                model=model, messages=_user("weather in Oslo?"), tools=[WEATHER, CLOCK], tool_choice=choice
            )
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
            call = message.tool_calls[0]
            assert call.id.startswith("chatcmpl-tool-")
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            assert reply.usage is not None and reply.usage.completion_tokens > 0


@pytest.mark.slow
async def test_auto_tool_calls_sometimes_and_never_after_a_tool_result(engine: SimInstance) -> None:
    async with _client(engine) as client:
        model = engine.engine.config.served_model_name
        kinds = set()
        for i in range(12):
            reply = await client.chat.completions.create(
                model=model, messages=_user(f"question {i}"), tools=[WEATHER], max_tokens=40
            )
            kinds.add(reply.choices[0].finish_reason)
        assert "tool_calls" in kinds and kinds - {"tool_calls"}
        history = [
            *_user("weather?"),
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        ]
        reply = await client.chat.completions.create(model=model, messages=history, tools=[WEATHER])
        assert reply.choices[0].message.tool_calls in (None, []) and reply.choices[0].message.content


async def test_streamed_tool_call_arrives_as_deltas(engine: SimInstance) -> None:
    async with _client(engine) as client:
        stream = await client.chat.completions.create(
            model=engine.engine.config.served_model_name,
            messages=_user("weather?"),
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
            stream_options={"include_usage": True},
        )
        names, pieces, finish, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or ():
                    if call.function and call.function.name:
                        names.append(call.function.name)
                    pieces.append((call.function.arguments if call.function else "") or "")
        assert names == ["get_weather"] and finish == "tool_calls"
        assert len([p for p in pieces if p]) > 1  # more than one delta
        jsonschema.validate(json.loads("".join(pieces)), WEATHER["function"]["parameters"])
        assert usage is not None and usage.completion_tokens > 1


class Person(pydantic.BaseModel):
    name: str
    age: int
    emails: list[str]
    address: Address | None = None


class Address(pydantic.BaseModel):
    street: str
    zip_code: str


Person.model_rebuild()


async def test_json_schema_and_json_object(engine: SimInstance) -> None:
    async with _client(engine) as client:
        model = engine.engine.config.served_model_name
        parsed = await client.chat.completions.parse(model=model, messages=_user("a person"), response_format=Person)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person)
        reply = await client.chat.completions.create(
            model=model, messages=_user("json please"), response_format={"type": "json_object"}
        )
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def test_stop_n_seed_and_logprobs(engine: SimInstance) -> None:
    async with _client(engine) as client:
        model = engine.engine.config.served_model_name
        base = await client.chat.completions.create(
            model=model, messages=_user("tell me"), max_tokens=60, extra_body={"ignore_eos": True}
        )
        text = base.choices[0].message.content or ""
        word = text.split(" ")[5]
        stopped = await client.chat.completions.create(
            model=model, messages=_user("tell me"), max_tokens=60, stop=[" " + word], extra_body={"ignore_eos": True}
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert (stopped.choices[0].message.content or "") == text[: text.index(" " + word)]
        assert stopped.usage is not None and stopped.usage.completion_tokens < 60

        many = await client.chat.completions.create(model=model, messages=_user("three ways"), n=3, max_tokens=20)
        assert [c.index for c in many.choices] == [0, 1, 2]
        assert len({c.message.content for c in many.choices}) == 3
        assert many.usage is not None and many.usage.completion_tokens > 20  # three choices' tokens
        single = await client.chat.completions.create(model=model, messages=_user("three ways"), max_tokens=20)
        assert single.usage is not None and many.usage.prompt_tokens == single.usage.prompt_tokens

        seeded = [
            await client.chat.completions.create(model=model, messages=_user("seeded"), seed=s, max_tokens=30)
            for s in (7, 7, 8)
        ]
        texts = [c.choices[0].message.content for c in seeded]
        assert texts[0] == texts[1] and texts[0] != texts[2]

        lp = await client.chat.completions.create(
            model=model,
            messages=_user("probabilities"),
            logprobs=True,
            top_logprobs=3,
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 6
        assert "".join(t.token for t in content) == lp.choices[0].message.content
        for token in content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 3
            assert token.top_logprobs[0].token == token.token
            assert [t.logprob for t in token.top_logprobs] == sorted(
                (t.logprob for t in token.top_logprobs), reverse=True
            )


async def test_n_streamed_with_usage_summed(engine: SimInstance) -> None:
    async with _client(engine) as client:
        stream = await client.chat.completions.create(
            model=engine.engine.config.served_model_name,
            messages=_user("two"),
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        assert all(texts.values()) and texts[0] != texts[1]
        assert usage is not None and usage.completion_tokens == 10


@pytest.mark.parametrize("logprobs", [0, 2])
async def test_completions_stop_n_and_logprobs(engine: SimInstance, logprobs: int) -> None:
    async with _client(engine) as client:
        reply = await client.completions.create(
            model=engine.engine.config.served_model_name,
            prompt="Once",
            n=2,
            max_tokens=8,
            logprobs=logprobs,
            extra_body={"ignore_eos": True},
        )
        assert len(reply.choices) == 2 and reply.usage is not None and reply.usage.completion_tokens == 16
        assert reply.choices[0].logprobs is not None and len(reply.choices[0].logprobs.tokens or []) == 8
