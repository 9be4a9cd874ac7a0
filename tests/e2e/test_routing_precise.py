"""Precise prefix routing end to end: the engines' own KV-cache events steer the gateway.

Simulated engines publish vLLM-format KV events over ZMQ (`--kv-events-config`); the gateway runs
with `routing.prefix_index.mode: precise` and subscribes to each endpoint's `kv_events_endpoint`.
Behaviour that only events can explain is checked: a prefix cached by traffic that never passed
through the gateway (sent with the tenant's cache salt: caches are per tenant) attracts the gateway's
requests, and `POST /reset_prefix_cache` on an engine
(which publishes AllBlocksCleared) takes that attraction away again.

The static pool declares `engine: vllm`, so the gateway takes token ids from the engine's `/tokenize`
and re-derives block keys from the events' token ids, as it does for a real vLLM; the launched pool is
`engine: sim`, whose block hashes the gateway reproduces directly.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from policies.policy import cache_salt
from tests.support.procs import (
    TEST_KEY,
    Gateway,
    SimEngines,
    free_port,
    free_ports,
    http_get,
    running,
    start_gateway,
    start_sim,
)

pytestmark = pytest.mark.e2e

TEST_TENANT = "t1"  # TEST_KEY's (tests/support/procs.policies_doc)

MODEL = "llama-3.1-8b"
REPLICAS = 3
EVENT_DELAY_S = 0.5  # an event reaches the gateway within milliseconds; this leaves a wide margin
SUBSCRIBE_DELAY_S = 1.5  # the gateway (re)checks its KV-event subscriptions every second


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimEngines]]:
    """Three engines publishing KV events (one process), static endpoints, precise routing."""
    workdir = tmp_path_factory.mktemp("routing-precise")
    zmq_ports = free_ports(REPLICAS)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq_ports[0]}",
              "topic": "kv-events"}  # fmt: skip
    args = ["--kv-events-config", json.dumps(events)]
    engines = start_sim(workdir, count=REPLICAS, served_model_name=MODEL, args=args)
    pool = {
        "name": "precise",
        "model": MODEL,
        "engine": "vllm",
        "endpoints": [
            {"url": url, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
            for url, port in zip(engines.urls, zmq_ports, strict=True)
        ],
    }
    gateway = start_gateway(workdir / "gw", pools=[pool], routing={"prefix_index": {"mode": "precise"}})
    with running(engines, gateway):
        settle(SUBSCRIBE_DELAY_S)
        yield gateway, engines


def long_text(tag: str, words: int = 500) -> str:
    return " ".join(f"{tag}-{i}" for i in range(words))


def messages(prefix: str, question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


def cached_tokens(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def ask(base_url: str, msgs: list[ChatCompletionMessageParam], debug: bool = True) -> tuple[dict[str, str], Any]:
    """(response headers, completion) of one non-streamed request to `base_url` (gateway or engine)."""
    client = openai.OpenAI(base_url=base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=4,
        extra_headers={"x-tokenway-debug": "1"} if debug else None,
    )  # fmt: skip
    return dict(raw.headers), raw.parse()


def warm(engine_url: str, msgs: list[ChatCompletionMessageParam]) -> Any:
    """One request straight to an engine, in TEST_KEY's tenant's cache (the salt the gateway gives its
    requests: caches are per tenant), as an operator warming that tenant's prefix would send it."""
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key="-", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, extra_body={"cache_salt": cache_salt(f"tenant:{TEST_TENANT}")}
    )


def wait_all_ready(gateway: Gateway, timeout_s: float = 60.0) -> dict[str, str]:
    """Endpoint id -> URL once every endpoint is ready (/readyz only needs one per pool)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = http_get(gateway.url + "/admin/backends")
        assert status == 200, body
        endpoints = [e for p in json.loads(body)["pools"] for e in p["endpoints"]]
        if endpoints and all(e["state"] == "ready" for e in endpoints):
            return {e["id"]: e["url"] for e in endpoints}
        assert time.monotonic() < deadline, f"endpoints not ready: {endpoints}"
        time.sleep(0.05)


def settle(seconds: float = EVENT_DELAY_S) -> None:
    """Give the engine's events time to cross ZMQ into the gateway (asynchronous by nature)."""
    time.sleep(seconds)


def route_field(headers: dict[str, str], name: str) -> str:
    for part in headers["x-tokenway-route"].split("; "):
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
    raise AssertionError(f"{name} not in {headers['x-tokenway-route']}")


def test_a_prefix_cached_behind_the_gateways_back_attracts_its_requests(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, engines = fleet
    prefix = long_text(uuid.uuid4().hex[:8])
    # an engine caches the prefix from a request the gateway never saw
    target = 1
    direct = warm(engines.urls[target], messages(prefix, "warm"))
    settle()
    headers, completion = ask(gateway.base_url, messages(prefix, "And now through the gateway?"))
    assert headers["x-tokenway-endpoint"] == f"precise/both-s{target}"
    assert route_field(headers, "reason") == "prefix-hit"
    assert int(route_field(headers, "cached")) >= direct.usage.prompt_tokens - 32
    assert cached_tokens(completion) >= direct.usage.prompt_tokens - 32


def test_reset_prefix_cache_removes_the_affinity(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, engines = fleet
    prefix = long_text(uuid.uuid4().hex[:8])
    headers, first = ask(gateway.base_url, messages(prefix, "first"))
    holder = headers["x-tokenway-endpoint"]
    index = int(holder.rsplit("-s", 1)[1])
    settle()
    headers, again = ask(gateway.base_url, messages(prefix, "second"))
    assert headers["x-tokenway-endpoint"] == holder
    assert cached_tokens(again) >= first.usage.prompt_tokens - 32
    # the engine drops its whole cache and says so (AllBlocksCleared)
    reset = urllib.request.Request(engines.urls[index] + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(reset, timeout=10) as response:
        assert response.status == 200
    settle()
    headers, after = ask(gateway.base_url, messages(prefix, "third"))
    assert route_field(headers, "cached") == "0"
    assert route_field(headers, "reason") != "prefix-hit"
    assert cached_tokens(after) == 0


def test_launched_pool_with_kv_events_enabled_routes_by_events(tmp_path: Path) -> None:
    """The same through the supervisor: `kv_events: {enabled: true}` on a launched pool."""
    pool = {
        "name": "launched", "model": MODEL, "engine": "sim", "preset": "llama-3.1-8b@h100", "replicas": 2,
        "kv_events": {"enabled": True}, "extra_args": ["--time-scale", "10"], "ready_timeout_s": 60,
    }  # fmt: skip
    zmq_base = free_ports(4)[0]
    backends = {
        "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), "port_base": free_port(),
        "kv_events_port_base": zmq_base, "kv_events_replay_port_base": zmq_base + 2, "ready_poll_interval_s": 0.1,
    }  # fmt: skip
    gateway = start_gateway(
        tmp_path / "gw", pools=[pool], backends=backends, routing={"prefix_index": {"mode": "precise"}}
    )
    with running(gateway):
        endpoints = wait_all_ready(gateway)
        settle(SUBSCRIBE_DELAY_S)  # events published before the subscription exists are not seen
        target = "launched/both-1"
        prefix = long_text(uuid.uuid4().hex[:8])
        direct = warm(endpoints[target], messages(prefix, "warm"))
        settle()
        headers, completion = ask(gateway.base_url, messages(prefix, "via the gateway"))
        assert headers["x-tokenway-endpoint"] == target
        assert route_field(headers, "reason") == "prefix-hit"
        assert cached_tokens(completion) >= direct.usage.prompt_tokens - 32
