"""The engine-token cache (`EngineTokenizeCounter`: the engine's `/tokenize` answers, kept by a hash of
the prompt) is keyed by client input, so it must stay within its bounds whatever prompts clients send,
and still count right: a flood of distinct prompts leaves it at its token and entry bounds, repeats
of recent prompts are answered from it (no round trip), evicted ones are asked again and counted
right, and one huge prompt is counted but neither cached nor allowed to flush the rest.

Against a real simulated engine (its `/tokenize` renders the chat and counts it as the engine does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.types import Endpoint, EndpointState, Role
from gateway.upstream.client import UpstreamClient
from gateway.upstream.engine_tokens import EngineTokenizeCounter
from policies.estimate import body_key
from tests.backends.fake_engine import fake_engine
from tests.support.procs import SimEngines, start_sim

pytestmark = pytest.mark.e2e  # starts a simulated engine

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngines]:
    engines = start_sim(Path(tmp_path_factory.mktemp("engine-tokens")), count=1)
    try:
        yield engines
    finally:
        engines.stop()


@pytest.fixture
async def session() -> AsyncIterator[UpstreamClient]:
    async with UpstreamClient() as client:
        yield client


def pool_of(engine: SimEngines) -> Pool:
    url = engine.urls[0]
    config = PoolConfig(name="p", model=MODEL, engine="vllm", endpoints=[StaticEndpointConfig(url=url)])
    endpoint = Endpoint(
        id="p/e0", pool="p", base_url=url, engine="vllm", served_model=MODEL, role=Role.BOTH, state=EndpointState.READY
    )
    return Pool(config, endpoints=[endpoint])


def chat(i: int, words: int = 40) -> dict[str, Any]:
    """A client's distinct prompt (its number spelled into the text), about `words` tokens long."""
    text = f"prompt {i}: " + " ".join(f"w{i}x{j}" for j in range(words))
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


async def truth(oracle: EngineTokenizeCounter, body: dict[str, Any]) -> int:
    """The engine's own count, asked directly (no cache): the /tokenize request of a chat."""
    ids = await oracle.tokenize(orjson.dumps({"messages": body["messages"], "add_generation_prompt": True}))
    assert ids is not None
    return len(ids)


def held(counter: EngineTokenizeCounter) -> tuple[int, int]:
    """(entries, tokens) the counter's cache holds, as it reports them."""
    described = counter.describe()
    return described["cache_entries"], described["cache_tokens"]


async def test_a_flood_of_long_prompts_leaves_the_cache_at_its_token_bound(
    engine: SimEngines, session: UpstreamClient
) -> None:
    pool = pool_of(engine)
    counter = EngineTokenizeCounter(session, pool, max_entries=100_000, max_tokens=3_000)
    oracle = EngineTokenizeCounter(session, pool)
    counts = []
    for i in range(200):  # ~100 tokens each: ~20,000 tokens offered to a 3,000-token cache
        counted = await counter.count("chat", chat(i))
        assert counted is not None
        counts.append(counted.tokens)
        assert held(counter)[1] <= 3_000
    entries, tokens = held(counter)
    assert entries < 200 and tokens > 3_000 - max(counts)  # evicted down to the bound, not emptied
    for i in (0, 57, 199):  # counting is still the engine's: oldest (evicted), middle, newest
        assert counts[i] == await truth(oracle, chat(i))
    calls = counter.calls
    again = await counter.count("chat", chat(199))  # the newest is still held: no round trip
    assert again is not None and again.tokens == counts[199] and counter.calls == calls
    evicted = await counter.count("chat", chat(0))  # the oldest was evicted: asked again, counted right
    assert evicted is not None and evicted.tokens == counts[0] and counter.calls == calls + 1


async def test_a_flood_of_short_prompts_leaves_the_cache_at_its_entry_bound(
    engine: SimEngines, session: UpstreamClient
) -> None:
    counter = EngineTokenizeCounter(session, pool_of(engine), max_entries=25, max_tokens=4_000_000)
    for i in range(300):
        assert await counter.count("chat", chat(i, words=2)) is not None
        assert held(counter)[0] <= 25
    assert held(counter)[0] == 25
    assert counter.calls == 300  # every distinct prompt asked once: none answered from a stale entry


async def test_one_huge_prompt_is_counted_but_does_not_flush_the_cache(
    engine: SimEngines, session: UpstreamClient
) -> None:
    pool = pool_of(engine)
    counter = EngineTokenizeCounter(session, pool, max_entries=1_000, max_tokens=2_000)
    for i in range(5):
        await counter.count("chat", chat(i, words=10))
    before = held(counter)
    huge = chat(10_000, words=2_000)  # well over a quarter of the cache alone
    counted = await counter.count("chat", huge)
    assert counted is not None and counted.tokens == await truth(EngineTokenizeCounter(session, pool), huge)
    assert held(counter) == before  # not cached, nothing evicted for it
    calls = counter.calls
    for i in range(5):  # the five small prompts are all still answered from the cache
        await counter.count("chat", chat(i, words=10))
    assert counter.calls == calls


@pytest.mark.parametrize(
    "tokens", [["a"], [-1, 2], [1 << 40], [1.5]], ids=["strings", "negative", "past-32-bits", "floats"]
)
async def test_ids_that_are_not_ids_are_an_unusable_answer(session: UpstreamClient, tokens: list[Any]) -> None:
    """An engine's /tokenize answer is input: ids `array('I')` refuses made it raise (TypeError,
    OverflowError) out of the counter, into the request (bench/chaos/engine_channels.py)."""
    async with fake_engine() as fake:
        fake.set("/tokenize", 200, orjson.dumps({"count": len(tokens), "tokens": tokens}).decode())
        config = PoolConfig(name="p", model=MODEL, engine="vllm", endpoints=[StaticEndpointConfig(url=fake.base_url)])
        endpoint = Endpoint(id="p/e0", pool="p", base_url=fake.base_url, engine="vllm", served_model=MODEL,
                            role=Role.BOTH, state=EndpointState.READY)  # fmt: skip
        counter = EngineTokenizeCounter(session, Pool(config, endpoints=[endpoint]))
        assert await counter.tokenize(orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})) is None


async def test_an_answer_longer_than_any_the_request_could_need_is_refused(session: UpstreamClient) -> None:
    """A /tokenize answer is read up to what the request's ids could take (a token per byte, 11 bytes
    of JSON each): an engine answering megabytes for "hi" is an unusable answer, not memory spent."""
    async with fake_engine() as fake:
        fake.set("/tokenize", 200, orjson.dumps({"count": 1, "tokens": [1] * 500_000}).decode())
        config = PoolConfig(name="p", model=MODEL, engine="vllm", endpoints=[StaticEndpointConfig(url=fake.base_url)])
        endpoint = Endpoint(id="p/e0", pool="p", base_url=fake.base_url, engine="vllm", served_model=MODEL,
                            role=Role.BOTH, state=EndpointState.READY)  # fmt: skip
        counter = EngineTokenizeCounter(session, Pool(config, endpoints=[endpoint]))
        assert await counter.tokenize(orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})) is None
        assert counter.errors == 1


async def test_a_body_seen_before_and_its_prompt_under_other_fields_ask_the_engine_once(
    engine: SimEngines, session: UpstreamClient
) -> None:
    """Keyed by the raw body's hash (intake's `body_key`), a repeated body is answered from the cache
    without encoding its prompt; a body that differs only outside the prompt (a temperature, a user)
    is a new body but the same prompt: still no second round trip to the engine, and the same count."""
    counter = EngineTokenizeCounter(session, pool_of(engine))
    body = chat(1)
    first = await counter.count("chat", body)
    assert first is not None and counter.calls == 1
    raw = orjson.dumps(body)
    for _ in range(2):  # a new body key, then the same one again
        found = counter.lookup("chat", body, body_key("chat", raw))
        assert not hasattr(found, "__await__") and found is not None and found.tokens == first.tokens
    other = {**body, "temperature": 0.3, "user": "someone"}
    found = counter.lookup("chat", other, body_key("chat", orjson.dumps(other)))
    assert not hasattr(found, "__await__") and found is not None and found.tokens == first.tokens
    assert counter.calls == 1
