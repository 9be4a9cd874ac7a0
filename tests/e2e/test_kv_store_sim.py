"""A KV store shared by simulated engine processes, end to end (docs/routing.md#kv-cache-tiers).

Real processes: the store (`python -m sim store`), three simulated engines in one process writing to
it and publishing KV events (their own blocks and what they wrote to the store, medium STORE), and a
gateway with the precise index over a pool that declares the store (`kv_store`). A prompt computed on
one replica stays in the store after that replica drops its whole cache: the gateway still sees it
(tier `remote`) and the replica that serves it loads it from the store instead of recomputing it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_routing_precise import (
    MODEL,
    SUBSCRIBE_DELAY_S,
    ask,
    cached_tokens,
    long_text,
    messages,
    route_field,
    settle,
)
from tests.support.polling import wait_for
from tests.support.procs import (
    REPO,
    Gateway,
    SimEngines,
    free_ports,
    http_get,
    running,
    spawn,
    start_gateway,
    start_sim,
    stop_process,
    wait_http,
)

pytestmark = pytest.mark.e2e

REPLICAS = 3


class Store:
    def __init__(self, workdir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "store.log"
        with open(self.log, "wb") as log:
            self.proc = spawn(
                [
                    sys.executable,
                    "-m",
                    "sim",
                    "store",
                    "--port",
                    str(port),
                    "--capacity-tokens",
                    "1000000",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        wait_http(self.url + "/health", proc=self.proc)

    def stats(self) -> dict[str, Any]:
        status, body = http_get(self.url + "/stats")
        assert status == 200, body
        return json.loads(body)  # type: ignore[no-any-return]

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimEngines, Store]]:
    workdir = tmp_path_factory.mktemp("kv-store-sim")
    store_port, *zmq_ports = free_ports(REPLICAS + 1)
    store = Store(workdir, store_port)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq_ports[0]}",
              "topic": "kv-events"}  # fmt: skip
    args = ["--kv-events-config", json.dumps(events), "--kv-store-url", store.url]
    try:
        engines = start_sim(workdir, count=REPLICAS, served_model_name=MODEL, args=args)
    except Exception:
        store.stop()
        raise
    pool = {
        "name": "stored",
        "model": MODEL,
        "engine": "vllm",
        "kv_store": {"capacity_tokens": 1_000_000, "bandwidth_gbps": 10.0, "latency_ms": 1.0},
        "endpoints": [
            {"url": url, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
            for url, port in zip(engines.urls, zmq_ports, strict=True)
        ],
    }
    with running(store, engines):
        gateway = start_gateway(workdir / "gw", pools=[pool], routing={"prefix_index": {"mode": "precise"}})
        with running(gateway):
            settle(SUBSCRIBE_DELAY_S)
            yield gateway, engines, store


def test_a_prefix_in_the_store_outlives_its_replicas_cache(fleet: tuple[Gateway, SimEngines, Store]) -> None:
    gateway, engines, store = fleet
    prefix = long_text(uuid.uuid4().hex[:8])
    headers, first = ask(gateway.base_url, messages(prefix, "first"))
    assert cached_tokens(first) == 0
    holder = int(headers["x-tokenway-endpoint"].rsplit("-s", 1)[1])
    wait_for(lambda: store.stats()["blocks"] >= first.usage.prompt_tokens // 16 - 1, what="the prompt in the store")
    reset = urllib.request.Request(engines.urls[holder] + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(reset, timeout=10) as response:  # HBM and DRAM gone, not the store
        assert response.status == 200
    settle()
    headers, again = ask(gateway.base_url, messages(prefix, "again"))
    assert int(route_field(headers, "cached")) > 0  # the router counts the store's blocks on every replica
    assert cached_tokens(again) >= first.usage.prompt_tokens - 32  # loaded from the store, not recomputed
    assert store.stats()["loads"] >= 1
