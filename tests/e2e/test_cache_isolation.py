"""Prefix caches are per tenant unless a policy shares them (real gateway, simulated engine that
honours `cache_salt`): another tenant resending a prompt sees nothing cached, the same tenant and a
tenant of the same `cache_group` do; a client's own `cache_salt` changes nothing; the routing debug
headers are answered to the operator only."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from policies.policy import hash_key
from tests.support.procs import Gateway, SimEngines, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
ADMIN = "cache-isolation-admin-token-0123456789"
KEYS = {tenant: f"sk-tokenway-cache-{tenant}-01" for tenant in ("alice", "bob", "carol", "dave")}


def policies() -> dict[str, Any]:
    return {
        "tenants": {
            "alice": {},
            "bob": {},
            "carol": {"cache_group": "partners"},
            "dave": {"cache_group": "partners"},
        },
        "keys": [{"id": f"k-{t}", "tenant": t, "sha256": hash_key(key)} for t, key in KEYS.items()],
        "models": {MODEL: {}},
    }


@pytest.fixture
def gateway(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> Gateway:
    engines = sim_factory(count=1, served_model_name=MODEL, time_scale=50)
    return gateway_factory(
        pools=[static_pool("llama", MODEL, engines.urls)], policies=policies(), server={"admin_token": ADMIN}
    )


def prompt() -> str:
    """A prompt of a few hundred tokens nobody sent before (many full KV blocks)."""
    return " ".join(f"{uuid.uuid4().hex[:8]} word{i}" for i in range(120))


async def send(
    gateway: Gateway, tenant: str, text: str, extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **(extra or {})}
    sent = {"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(gateway.base_url + "/chat/completions", json=body, headers=sent) as response,
    ):
        return response.status, await response.json(), dict(response.headers)


def cached(gateway: Gateway, tenant: str, text: str, extra: dict[str, Any] | None = None) -> int:
    status, answer, _ = asyncio.run(send(gateway, tenant, text, extra))
    assert status == 200, answer
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_another_tenant_never_hits_a_tenants_cached_prompt(gateway: Gateway) -> None:
    text = prompt()
    assert cached(gateway, "alice", text) == 0
    assert cached(gateway, "bob", text) == 0  # the same prompt, another tenant: nothing to learn
    assert cached(gateway, "alice", text) > 0  # the tenant's own cache works
    assert cached(gateway, "bob", text) > 0  # and bob's own now too


def test_a_clients_cache_salt_cannot_reach_another_tenants_cache(gateway: Gateway) -> None:
    text = prompt()
    assert cached(gateway, "alice", text) == 0
    assert cached(gateway, "bob", text, {"cache_salt": "anything"}) == 0
    assert cached(gateway, "alice", text, {"cache_salt": "anything"}) > 0  # dropped: alice's salt as ever


def test_tenants_of_one_cache_group_share_it(gateway: Gateway) -> None:
    text = prompt()
    assert cached(gateway, "carol", text) == 0
    assert cached(gateway, "dave", text) > 0  # the policy says they share
    assert cached(gateway, "alice", text) == 0  # and nobody else


def test_the_routing_debug_headers_are_for_the_operator_only(gateway: Gateway) -> None:
    text = prompt()
    status, _, headers = asyncio.run(send(gateway, "alice", text, headers={"x-tokenway-debug": "1"}))
    assert status == 200 and "x-tokenway-route" not in headers and "x-tokenway-prompt-tokens" not in headers
    status, _, headers = asyncio.run(
        send(gateway, "alice", text, headers={"x-tokenway-debug": "1", "x-tokenway-admin-token": ADMIN})
    )
    assert status == 200 and "x-tokenway-route" in headers
