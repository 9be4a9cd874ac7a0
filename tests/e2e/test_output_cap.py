"""The engine never produces more than was reserved (real gateway, simulated engine): a request
without `max_tokens` is sent to the engine with the reservation as its limit, on every API, so a
burst of long structured answers cannot run a TPM limit over; `min_tokens` above the limit is
refused, naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from policies.policy import hash_key
from tests.support.procs import TEST_KEY, Gateway, SimEngines, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
DEFAULT_MAX_TOKENS = 40
TPM = 600  # about ten of the burst's reservations
# A JSON answer of at least 200 objects: hundreds of tokens when nothing stops the engine.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 200,
            "items": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        }
    },
    "required": ["items"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG_SCHEMA}}


def policies() -> dict[str, Any]:
    return {
        "tenants": {"t1": {}},
        "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
        "models": {MODEL: {"context_length": 16384, "default_max_tokens": DEFAULT_MAX_TOKENS}},
        "limits": [{"scope": "key", "tpm": TPM}],
    }


@pytest.fixture
def gateway(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> Gateway:
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=50)
    return gateway_factory(pools=[static_pool("llama", MODEL, engines.urls)], policies=policies())


async def _post(gateway: Gateway, path: str, body: dict[str, Any], count: int = 1) -> list[tuple[int, dict[str, Any]]]:
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def one() -> tuple[int, dict[str, Any]]:
            async with http.post(gateway.base_url + path, json=body, headers=headers) as response:
                return response.status, await response.json(content_type=None)

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_a_burst_of_long_answers_without_max_tokens_stays_within_the_reservations(gateway: Gateway) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "List many names."}],
        "response_format": RESPONSE_FORMAT,
    }
    results = asyncio.run(_post(gateway, "/chat/completions", body, count=20))
    served = [answer for status, answer in results if status == 200]
    assert served and {status for status, _ in results} == {200, 429}  # the limit held some back
    for answer in served:  # each answer stopped at its reservation: cut by the limit, not by EOS
        assert answer["usage"]["completion_tokens"] <= DEFAULT_MAX_TOKENS
        assert answer["choices"][0]["finish_reason"] == "length"
    output = sum(answer["usage"]["completion_tokens"] for answer in served)
    assert output <= len(served) * DEFAULT_MAX_TOKENS
    total = sum(answer["usage"]["total_tokens"] for answer in served)
    assert total <= TPM  # each used at most its reservation, and the reservations fit the limit


def test_the_reservation_limits_every_api(gateway: Gateway) -> None:
    """Completions, n > 1 and Responses (translated for the simulated engine's vLLM protocol or not)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "min_tokens": DEFAULT_MAX_TOKENS}
    ((status, answer),) = asyncio.run(_post(gateway, "/completions", body))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS  # at least min_tokens, at most reserved
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "min_tokens": 30}
    ((status, answer),) = asyncio.run(_post(gateway, "/chat/completions", body))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 2 * DEFAULT_MAX_TOKENS  # n choices share the reservation
    body = {"model": MODEL, "input": "List many names.", "text": {"format": {"type": "json_schema", "name": "long",
            "schema": LONG_SCHEMA}}}  # fmt: skip
    ((status, answer),) = asyncio.run(_post(gateway, "/responses", body))
    assert status == 200, answer
    assert answer["usage"]["output_tokens"] <= DEFAULT_MAX_TOKENS
    assert answer["status"] == "incomplete"


def test_a_client_limit_is_kept_and_min_tokens_above_it_is_refused(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}
    ((status, answer),) = asyncio.run(_post(gateway, "/chat/completions", body))
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    for path, extra in (
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}),
        ("/completions", {"prompt": "hi", "max_tokens": 5}),
    ):
        ((status, answer),) = asyncio.run(_post(gateway, path, {"model": MODEL, "min_tokens": 6, **extra}))
        assert status == 400, answer
        assert answer["error"]["param"] == "min_tokens"
    ((status, answer),) = asyncio.run(
        _post(gateway, "/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 16, "min_tokens": 17})
    )
    assert status == 400 and answer["error"]["param"] == "min_tokens"
