"""The official openai client honours our retry-after-ms: its automatic retry waits for the refill
and then succeeds (a minimal aiohttp front end stands in for the gateway's request path)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import openai
import orjson
import pytest
from aiohttp import web

from policies.limits.admission import Admission
from policies.limits.memory_store import MemoryStore
from policies.types import Rejection, Usage
from tests.policies.limits.support import KEY, facts, policy

# TPM 12000 refills 200 tokens/s; each request reserves 6050 (50 prompt + 6000 max_tokens) and uses
# all of it, so the second request is 100 tokens short: a true wait of 0.5 s.
TPM = 12_000


@pytest.fixture
async def front() -> AsyncIterator[tuple[str, dict[str, list[float]]]]:
    p = policy(limits=[{"scope": "key", "tpm": TPM}])
    admission = Admission(p, MemoryStore())
    seen: dict[str, list[float]] = {"rejected": [], "admitted": []}

    async def chat(request: web.Request) -> web.Response:
        who = p.authenticate(request.headers["Authorization"].removeprefix("Bearer "))
        assert who is not None
        body = await request.json()
        result = await admission.admit(facts(who, prompt_tokens=50, max_tokens=body["max_tokens"]), "big")
        if isinstance(result, Rejection):
            seen["rejected"].append(time.monotonic())
            error = {"error": {"message": result.message, "type": result.type, "param": None, "code": result.code}}
            return web.Response(
                status=result.status,
                body=orjson.dumps(error),
                headers=dict(result.headers),
                content_type="application/json",
            )
        seen["admitted"].append(time.monotonic())
        await admission.settle(result, Usage(50, body["max_tokens"]), model="big")
        used = body["max_tokens"]
        completion = {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": "big",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": used, "total_tokens": 50 + used},
        }
        return web.json_response(completion, headers=dict(result.headers))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/v1", seen
    await runner.cleanup()


@pytest.mark.slow
async def test_the_openai_client_waits_for_the_refill_and_succeeds(
    front: tuple[str, dict[str, list[float]]],
) -> None:
    base_url, seen = front
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=2)
    messages = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="big", messages=messages, max_tokens=6000)  # type: ignore[arg-type]
    response = await client.chat.completions.with_raw_response.create(
        model="big",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6000,
    )
    assert response.parse().choices[0].message.content == "ok"
    assert response.retries_taken == 1  # one 429, then it fit: the client waited as long as we said
    assert len(seen["rejected"]) == 1 and len(seen["admitted"]) == 2
    await client.close()
