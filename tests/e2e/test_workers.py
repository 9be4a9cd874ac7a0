"""`tokenway serve` with `server.workers: 2` and `state: memory`: two worker processes on one port,
a private Redis between them, the engines launched once by the parent (gateway/workers).

Real processes throughout: the group's parent, its workers, its redis-server on a Unix socket, a
launched simulated engine; clients open a new connection per request, so the kernel's SO_REUSEPORT
spread decides which worker answers (each names itself in `x-tokenway-replica`).

- both workers answer, and a key's limit (`rpd: 30`) holds exactly across them under concurrent load;
- `/metrics`, whichever worker answers it, counts the requests of both;
- the engines are launched once, by the parent, whatever the number of workers;
- SIGTERM stops every process of the group, the private Redis included;
- a worker killed outright is restarted and the group serves on;
- with no redis-server installed the group refuses to start, naming the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.polling import wait_for
from tests.support.procs import (
    TEST_KEY,
    Gateway,
    _env,
    all_gone,
    children,
    command_line,
    free_port,
    metric_total,
    policies_doc,
    start_gateway,
)

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

MODEL = "llama-3.1-8b"
LIMIT = 30  # requests per day for TEST_KEY: no refill within a test, so "exactly" is exact
OFFERED = 3 * LIMIT


def _pool() -> dict[str, Any]:
    return {"name": "llama", "model": MODEL, "engine": "sim", "preset": "llama-3.1-8b@h100", "replicas": 1,
            "max_model_len": 8192, "ready_timeout_s": 90}  # fmt: skip


@pytest.fixture
def group(gateway_factory: Callable[..., Gateway], tmp_path: Path) -> Iterator[Gateway]:
    backends = {"log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), "port_base": free_port()}
    policies = policies_doc(limits=[{"scope": "key", "match": {"key": "k1"}, "rpd": LIMIT}])
    gateway = gateway_factory(
        pools=[_pool()],
        policies=policies,
        server={"workers": 2},
        state={"backend": "memory", "keys_db": None},
        backends=backends,
        predictor={"enabled": False},
        ready_timeout_s=120.0,
    )
    _wait_for_both(gateway)  # /readyz answered by one: the other may still be starting
    yield gateway


def _wait_for_both(gateway: Gateway) -> None:
    seen: set[str] = set()

    def both() -> bool:
        reply = httpx.get(gateway.url + "/healthz", timeout=10)  # a new connection each time
        seen.add(reply.headers.get("x-tokenway-replica", ""))
        return len(seen - {""}) == 2

    wait_for(both, timeout_s=60, interval_s=0.0, what=lambda: f"both workers answering (saw {seen})")


def _chat(url: str, key: str = TEST_KEY) -> tuple[int, str]:
    """One request on a connection of its own: (status, the worker that answered)."""
    with httpx.Client(timeout=60.0) as client:
        reply = client.post(
            url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    return reply.status_code, reply.headers.get("x-tokenway-replica", "")


def _workers(gateway: Gateway) -> list[int]:
    return sorted(pid for pid in children(gateway.proc.pid) if "gateway.workers.worker" in command_line(pid))


def _engines(gateway: Gateway) -> list[int]:
    return [pid for pid in children(gateway.proc.pid) if "-m sim serve" in command_line(pid)]


def test_two_workers_share_limits_metrics_and_engines(group: Gateway) -> None:
    assert len(_workers(group)) == 2
    assert len(_engines(group)) == 1  # launched once, by the parent, for both workers
    with ThreadPoolExecutor(max_workers=OFFERED) as pool:
        replies = list(pool.map(lambda _: _chat(group.url), range(OFFERED)))
    statuses = [status for status, _ in replies]
    assert statuses.count(200) == LIMIT, statuses  # exactly the limit, across both workers
    assert statuses.count(429) == OFFERED - LIMIT
    answered_by = {worker for _, worker in replies}
    assert len(answered_by) == 2, answered_by  # the kernel spread the connections over both

    def counted() -> float:
        return metric_total(group.url, "tokenway_requests_total")

    for _ in range(4):  # whichever worker answers the scrape, it counts the group
        assert counted() == OFFERED
    assert metric_total(group.url, "tokenway_workers_scraped") == 2
    for worker in ("0", "1"):  # a gauge is each worker's own reading, labelled
        assert metric_total(group.url, "tokenway_build_info", worker=worker) == 1

    def console_sees_the_group() -> bool:  # the console's overview, whichever worker answers (shared.py)
        doc = httpx.get(group.url + "/admin/activity", timeout=10).json()
        return bool(doc["summary"]["requests"] == OFFERED and len(doc["replicas"]) == 2)

    wait_for(console_sees_the_group, timeout_s=20, what="the console to show both workers' requests")


def test_sigterm_stops_every_process_of_the_group(group: Gateway) -> None:
    descendants = sorted(children(group.proc.pid))
    names = [command_line(pid) for pid in descendants]
    assert any("redis-server" in name for name in names), names
    assert len(_workers(group)) == 2 and len(_engines(group)) == 1
    assert group.stop(signal.SIGTERM) == 0
    assert all_gone(descendants), [command_line(pid) for pid in descendants if os.path.exists(f"/proc/{pid}")]


def test_a_killed_worker_is_restarted(group: Gateway) -> None:
    victim = _workers(group)[0]
    os.kill(victim, signal.SIGKILL)
    assert all_gone([victim])
    wait_for(
        lambda: len(_workers(group)) == 2 and victim not in _workers(group),
        timeout_s=30,
        what=lambda: f"a second worker again (now {_workers(group)})",
    )
    wait_for(lambda: "restarted as pid" in group.log(), timeout_s=30, what="the restart in the log")
    seen: set[str] = set()

    def both_answer() -> bool:  # the survivor serves throughout; the new worker joins once started
        status, worker = _chat(group.url)
        assert status == 200
        seen.add(worker)
        return len(seen) == 2

    wait_for(both_answer, timeout_s=60, interval_s=0.0, what=lambda: f"both workers answering (saw {seen})")


def test_without_redis_server_the_group_names_the_install_command(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()  # a PATH with no redis-server on it
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"server: {{port: {free_port()}, workers: 2}}\npolicies: policies.yaml\n"
        "pools: [{name: p, model: m, engine: vllm, endpoints: [{url: 'http://127.0.0.1:9'}]}]\n"
    )
    (tmp_path / "policies.yaml").write_text("models: {m: {}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--config", str(config)],
        env={**_env(), "PATH": str(bare)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "redis-server" in done.stderr and "apt-get install redis-server" in done.stderr
    assert shutil.which("redis-server", path=str(bare)) is None


def test_a_key_made_through_the_admin_api_survives_a_restart_of_the_group(tmp_path: Path) -> None:
    """The private Redis starts empty each time: the parent puts worker 0's durable copy back before
    any worker answers, so every worker knows the key from its first request."""
    workdir = tmp_path / "gw"
    pools = [{"name": "p", "model": MODEL, "engine": "vllm", "endpoints": [{"url": "http://127.0.0.1:9"}]}]
    sections: dict[str, Any] = {"server": {"workers": 2}, "predictor": {"enabled": False}, "wait_ready": False}
    gateway = start_gateway(workdir, pools=pools, **sections)
    try:
        made = httpx.post(gateway.url + "/admin/keys", json={"tenant": "t1", "id": "survivor"}, timeout=10)
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
    finally:
        assert gateway.stop() == 0
    gateway = start_gateway(workdir, pools=pools, **sections)
    try:
        answered: set[str] = set()
        for _ in range(40):  # new connections: both workers, from the first request on
            reply = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
            assert reply.status_code == 200, reply.text
            answered.add(reply.headers["x-tokenway-replica"])
        assert len(answered) == 2
    finally:
        gateway.stop()
