"""A pool that finds its engines in Kubernetes, end to end: `tokenway serve` with
`discovery: {kubernetes: ...}` watching a fake API server (tests/support/fake_kube.py), real
simulated engines behind the EndpointSlices, the official `openai` client in front.

Checks what an operator relies on: nothing is routed before a health check passed (an address
with no engine behind it is never served), an address that leaves its slice drains (a stream in
flight on it finishes) and leaves the pool, and a 410 Gone from the API server ends in a relist,
not in a stale pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest

from tests.support.fake_kube import FakeKubeApi, endpoint_slice
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, SimEngines, free_port, http_get, running, start_gateway, start_sim

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeKubeApi, SimEngines, Gateway]]:
    workdir = tmp_path_factory.mktemp("k8s-discovery")
    api = FakeKubeApi().start()
    engines = start_sim(workdir, count=2, served_model_name=MODEL)
    pool = {
        "name": "k8s",
        "model": MODEL,
        "engine": "vllm",
        "discovery": {
            "kubernetes": {
                "namespace": "inference",
                "service": "engines",
                "port": "http",
                "api_server": api.url,
                "retry_backoff_s": 0.1,
                "drain_timeout_s": 60,
            }
        },
    }
    gateway = start_gateway(workdir / "gw", pools=[pool], wait_ready=False, backends={"health_interval_s": 0.2})
    with running(api, engines, gateway):
        yield api, engines, gateway


def _endpoints(gateway: Gateway) -> dict[str, str]:
    status, text = http_get(gateway.url + "/admin/backends")
    assert status == 200, text
    return {e["id"]: e["state"] for p in orjson.loads(text)["pools"] for e in p["endpoints"]}


def _slice(name: str, engines: SimEngines, index: int, pod: str) -> dict[str, Any]:
    return endpoint_slice(name, "engines", [("127.0.0.1", pod)], port=engines.ports[index])


def _ask(gateway: Gateway, max_tokens: int = 4) -> str:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens
    )
    return str(raw.headers["x-tokenway-endpoint"])


def test_discovered_engines_serve_after_a_health_check_and_drain_when_they_leave(
    world: tuple[FakeKubeApi, SimEngines, Gateway],
) -> None:
    api, engines, gateway = world
    assert http_get(gateway.url + "/readyz")[0] == 503  # no engine yet: not ready for traffic
    api.upsert(_slice("engines-a", engines, 0, "engine-0"), namespace="inference")
    wait_for(lambda: http_get(gateway.url + "/readyz")[0] == 200)
    assert _ask(gateway) == "k8s/engine-0"

    # a second slice: one real engine and one address with nothing behind it
    dead = endpoint_slice("engines-b", "engines", [("127.0.0.1", "ghost")], port=free_port())
    api.upsert(dead, namespace="inference")
    api.upsert(_slice("engines-c", engines, 1, "engine-1"), namespace="inference")
    wait_for(lambda: _endpoints(gateway).get("k8s/engine-1") == "ready")
    served = {_ask(gateway) for _ in range(12)}
    assert served <= {"k8s/engine-0", "k8s/engine-1"}
    assert _endpoints(gateway)["k8s/ghost"] != "ready"

    # a stream in flight on engine-0 when its pod leaves the slice still finishes
    result: dict[str, Any] = {}

    def stream() -> None:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer"}],
            max_tokens=3000,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": "s"},
        )
        result["chunks"] = list(chunks)

    api.delete("engines-c", namespace="inference")  # engine-1 leaves: only engine-0 (and the ghost) remain
    wait_for(lambda: "k8s/engine-1" not in _endpoints(gateway))
    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: any(v == "ready" for v in _endpoints(gateway).values()) and _inflight(gateway, "k8s/engine-0") > 0)
    api.delete("engines-a", namespace="inference")
    wait_for(lambda: _endpoints(gateway).get("k8s/engine-0") == "draining")
    thread.join(120)
    chunks = result["chunks"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3000
    wait_for(lambda: "k8s/engine-0" not in _endpoints(gateway))
    assert http_get(gateway.url + "/readyz")[0] == 503  # only the ghost is left


def test_gone_relists(world: tuple[FakeKubeApi, SimEngines, Gateway]) -> None:
    api, engines, gateway = world
    lists = api.lists
    api.compact()
    api.upsert(_slice("engines-d", engines, 1, "engine-1b"), namespace="inference")
    wait_for(lambda: api.lists > lists)
    wait_for(lambda: _endpoints(gateway).get("k8s/engine-1b") == "ready")
    assert _ask(gateway) == "k8s/engine-1b"


def _inflight(gateway: Gateway, endpoint_id: str) -> int:
    _, text = http_get(gateway.url + "/admin/backends")
    for pool in orjson.loads(text)["pools"]:
        for e in pool["endpoints"]:
            if e["id"] == endpoint_id:
                return int(e["inflight_requests"])
    return 0
