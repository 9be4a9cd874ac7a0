"""LoRA adapters end to end: real simulated engines (`python -m sim --enable-lora`) behind `tokenway
serve`. Clients name an adapter as the model (and an alias of it); the gateway routes it to the base
model's pool, loads it on the chosen replica through the engine's `/v1/load_lora_adapter`, and a
second request for an adapter returns to the replica that holds it. A bad adapter source answers a
clear error naming it.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.support.procs import TEST_KEY, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
ROUTING = {
    "default": {
        "filters": [{"type": "lora-slots"}],
        "scorers": [{"type": "lora-affinity", "weight": 1.0}, {"type": "queue-depth", "weight": 0.1}],
        "picker": {"type": "max-score"},
    }
}


def _policies() -> dict[str, Any]:
    models: dict[str, Any] = {
        MODEL: {},
        "sql-lora": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/sql", "aliases": ["sql"]},
        "chat-lora": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/chat"},
        "broken-lora": {"kind": "adapter", "base": MODEL, "source": "/no/such/adapter/dir"},
        "t2-only": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/t2", "tenants": ["t2"]},
    }
    return policies_doc(models=models)


def _ask(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    return httpx.post(f"{base_url}/chat/completions", json=body, headers=headers, timeout=60)


def _adapters(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


@pytest.mark.timeout(120)
def test_adapters_route_load_and_return_to_their_replica(sim_factory: Any, gateway_factory: Any) -> None:
    engines = sim_factory(count=3, served_model_name=MODEL, args=["--enable-lora", "--max-loras", "2"])
    gateway = gateway_factory(pools=[static_pool("base", MODEL, engines.urls)], policies=_policies(), routing=ROUTING)

    first = _ask(gateway.base_url, "sql")  # an alias of the adapter
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "sql-lora"
    sql_endpoint = first.headers["x-tokenway-endpoint"]
    second = _ask(gateway.base_url, "chat-lora")
    assert second.status_code == 200, second.text
    chat_endpoint = second.headers["x-tokenway-endpoint"]

    # each adapter was loaded on the replica that served it, and on no other
    holders = {url: _adapters(url) for url in engines.urls}
    assert sum("sql-lora" in names for names in holders.values()) == 1
    assert sum("chat-lora" in names for names in holders.values()) == 1

    for _ in range(3):  # later requests for an adapter go where it is
        again = _ask(gateway.base_url, "sql-lora")
        assert again.status_code == 200, again.text
        assert again.headers["x-tokenway-endpoint"] == sql_endpoint
        other = _ask(gateway.base_url, "chat-lora")
        assert other.headers["x-tokenway-endpoint"] == chat_endpoint
    assert sum("sql-lora" in names for names in (_adapters(u) for u in engines.urls)) == 1

    anthropic = httpx.post(  # the Anthropic front names adapters alike
        f"{gateway.base_url}/messages",
        json={"model": "sql-lora", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": TEST_KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.headers["x-tokenway-endpoint"] == sql_endpoint

    base = _ask(gateway.base_url, MODEL)  # the base model is served as before
    assert base.status_code == 200 and base.json()["model"] == MODEL

    broken = _ask(gateway.base_url, "broken-lora")  # the engine refuses its source: an answer, not a hang
    assert broken.status_code == 502, broken.text
    assert "broken-lora" in broken.json()["error"]["message"]

    refused = _ask(gateway.base_url, "t2-only")  # an adapter of another tenant
    assert refused.status_code == 403, refused.text

    # an engine that lost its adapters (restarted, or unloaded them itself) answers 404 for one the gateway
    # registered there: the gateway loads it again and the client sees an answer, not the engine's 404
    for url in engines.urls:
        if "sql-lora" in _adapters(url):
            gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}, timeout=10)
            assert gone.status_code == 200, gone.text
    assert not any("sql-lora" in _adapters(url) for url in engines.urls)
    reloaded = _ask(gateway.base_url, "sql-lora")
    assert reloaded.status_code == 200, reloaded.text
    assert sum("sql-lora" in names for names in (_adapters(u) for u in engines.urls)) == 1


@pytest.mark.timeout(120)
def test_a_single_replica_that_lost_an_adapter_reloads_it_for_the_same_request(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """The only replica of a pool answers 404 for an adapter unloaded behind the gateway's back (before any
    listing shows it: discovery is slow here): the gateway loads it there again and sends the request
    again to the same replica, since no other could take it."""
    engines = sim_factory(count=1, served_model_name=MODEL, args=["--enable-lora", "--max-loras", "2"])
    gateway = gateway_factory(
        pools=[static_pool("base", MODEL, engines.urls)],
        policies=_policies(),
        routing=ROUTING,
        backends={"lora_discovery_interval_s": 3600},
    )
    assert _ask(gateway.base_url, "sql-lora").status_code == 200
    (url,) = engines.urls
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}, timeout=10)
    assert gone.status_code == 200, gone.text
    again = _ask(gateway.base_url, "sql-lora")
    assert again.status_code == 200, again.text
    assert "sql-lora" in _adapters(url)
