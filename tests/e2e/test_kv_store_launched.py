"""A launched simulated pool with a shared KV store (`kv_store:` on an `engine: sim` pool): the
supervisor runs the store beside the replicas, the replicas join it and write what they compute to
it, a store killed with `kill -9` is started again and joined again, and nothing outlives the gateway.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, free_ports, http_get, start_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"


def store_pids(port: int) -> list[int]:
    """The live store processes started for `port` (by their command line, from /proc)."""
    wanted = ["sim", "store", "--host", "127.0.0.1", "--port", str(port)]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(argv[i : i + len(wanted)] == wanted for i in range(len(argv))):
            found.append(int(entry.name))
    return found


def stats(url: str) -> dict[str, Any] | None:
    status, body = http_get(url + "/stats")
    found: dict[str, Any] | None = json.loads(body) if status == 200 else None
    return found


def joined(url: str, replicas: int) -> bool:
    found = stats(url)
    return found is not None and found["feeds"] >= replicas


def test_the_supervisor_runs_the_pools_store_restarts_it_and_stops_it(tmp_path: Path) -> None:
    base = free_ports(3)[0]  # the store, then the two replicas
    pool = {
        "name": "stored",
        "model": MODEL,
        "engine": "sim",
        "replicas": 2,
        "kv_store": {"capacity_tokens": 100_000, "bandwidth_gbps": 10.0, "latency_ms": 1.0},
        "extra_args": ["--time-scale", "50"],
    }
    backends = {"port_base": base, "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run")}
    url = f"http://127.0.0.1:{base}"
    gateway = start_gateway(tmp_path, pools=[pool], backends=backends)
    try:
        wait_for(lambda: joined(url, 2), what="both replicas joined the store", timeout_s=60)
        (first,) = store_pids(base)
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        words = " ".join(f"word{i}" for i in range(400))
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=4)
        wait_for(lambda: (stats(url) or {}).get("written_blocks", 0) > 0, what="the prompt's blocks in the store")

        os.kill(first, signal.SIGKILL)
        wait_for(lambda: store_pids(base) not in ([], [first]), what="the store started again", timeout_s=30)
        wait_for(lambda: joined(url, 2), what="both replicas joined the new store", timeout_s=60)
        assert (stats(url) or {}).get("written_blocks") == 0  # a new store: what the old one held is gone
        other = " ".join(f"other{i}" for i in range(400))  # the first prompt is in the replica's HBM: not computed
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": other}], max_tokens=4)
        wait_for(lambda: (stats(url) or {}).get("written_blocks", 0) > 0, what="blocks written to the new store")
        (second,) = store_pids(base)
    finally:
        gateway.stop()
    assert store_pids(base) == []
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    log = (tmp_path / "logs" / "stored.kv-store.log").read_text()
    assert "kv store of pool stored" in log  # the run header the supervisor writes
