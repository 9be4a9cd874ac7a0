"""Prefix and session affinity end to end (approximate prefix index, the default routing config).

Real processes: three simulated engines in one process (time scale 10), `tokenway serve` in front,
the official `openai` client. Where a request went is read from `x-tokenway-endpoint`; whether the
engine really reused its cache, from the engine's own `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from policies.routing.config import PipelineConfig
from tests.support.procs import TEST_KEY, Gateway, SimEngines, running, start_gateway, start_sim, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
REPLICAS = 3
# the default load-gate: a replica more than this many requests busier than the idlest is skipped
GATE_REQUESTS = int(next(f for f in PipelineConfig().filters if f.type == "load-gate").params["abs_threshold"])
BURST_OUTPUT_TOKENS = 3000  # long enough (~2 s real at time scale 10) that a burst's requests overlap


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimEngines]]:
    workdir = tmp_path_factory.mktemp("routing-affinity")
    engines = start_sim(workdir, count=REPLICAS, served_model_name=MODEL)
    gateway = start_gateway(workdir / "gw", pools=[static_pool("aff", MODEL, engines.urls)])
    with running(engines, gateway):
        yield gateway, engines


def long_text(tag: str, words: int = 500) -> str:
    """Text unique to `tag`, about 4 tokens per word: a long shared prefix."""
    return " ".join(f"{tag}-{i}" for i in range(words))


def messages(prefix: str, question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


def cached_tokens(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def sync_client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)


def ask(gateway: Gateway, msgs: list[ChatCompletionMessageParam], max_tokens: int = 4, **extra: Any) -> tuple[str, Any]:
    """(endpoint id, completion) of one non-streamed request."""
    raw = sync_client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=max_tokens, **extra
    )
    return raw.headers["x-tokenway-endpoint"], raw.parse()


async def burst(
    gateway: Gateway, all_messages: list[list[ChatCompletionMessageParam]], max_tokens: int = BURST_OUTPUT_TOKENS
) -> list[tuple[str, Any]]:
    """Send every request at once (long outputs, so they overlap) and collect (endpoint, completion)."""
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=120) as client:

        async def one(msgs: list[ChatCompletionMessageParam]) -> tuple[str, Any]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, max_tokens=max_tokens, extra_body={"ignore_eos": True}
            )
            return raw.headers["x-tokenway-endpoint"], raw.parse()

        return await asyncio.gather(*(one(m) for m in all_messages))


def test_requests_sharing_a_prefix_go_to_its_holder(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    prefix = long_text(uuid.uuid4().hex[:8])
    holder, first = ask(gateway, messages(prefix, "Question 0?"))
    assert cached_tokens(first) == 0
    for i in range(1, 6):
        raw = sync_client(gateway).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages(prefix, f"Question {i}?"),
            max_tokens=4,
            extra_headers={"x-tokenway-debug": "1"},
        )
        completion = raw.parse()
        assert raw.headers["x-tokenway-endpoint"] == holder
        assert "reason=prefix-hit" in raw.headers["x-tokenway-route"]
        # the engine itself served the shared prefix from its cache (all but the last partial block)
        assert completion.usage is not None
        assert cached_tokens(completion) >= first.usage.prompt_tokens - 32


def test_a_busy_holder_keeps_affinity_until_the_load_gate_then_requests_spread(
    fleet: tuple[Gateway, SimEngines],
) -> None:
    gateway, _ = fleet
    prefix = long_text(uuid.uuid4().hex[:8])
    holder, _ = ask(gateway, messages(prefix, "warm up"))
    total = 3 * GATE_REQUESTS
    results = asyncio.run(burst(gateway, [messages(prefix, f"Q{i}?") for i in range(total)]))
    by_endpoint = Counter(endpoint for endpoint, _ in results)
    # the holder takes the burst up to the gate (the others were idle), and the rest spreads out
    assert by_endpoint[holder] > GATE_REQUESTS
    assert by_endpoint[holder] == max(by_endpoint.values())
    assert by_endpoint[holder] < total
    # the holder served every one of its requests from cache; elsewhere the prefix had to be computed
    prompt = results[0][1].usage.prompt_tokens
    for endpoint, completion in results:
        if endpoint == holder:
            assert cached_tokens(completion) >= prompt - 32
    assert any(cached_tokens(c) == 0 for e, c in results if e != holder)


def test_identical_concurrent_prompts_do_not_all_land_on_one_replica(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    same = messages(long_text(uuid.uuid4().hex[:8], words=200), "Same question?")
    results = asyncio.run(burst(gateway, [same] * (4 * GATE_REQUESTS)))
    by_endpoint = Counter(endpoint for endpoint, _ in results)
    assert len(by_endpoint) >= 2, by_endpoint
    assert max(by_endpoint.values()) < 4 * GATE_REQUESTS


@pytest.mark.parametrize("how", ["header", "user-field"])
def test_session_affinity_keeps_a_session_on_one_replica(fleet: tuple[Gateway, SimEngines], how: str) -> None:
    gateway, _ = fleet
    session = f"session-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {"extra_headers": {"x-session-id": session}} if how == "header" else {"user": session}
    served = []
    for turn in range(8):
        # unrelated prompts: no shared prefix, so only the session can keep them together
        endpoint, completion = ask(gateway, messages(long_text(uuid.uuid4().hex[:8], 50), f"turn {turn}"), **extra)
        assert completion.choices[0].message.content
        served.append(endpoint)
    assert len(set(served)) == 1, served
    # requests without the session are not pinned: they spread over the idle replicas
    others = {ask(gateway, messages(long_text(uuid.uuid4().hex[:8], 50), "no session"))[0] for _ in range(12)}
    assert len(others) >= 2
