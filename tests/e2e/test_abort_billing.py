"""A client that walks away is billed for what the engine worked on (real gateway, simulated engine):
one ledger record, its output tokens charged, the key's budget charged the same as the ledger says,
streamed or not, on chat and Messages."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
ADMIN = "abort-billing-admin-token-0123456789"
MAX_TOKENS = 4000
# A tool whose arguments are hundreds of tokens long (Messages has no ignore_eos).
LONG_TOOL = {
    "name": "names",
    "input_schema": {
        "type": "object",
        "properties": {"names": {"type": "array", "minItems": 300, "items": {"type": "string"}}},
        "required": ["names"],
    },
}


def policies() -> dict[str, Any]:
    return {
        "tenants": {"t1": {}},
        "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
        "models": {MODEL: {"context_length": 16384, "price": {"input_per_mtok": 1.0, "output_per_mtok": 10.0}}},
        "budgets": [{"scope": "key", "usd_per_day": 1000.0}],
    }


@pytest.fixture
def setup(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> tuple[Gateway, SimEngines, Path]:
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=1)  # real time: 4,000 tokens take long
    ledger = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)],
        policies=policies(),
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
        server={"admin_token": ADMIN},
    )
    return gateway, engines, ledger


def engine_generated(engine_url: str) -> float:
    """Generation tokens the engine has produced so far (its own counter)."""
    status, text = http_get(engine_url + "/metrics", timeout_s=10)
    assert status == 200
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


def records(ledger: Path, request_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = [r for r in iter_entries(ledger) if r["request_id"] == request_id] if ledger.exists() else []
        if found:
            time.sleep(0.3)  # a second record would be written by now
            return [r for r in iter_entries(ledger) if r["request_id"] == request_id]
        time.sleep(0.05)
    return found


def budget_spent(gateway: Gateway) -> float:
    status, text = http_get(gateway.url + "/admin/status", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return float(sum(r["spent_usd"] for r in json.loads(text)["limits"] if r.get("kind") == "budget"))


async def abandon(gateway: Gateway, engine_url: str, path: str, body: dict[str, Any], request_id: str) -> int:
    """Send, wait until the engine has generated for it, then go away; events read before leaving."""
    headers = {"Authorization": f"Bearer {TEST_KEY}", "x-request-id": request_id}
    before = engine_generated(engine_url)
    events = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def send() -> None:
            nonlocal events
            async with http.post(gateway.base_url + path, json=body, headers=headers) as response:
                async for _line in response.content:
                    events += 1
                    if events > 40:
                        return  # a streaming client leaves mid-stream

        task = asyncio.ensure_future(send())
        deadline = time.monotonic() + 60
        while engine_generated(engine_url) - before < 50 and not task.done():
            assert time.monotonic() < deadline, "the engine never generated"
            await asyncio.sleep(0.1)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return events


def test_a_non_streamed_request_abandoned_mid_answer_is_charged(setup: tuple[Gateway, SimEngines, Path]) -> None:
    gateway, engines, ledger = setup
    request_id = uuid.uuid4().hex
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip
    asyncio.run(abandon(gateway, engines.urls[0], "/chat/completions", body, request_id))
    (record,) = records(ledger, request_id)  # exactly one record
    assert record["status"] == "aborted"
    assert 0 < record["output_tokens"] <= MAX_TOKENS
    assert record["usage_source"] == "reserved"  # what the engine produced is not visible: the reservation
    assert budget_spent(gateway) == pytest.approx(record["cost_usd"], rel=1e-6)


def test_a_streamed_messages_request_abandoned_mid_stream_is_charged_what_was_relayed(
    setup: tuple[Gateway, SimEngines, Path],
) -> None:
    gateway, engines, ledger = setup
    request_id = uuid.uuid4().hex
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": MAX_TOKENS,
            "stream": True, "tools": [LONG_TOOL], "tool_choice": {"type": "tool", "name": "names"}}  # fmt: skip
    asyncio.run(abandon(gateway, engines.urls[0], "/messages", body, request_id))
    (record,) = records(ledger, request_id)
    assert record["status"] == "aborted"
    assert 0 < record["output_tokens"] < MAX_TOKENS  # the stream so far
    assert budget_spent(gateway) == pytest.approx(record["cost_usd"], rel=1e-6)
