"""The official openai client against the simulated engine."""

from __future__ import annotations

import openai

from sim.server import SimInstance


async def test_openai_client_chat_stream_and_completions(engine: SimInstance) -> None:
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    model = engine.engine.config.served_model_name
    async with client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [model]

        chat = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        assert chat.choices[0].message.content

        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Stream hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 4 and "".join(pieces)

        completion = await client.completions.create(
            model=model, prompt="Once upon", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 3

        try:
            await client.chat.completions.create(model="not-served", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as exc:
            assert "does not exist" in str(exc)
        else:
            raise AssertionError("an unknown model must be a 404")
