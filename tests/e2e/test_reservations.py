"""Reservations that match what the engine will do, and leave nothing behind (real gateway, simulated
engines): `min_tokens` and `ignore_eos` reserve what they make the engine generate; a client gone
during the PD prefill leg releases its lease; a stream delivered whole counts as served even when the
client closes at once."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
ADMIN = "reservations-admin"
KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def policies(limits: list[dict[str, Any]], **model: Any) -> dict[str, Any]:
    return {
        "tenants": {"t1": {}},
        "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
        "models": {MODEL: {"context_length": 16384, **model}},
        "limits": limits,
    }


def running(engine_url: str) -> float:
    """Requests the engine holds now, running or waiting (0 when its metrics do not answer in time)."""
    status, text = http_get(engine_url + "/metrics", timeout_s=10)
    if status != 200:
        return 0.0
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )


def leases(gateway: Gateway) -> int:
    status, text = http_get(gateway.url + "/admin/status", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return sum(r.get("active", 0) for r in json.loads(text)["limits"] if r.get("kind") == "concurrency")


async def burst(gateway: Gateway, count: int, body: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def one() -> tuple[int, dict[str, Any]]:
            async with http.post(gateway.base_url + "/chat/completions", json=body, headers=headers) as response:
                return response.status, await response.json(content_type=None)

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_min_tokens_are_reserved_so_a_burst_cannot_overrun_the_tpm_limit(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=20)
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)],
        policies=policies([{"scope": "key", "tpm": 2000}], default_max_tokens=16),  # a small estimate
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "min_tokens": 1000}
    results = asyncio.run(burst(gateway, 20, body))
    served = [b for s, b in results if s == 200]
    used = sum(b["usage"]["total_tokens"] for b in served)
    assert {s for s, _ in results} <= {200, 429}
    assert used <= 2000 + 1100  # never past the limit by more than one request's reservation


def test_ignore_eos_without_max_tokens_reserves_the_context(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=20)
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)], policies=policies([{"scope": "key", "tpm": 2000}])
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
    ((status, answer),) = asyncio.run(burst(gateway, 1, body))
    assert status == 429, answer  # a whole context can never fit 2,000 tokens a minute: said up front
    assert answer["error"]["code"] == "rate_limit_exceeded"
    body["max_tokens"] = 20  # bounded: admitted
    ((status, answer),) = asyncio.run(burst(gateway, 1, body))
    assert status == 200 and answer["usage"]["completion_tokens"] == 20


def test_a_client_gone_during_the_pd_prefill_leg_leaves_no_lease(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    args = ["--kv-transfer-config", json.dumps(KV_TRANSFER)]
    prefill = sim_factory(count=1, served_model_name=MODEL, args=args, time_scale=0.05)  # a slow prefill
    decode = sim_factory(count=1, served_model_name=MODEL, args=args)
    pool = {
        "name": "pd", "model": MODEL, "engine": "vllm",
        "endpoints": [{"url": prefill.urls[0], "role": "prefill"}, {"url": decode.urls[0], "role": "decode"}],
    }  # fmt: skip
    gateway = gateway_factory(
        pools=[pool], policies=policies([{"scope": "key", "max_concurrent": 100}]), server={"admin_token": ADMIN}
    )

    async def four_give_up_during_the_prefill_leg() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

            async def one() -> None:
                prompt = " ".join(f"{uuid.uuid4().hex[:6]}-{i}" for i in range(1500))  # nothing cached anywhere
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
                headers = {"Authorization": f"Bearer {TEST_KEY}"}
                async with http.post(gateway.base_url + "/chat/completions", json=body, headers=headers) as response:
                    await response.read()

            tasks = [asyncio.ensure_future(one()) for _ in range(4)]
            deadline = time.monotonic() + 60
            while running(prefill.urls[0]) < 4:  # all four prefilling
                assert time.monotonic() < deadline, "the prefill legs did not start"
                await asyncio.sleep(0.05)
            assert leases(gateway) == 4
            for task in tasks:
                task.cancel()  # the clients go away while the gateway waits for the prefill engine
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(four_give_up_during_the_prefill_leg())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and leases(gateway):
        time.sleep(0.1)
    assert leases(gateway) == 0


@pytest.mark.redis
def test_a_stream_delivered_whole_and_closed_at_once_is_served(
    sim_factory: Callable[..., SimEngines],
    gateway_factory: Callable[..., Gateway],
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """The settlement after a stream awaits Redis: a client closing right after [DONE] lands there."""
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=20)
    usage_dir = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)],
        policies=policies([{"scope": "key", "tpm": 1_000_000}]),
        ledger={"dir": str(usage_dir), "commit_interval_ms": 20},
        state={"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix},
    )
    request_id = uuid.uuid4().hex
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "stream": True}).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TEST_KEY}\r\nx-request-id: {request_id}\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", gateway.port))
    sock.sendall(head + raw)
    seen = b""
    while b"data: [DONE]" not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # right after [DONE]: a reset, before the end of the chunked body
    deadline = time.monotonic() + 20
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not found:
        found = [r for r in iter_entries(usage_dir) if r["request_id"] == request_id] if usage_dir.exists() else []
        time.sleep(0.05)
    assert len(found) == 1
    assert (found[0]["status"], found[0]["http_status"]) == ("ok", 200)
