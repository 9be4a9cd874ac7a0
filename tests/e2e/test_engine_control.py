"""Clients never steer the engine beyond what policy allows (a real gateway in front of an engine that
records the bodies it receives): engine-control fields are dropped unless the tenant may set them,
the engine priority is the tenant's tier, a malformed event from the engine does not become a 500 or a
leak, and requests that crash the engine whatever endpoint they reach do not eject the endpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from policies.policy import cache_salt
from tests.support.engine_control import HOSTILE_FIELDS, SHED_KEY, TRUSTED_KEY, engine_control_policies
from tests.support.procs import REPO, TEST_KEY, Gateway, free_port, http_get, stop_process, wait_http

pytestmark = pytest.mark.e2e

ADMIN = "engine-control-admin"


@dataclass
class Recorder:
    proc: subprocess.Popen[bytes]
    url: str

    def bodies(self) -> list[dict[str, Any]]:
        status, text = http_get(self.url + "/_bodies")
        assert status == 200, text
        return list(json.loads(text))

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def recorder_factory() -> Iterator[Callable[..., Recorder]]:
    started: list[Recorder] = []

    def start(*args: str) -> Recorder:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.recording_engine", "--port", str(port), *args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        recorder = Recorder(proc, f"http://127.0.0.1:{port}")
        started.append(recorder)
        wait_http(recorder.url + "/health", proc=proc)
        return recorder

    yield start
    for recorder in started:
        recorder.stop()


def policies() -> dict[str, Any]:
    return {**engine_control_policies("m"), "limits": [{"scope": "key", "max_concurrent": 1000}]}


def gateway_over(gateway_factory: Callable[..., Gateway], urls: list[str]) -> Gateway:
    pool = {"name": "p", "model": "m", "engine": "vllm", "endpoints": [{"url": u} for u in urls]}
    return gateway_factory(pools=[pool], policies=policies(), server={"admin_token": ADMIN})


def chat(gateway: Gateway, key: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return httpx.post(
        gateway.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def admin(gateway: Gateway, path: str) -> Any:
    status, text = http_get(gateway.url + path, {"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, text
    return json.loads(text)


def test_engine_control_fields_from_clients_never_reach_the_engine(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    engine = recorder_factory()
    gateway = gateway_over(gateway_factory, [engine.url])
    for stream in (False, True):
        response = chat(gateway, TEST_KEY, stream=stream, **HOSTILE_FIELDS)
        assert response.status_code == 200, response.text
    for body in engine.bodies():
        leaked = {name for name in HOSTILE_FIELDS if name in body and name not in ("priority", "cache_salt")}
        assert leaked == set(), f"engine-control fields reached the engine: {sorted(leaked)}"
        assert body.get("priority") != -2  # the client's "critical" (2) is not what the engine sees
        assert body["cache_salt"] == cache_salt("tenant:t1")  # the gateway's, the tenant's own cache


def test_a_trusted_tenant_passes_the_fields_its_policy_names(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    engine = recorder_factory()
    gateway = gateway_over(gateway_factory, [engine.url])
    assert chat(gateway, TRUSTED_KEY, **HOSTILE_FIELDS).status_code == 200
    (body,) = engine.bodies()
    assert body["cache_salt"] == cache_salt("tenant:trusted", "my-salt")  # its own, within its own cache
    assert body["priority"] == -2  # its own priority 2, on vLLM's scale (lower runs first)
    assert "kv_transfer_params" not in body and "vllm_xargs" not in body


def test_the_engine_priority_is_the_tenants_tier(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    engine = recorder_factory()
    gateway = gateway_over(gateway_factory, [engine.url])
    assert chat(gateway, SHED_KEY, priority=2).status_code == 200  # a sheddable tenant asks for critical
    assert chat(gateway, TEST_KEY).status_code == 200
    shed, normal = engine.bodies()
    assert shed["priority"] == 2  # sheddable (-2) on vLLM's scale: last
    assert normal.get("priority", 0) == 0


def test_a_malformed_event_from_the_engine_neither_500s_nor_leaks(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    engine = recorder_factory("--bad-sse")
    gateway = gateway_over(gateway_factory, [engine.url])
    for _ in range(3):
        response = chat(gateway, TEST_KEY, stream=True)
        assert response.status_code == 200
        assert "data: [DONE]" in response.text
    assert "failed unexpectedly" not in gateway.log()
    rows = admin(gateway, "/admin/status")["limits"]
    assert sum(r.get("active", 0) for r in rows if r.get("kind") == "concurrency") == 0


def test_requests_that_crash_every_engine_do_not_eject_the_endpoints(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = [recorder_factory("--fail-on", "poison"), recorder_factory("--fail-on", "poison")]
    gateway = gateway_over(gateway_factory, [e.url for e in engines])
    for _ in range(6):  # each one fails on both endpoints (a retry): the input, not the endpoints
        assert chat(gateway, TEST_KEY, poison=True).status_code == 502
    endpoints = [e for p in admin(gateway, "/admin/backends")["pools"] for e in p["endpoints"]]
    assert [e["state"] for e in endpoints] == ["ready", "ready"], endpoints
    assert chat(gateway, TEST_KEY).status_code == 200


def test_a_client_gone_during_the_engine_tokenizer_call_leaves_no_lease(
    recorder_factory: Callable[..., Recorder], gateway_factory: Callable[..., Gateway]
) -> None:
    """Precise prefix routing asks the engine's /tokenize first (here it takes 3 s)."""
    engine = recorder_factory("--slow-tokenize", "3")
    pool = {"name": "p", "model": "m", "engine": "vllm", "endpoints": [{"url": engine.url}]}
    gateway = gateway_factory(
        pools=[pool],
        policies=policies(),
        server={"admin_token": ADMIN},
        routing={"prefix_index": {"mode": "precise"}},
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "tokenize me slowly"}], "max_tokens": 4}
    for _ in range(4):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                gateway.base_url + "/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {TEST_KEY}"},
                timeout=0.3,  # gone while the gateway waits for the engine's tokenizer
            )
    deadline = time.monotonic() + 30
    active = -1
    while time.monotonic() < deadline:
        rows = admin(gateway, "/admin/status")["limits"]
        active = sum(r.get("active", 0) for r in rows if r.get("kind") == "concurrency")
        if active == 0:
            break
        time.sleep(0.1)
    assert active == 0
