"""A pool's LoRA memory budget end to end, and the console's adapter view: simulated engines
(`python -m sim --enable-lora --lora-memory-budget-mb`) behind `tokenway serve` with
`lora_memory_budget_mb`. Three 64 MB adapters fit a 200 MB budget; a fourth evicts the least recently
used idle one (the engine lists three, the metrics count an `evict`); an adapter larger than the whole
budget stops the gateway at start-up, naming it (a request-time 400 is the dispatch's safety net:
tests/gateway/test_lora_budget_checks.py); `GET /admin/adapters` and the console's Adapters page show
each replica's adapters, loads and evictions."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.test_console import by_css, page_ready, wait
from tests.support.browser import chromium, require_browser
from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, metric_total, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"
TOKEN = "lora-budget-admin-token"
NAMES = ("a-lora", "b-lora", "c-lora", "d-lora")
ROUTING = {
    "default": {
        "filters": [{"type": "lora-slots"}],
        "scorers": [{"type": "lora-affinity", "weight": 1.0}, {"type": "queue-depth", "weight": 0.1}],
        "picker": {"type": "max-score"},
    }
}


def _gateway(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], huge_mb: float = 0, **extra: Any
) -> Gateway:
    # the simulated engine holds what the gateway budgets (its adapters from s3:// are 64 MB, as declared)
    engines = sim_factory(
        count=1, served_model_name=MODEL, args=["--enable-lora", "--max-loras", "8", "--lora-memory-budget-mb", "200"]
    )
    models: dict[str, Any] = {MODEL: {}}
    for name in NAMES:
        models[name] = {"kind": "adapter", "base": MODEL, "source": f"s3://adapters/{name}", "size_mb": 64}
    if huge_mb:
        models["huge-lora"] = {"kind": "adapter", "base": MODEL, "source": "s3://adapters/huge", "size_mb": huge_mb}
    return gateway_factory(
        pools=[static_pool("base", MODEL, engines.urls, lora_memory_budget_mb=200)],
        policies=policies_doc(models=models),
        routing=ROUTING,
        backends={"lora_discovery_interval_s": 0.2},
        **extra,
    )


def _ask(gateway: Gateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    return httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=60)


def _listed(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def test_the_budget_evicts_and_refuses(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway = _gateway(sim_factory, gateway_factory)
    for name in NAMES:
        answer = _ask(gateway, name)
        assert answer.status_code == 200, answer.text
    engine_url = _engine_url(gateway)
    assert _listed(engine_url) == {"b-lora", "c-lora", "d-lora"}  # a-lora, the least recently used, went
    assert metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="a-lora", event="evict") == 1

    status, body = http_get(gateway.url + "/admin/adapters", timeout_s=10)
    assert status == 200, body
    (pool,) = json.loads(body)["pools"]
    assert pool["name"] == "base" and pool["memory_budget_mb"] == 200.0
    (replica,) = pool["replicas"]
    assert (replica["loads"], replica["evictions"], replica["memory_used_mb"]) == (4, 1, 192.0)
    assert {a["name"] for a in replica["adapters"] if a["held"]} == {"b-lora", "c-lora", "d-lora"}


def test_an_adapter_larger_than_the_budget_stops_the_start(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    with pytest.raises(RuntimeError) as refused:
        _gateway(sim_factory, gateway_factory, huge_mb=300)
    assert (
        "models.huge-lora: adapter 'huge-lora' (300 MB) is larger than the LoRA memory budget (lora_memory_budget_mb) "
        "of base (200 MB)" in str(refused.value)
    )


def _engine_url(gateway: Gateway) -> str:
    status, body = http_get(gateway.url + "/admin/backends", timeout_s=10)
    assert status == 200, body
    return str(json.loads(body)["pools"][0]["endpoints"][0]["url"])


def test_the_console_shows_adapters_per_replica(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    require_browser()
    gateway = _gateway(sim_factory, gateway_factory, server={"admin_token": TOKEN})
    for name in NAMES:
        assert _ask(gateway, name).status_code == 200
    with chromium() as driver:
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys(TOKEN)
        wait(driver, by_css("#login-submit")).click()
        wait(driver, by_css("#nav"))
        driver.get(gateway.url + "/ui#adapters")
        wait(driver, page_ready("adapters"))
        row = wait(driver, by_css('#adapters-base tbody tr[data-id="base/both-s0"]'))
        cells = [td.text for td in row.find_elements("css selector", "td")]
        headers = [th.text for th in driver.find_elements("css selector", "#adapters-base th")]
        shown = dict(zip(headers, cells, strict=True))
        assert shown["Registered"] == "b-lora, c-lora, d-lora", shown
        assert shown["Memory"] == "192.0 / 200.0 MB" and shown["Loads"] == "4" and shown["Evictions"] == "1", shown
        card = driver.find_element("css selector", '#adapters [data-pool="base"]').text
        assert "memory budget 200.0 MB" in card and "adapters 4" in card
