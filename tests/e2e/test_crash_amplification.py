"""Crash amplification (issue 39, class 15): a request whose content makes the engine fail is not
sent to every replica and every fallback model in turn.

Real processes: simulated engines started with `--fail-on-marker` (a test-only flag: a generation
request whose body holds the marker answers 500 with vLLM's error body, and `GET /internal/faults`
counts them) behind `tokenway serve`, with a fallback model on its own engine. The engines' own
counts say how many times the request reached an engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MODEL, FALLBACK = "llama-3.1-8b", "qwen2.5-7b"
MARKER = "POISON-7f3a"
ADMIN = "crash-admin"


def _faults(engines: SimEngines) -> int:
    total = 0
    for url in engines.urls:
        status, text = http_get(url + "/internal/faults", timeout_s=10)
        assert status == 200, text
        total += int(json.loads(text)["injected_failures"])
    return total


def _chat(gateway: Gateway, content: str, *, stream: bool = False) -> httpx.Response:
    return httpx.post(
        gateway.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": stream},
        headers={"Authorization": f"Bearer {TEST_KEY}"},
        timeout=60,
    )


def _gateway(gateway_factory: Callable[..., Gateway], main: list[str], fallback: list[str]) -> Gateway:
    models: dict[str, Any] = {
        MODEL: {"fallbacks": [{"model": FALLBACK, "triggers": ["upstream_error"]}]},
        FALLBACK: {},
    }
    return gateway_factory(
        pools=[static_pool("llama", MODEL, main), static_pool("qwen", FALLBACK, fallback)],
        policies=policies_doc(models=models, limits=[{"id": "conc", "scope": "key", "max_concurrent": 16}]),
        server={"admin_token": ADMIN},
        routing={"pools": {"llama": {"router": "round-robin"}}},
    )


def _states(gateway: Gateway) -> list[str]:
    status, text = http_get(gateway.url + "/admin/backends", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return [e["state"] for p in json.loads(text)["pools"] for e in p["endpoints"]]


def test_a_request_that_crashes_engines_reaches_two_at_most_and_never_the_fallback(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    main = sim_factory(count=2, served_model_name=MODEL, time_scale=20, args=["--fail-on-marker", MARKER])
    spare = sim_factory(count=1, served_model_name=FALLBACK, time_scale=20, args=["--fail-on-marker", MARKER])
    gateway = _gateway(gateway_factory, main.urls, spare.urls)

    for round_, stream in enumerate((False, True, False, True), start=1):
        response = _chat(gateway, f"please answer {MARKER}", stream=stream)
        assert response.status_code == 502, response.text
        assert response.headers.get("x-should-retry") == "false"
        assert "x-tokenway-fallback" not in response.headers
        error = response.json()["error"]
        assert error["code"] == "upstream_error"
        assert "not retried further" in error["message"]
        assert _faults(main) == 2 * round_  # its replica, then one other: the request's fault after two
        assert _faults(spare) == 0  # never the fallback model

    # the endpoints did not pay for the request's content, and the model still serves
    assert _states(gateway) == ["ready", "ready", "ready"]
    ok = _chat(gateway, "a normal question")
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-tokenway-model"] == MODEL


def test_a_replica_that_fails_a_request_is_replaced_once_by_one_that_serves_it(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    broken = sim_factory(count=1, served_model_name=MODEL, time_scale=20, args=["--fail-on-marker", MARKER])
    healthy = sim_factory(count=1, served_model_name=MODEL, time_scale=20)
    spare = sim_factory(count=1, served_model_name=FALLBACK, time_scale=20, args=["--fail-on-marker", MARKER])
    gateway = _gateway(gateway_factory, [*broken.urls, *healthy.urls], spare.urls)

    for stream in (False, True, False, True):  # round-robin: half of them reach the broken replica first
        response = _chat(gateway, f"please answer {MARKER}", stream=stream)
        assert response.status_code == 200, response.text
        assert response.headers["x-tokenway-endpoint"] == "llama/both-s1"
        assert response.headers["x-tokenway-model"] == MODEL
    assert 1 <= _faults(broken) <= 4
    assert _faults(spare) == 0
