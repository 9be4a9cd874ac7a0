"""A launched pool under steady load loses a replica to SIGKILL: the supervisor restarts it, the pool
keeps serving, and no non-streamed request fails (the relay's retry moves the broken ones).

Real processes throughout: simulated engines launched through the vLLM adapter (`engine_bin`), the
gateway as a subprocess, the official `openai` client with its own retries off.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.supervisor import Supervisor
from backends.types import EndpointState
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, free_ports, http_get, start_gateway, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
SIM_BIN = [sys.executable, "-m", "sim"]
MESSAGES = [{"role": "user", "content": "Name a colour."}]


class SteadyLoad:
    """`workers` threads sending non-streamed chat completions back to back until stopped."""

    def __init__(self, base_url: str, workers: int = 4) -> None:
        self.client = openai.OpenAI(base_url=base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = self.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16)  # type: ignore[arg-type]
                assert response.choices[0].message.content is not None
                with self._lock:
                    self.ok += 1
            except Exception as exc:
                with self._lock:
                    self.failures.append(repr(exc))

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until `count` more requests have been served."""
        target = self.ok + count
        wait_for(
            lambda: self.ok >= target,
            timeout_s=timeout_s,
            interval_s=0.02,
            what=lambda: f"{count} more answers: load stalled at {self.ok} ({self.failures[:3]})",
        )


def backends_status(gateway: Gateway) -> dict[str, Any]:
    status, body = http_get(gateway.url + "/admin/backends")
    assert status == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


def endpoints_of(gateway: Gateway, pool: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = next(p for p in backends_status(gateway)["pools"] if p["name"] == pool)["endpoints"]
    return found


@pytest.fixture
def launched_gateway(tmp_path: Path) -> Iterator[Gateway]:
    """`tokenway serve` launching three simulated replicas itself."""
    pools = [{
        "name": "llm", "model": MODEL, "engine": "vllm", "engine_bin": SIM_BIN, "replicas": 3,
        "extra_args": ["--time-scale", "10"], "ready_timeout_s": 60,
    }]  # fmt: skip
    backends = {
        "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), "port_base": free_ports(6)[0],
        "ready_poll_interval_s": 0.05, "restart_backoff_s": 0.1, "health_interval_s": 0.2,
    }  # fmt: skip
    gateway = start_gateway(tmp_path / "gw", pools=pools, backends=backends, wait_ready=False)
    try:
        assert any(e.get("launched") for e in endpoints_of(gateway, "llm")), endpoints_of(gateway, "llm")
        wait_for(
            lambda: all(e["state"] == "ready" for e in endpoints_of(gateway, "llm")),
            what="three ready replicas",
            timeout_s=60,
        )
        yield gateway
    finally:
        gateway.stop()


def test_sigkill_one_launched_replica_under_load(launched_gateway: Gateway) -> None:
    gateway = launched_gateway
    victim = endpoints_of(gateway, "llm")[1]
    with SteadyLoad(gateway.base_url) as load:
        load.wait_for(20)
        os.kill(victim["pid"], signal.SIGKILL)

        def restarted() -> bool:
            now = next(e for e in endpoints_of(gateway, "llm") if e["id"] == victim["id"])
            return bool(now["restarts"] == 1 and now["state"] == "ready")

        wait_for(restarted, what="the killed replica to be restarted", timeout_s=60)
        load.wait_for(20)
    assert load.failures == []
    assert [e["id"] for e in endpoints_of(gateway, "llm")] == ["llm/both-0", "llm/both-1", "llm/both-2"]


async def test_supervised_replicas_behind_the_gateway_survive_a_sigkill(tmp_path: Path) -> None:
    """The same scenario with the supervisor in this process and the gateway routing to its replicas
    as static endpoints: it holds today, whether or not the gateway launches pools itself."""
    pool = PoolConfig(name="llm", model=MODEL, engine="vllm", engine_bin=SIM_BIN, replicas=3,
                      extra_args=["--time-scale", "10"], ready_timeout_s=60)  # fmt: skip
    settings = BackendsSettings(
        log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / "run"), port_base=free_ports(6)[0],
        ready_poll_interval_s=0.05, restart_backoff_s=0.1,
    )  # fmt: skip
    fleet = Fleet.from_configs([pool])
    supervisor = Supervisor(settings)
    await supervisor.start(fleet)
    try:
        assert await supervisor.wait_ready(60) == []
        endpoints = fleet.pools["llm"].endpoints
        gateway = await asyncio.to_thread(
            start_gateway, tmp_path / "gw", pools=[static_pool("llm", MODEL, [e.base_url for e in endpoints])]
        )
        try:
            victim = endpoints[1]
            load = SteadyLoad(gateway.base_url)
            with load:
                await asyncio.to_thread(load.wait_for, 20)
                os.kill(victim.pid or 0, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while not (victim.restarts == 1 and victim.state is EndpointState.READY):
                    assert time.monotonic() < deadline, "the killed replica was not restarted"
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(load.wait_for, 20)
            assert load.failures == []
        finally:
            await asyncio.to_thread(gateway.stop)
    finally:
        await supervisor.stop()
