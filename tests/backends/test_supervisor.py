"""The supervisor with real subprocesses: the simulated engine launched through the vLLM adapter.

Behaviour, not timings: every wait is "until this happens" with a generous ceiling, and the settings
make backoffs and polls short so the suite stays fast.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.plan import is_port_free
from backends.scrape import fleet_status, format_status
from backends.supervisor import Supervisor
from backends.types import Endpoint, EndpointState, PlanError
from tests.backends.builders import pool
from tests.support.polling import wait_for_async
from tests.support.procs import free_ports

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SIM_BIN = [sys.executable, "-m", "sim"]
EXIT_AT_ONCE = [sys.executable, "-c", "import sys; print('fatal: CUDA out of memory (simulated)'); sys.exit(3)"]


def sim_pool(name: str, replicas: int = 1, **fields: Any) -> PoolConfig:
    """A pool launching the simulated engine through the *vLLM* adapter (`engine_bin` overrides)."""
    fields.setdefault("engine_bin", SIM_BIN)
    fields.setdefault("ready_timeout_s", 60)
    return pool(name=name, model=f"model-{name}", engine="vllm", replicas=replicas, **fields)


def make_settings(tmp_path: Path, **fields: Any) -> BackendsSettings:
    defaults: dict[str, Any] = {
        "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), "port_base": free_ports(8)[0],
        "ready_poll_interval_s": 0.05, "restart_backoff_s": 0.05, "restart_backoff_max_s": 0.2,
        "crash_loop_restarts": 3, "term_grace_s": 5.0, "health_timeout_s": 1.0,
    }  # fmt: skip
    return BackendsSettings.model_validate({**defaults, **fields})


@pytest.fixture
async def launched(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await launched(pools, **settings)` -> (fleet, supervisor); everything is stopped afterwards."""
    supervisors: list[Supervisor] = []

    async def start(pools: list[PoolConfig], **fields: Any) -> tuple[Fleet, Supervisor]:
        fleet = Fleet.from_configs(pools)
        supervisor = Supervisor(make_settings(tmp_path, **fields))
        supervisors.append(supervisor)
        await supervisor.start(fleet)
        return fleet, supervisor

    yield start
    for supervisor in supervisors:
        await supervisor.stop()
        for replica in supervisor.replicas.values():
            assert replica.process is None or not replica.process.alive


async def chat(endpoint: Endpoint) -> int:
    body = {"model": endpoint.served_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            endpoint.base_url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
        ) as response,
    ):
        await response.read()
        return response.status


async def test_three_replicas_sigkill_one_is_restarted_while_the_pool_serves(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("llm", replicas=3)])
    assert await supervisor.wait_ready(60) == []
    endpoints = fleet.pools["llm"].endpoints
    assert [e.id for e in endpoints] == ["llm/both-0", "llm/both-1", "llm/both-2"]
    assert all(e.state is EndpointState.READY and e.launched for e in endpoints)
    victim = endpoints[1]
    old_pid = supervisor.replicas[victim.id].process.pid
    port = victim.base_url

    os.kill(old_pid, signal.SIGKILL)
    await wait_for_async(lambda: victim.state is not EndpointState.READY, what="the crash to be noticed", timeout_s=60)
    assert [await chat(e) for e in (endpoints[0], endpoints[2])] == [200, 200]  # the others keep serving
    await wait_for_async(lambda: victim.state is EndpointState.READY, what="the restart", timeout_s=60)

    assert victim.restarts == 1
    assert supervisor.replicas[victim.id].process.pid != old_pid
    assert (victim.id, victim.base_url) == ("llm/both-1", port)  # stable identity
    assert len(fleet.pools["llm"].endpoints) == 3  # no duplicate endpoint on restart
    assert await chat(victim) == 200


async def test_exit_at_once_is_a_crash_loop_with_log_tail_and_other_pools_serve(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("good"), sim_pool("broken", engine_bin=EXIT_AT_ONCE)])
    failures = await supervisor.wait_ready(60)
    assert [f.endpoint_id for f in failures] == ["broken/both-0"]
    broken = fleet.pools["broken"].endpoints[0]
    assert broken.state is EndpointState.DEAD
    assert broken.state_reason.startswith("crash loop: exited 3 times")
    assert "exit code 3" in broken.state_reason
    assert broken.log_tail == ("fatal: CUDA out of memory (simulated)",)
    assert broken.restarts == 2
    assert "fatal: CUDA out of memory" in str(failures[0])
    good = fleet.pools["good"].endpoints[0]
    assert good.state is EndpointState.READY and await chat(good) == 200
    shown = format_status(fleet_status(fleet))
    assert "crash loop" in shown and "| fatal: CUDA out of memory (simulated)" in shown


async def test_never_ready_times_out_with_a_clear_message_while_others_serve(launched: Any) -> None:
    slow = sim_pool("slow", ready_timeout_s=1.0, extra_args=["--startup-delay-s", "9999"])
    fleet, supervisor = await launched([sim_pool("fast"), slow])
    failures = await supervisor.wait_ready(60)
    assert [f.endpoint_id for f in failures] == ["slow/both-0"]
    reason = failures[0].reason
    assert reason.startswith("not ready after 1s (pool 'slow' ready_timeout_s)")
    assert "/health never answered ready" in reason
    assert not supervisor.replicas["slow/both-0"].process.alive
    assert fleet.pools["slow"].endpoints[0].state is EndpointState.DEAD
    fast = fleet.pools["fast"].endpoints[0]
    assert fast.state is EndpointState.READY and await chat(fast) == 200


async def test_drain_waits_for_in_flight_requests_then_stops(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("d", replicas=1)])
    await supervisor.wait_ready(60)
    endpoint = fleet.pools["d"].endpoints[0]
    ticket = endpoint.inflight.begin(prefill_tokens=10)
    drain = asyncio.create_task(supervisor.drain(endpoint.id, timeout_s=60))
    await wait_for_async(lambda: endpoint.state is EndpointState.DRAINING, what="draining", timeout_s=60)
    await asyncio.sleep(0.2)
    assert not drain.done()  # still one request in flight
    assert supervisor.replicas[endpoint.id].process.alive
    ticket.end()
    await asyncio.wait_for(drain, 30)
    assert endpoint.state is EndpointState.DEAD and endpoint.state_reason == "stopped"
    assert not supervisor.replicas[endpoint.id].process.alive


async def test_drain_timeout_bounds_the_wait(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("d", replicas=1, drain_timeout_s=0.1)])
    await supervisor.wait_ready(60)
    endpoint = fleet.pools["d"].endpoints[0]
    endpoint.inflight.begin(prefill_tokens=10)  # never ends
    await asyncio.wait_for(supervisor.drain(endpoint.id), 30)
    assert endpoint.state is EndpointState.DEAD


async def test_restart_relaunches_the_same_replica(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("r", replicas=1)])
    await supervisor.wait_ready(60)
    endpoint = fleet.pools["r"].endpoints[0]
    await supervisor.restart(endpoint.id)
    assert await supervisor.wait_ready(60) == []
    assert endpoint.state is EndpointState.READY and await chat(endpoint) == 200


async def test_missing_executable_is_reported(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("x", engine_bin=["/nonexistent/vllm"])])
    failures = await supervisor.wait_ready(10)
    assert failures[0].reason.startswith("cannot start '/nonexistent/vllm'")
    assert fleet.pools["x"].endpoints[0].state is EndpointState.DEAD


async def test_wait_ready_timeout_names_the_starting_replicas(launched: Any) -> None:
    _, supervisor = await launched([sim_pool("slow", extra_args=["--startup-delay-s", "9999"])])
    with pytest.raises(TimeoutError, match="slow/both-0"):
        await supervisor.wait_ready(0.3)


async def test_unplannable_pools_launch_nothing(tmp_path: Path) -> None:
    fleet = Fleet.from_configs([sim_pool("a", devices=[0, 1])])  # 2 devices for 1 replica x TP 1
    supervisor = Supervisor(make_settings(tmp_path))
    with pytest.raises(PlanError, match="pool 'a'"):
        await supervisor.start(fleet)
    assert supervisor.replicas == {} and fleet.pools["a"].endpoints == []


def test_engines_stop_when_the_gateway_gets_sigint(tmp_path: Path) -> None:
    gateway = textwrap.dedent(f"""
        import asyncio, signal, sys
        from backends.config import BackendsSettings, PoolConfig
        from backends.fleet import Fleet
        from backends.supervisor import Supervisor

        # Ctrl-C's default: a suite started in the background by a non-interactive shell (`cmd &`)
        # hands its children SIGINT ignored, and this stand-in for the gateway installs no handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        async def main():
            pools = [PoolConfig(name="g", model="m", engine="vllm", replicas=2, engine_bin={SIM_BIN!r})]
            settings = BackendsSettings(log_dir={str(tmp_path)!r}, port_base={free_ports(4)[0]},
                                        ready_poll_interval_s=0.05)
            supervisor = Supervisor(settings)
            fleet = Fleet.from_configs(pools)
            await supervisor.start(fleet)
            await supervisor.wait_ready(60)
            print(" ".join(str(r.process.pid) for r in supervisor.replicas.values()), flush=True)
            try:
                await asyncio.sleep(600)
            finally:
                await supervisor.stop()

        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", gateway], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.send_signal(signal.SIGINT)
        parent.wait(60)
        for pid in pids:
            assert _gone(pid), f"engine {pid} outlived the gateway"
    finally:
        if parent.poll() is None:
            parent.kill()


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            if state == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


async def test_trtllm_replica_waits_through_starting_503s_and_learns_its_model_id(launched: Any) -> None:
    stand_in = [sys.executable, str(Path(__file__).with_name("stand_in_trtllm.py"))]
    trt = pool(name="trt", model="llama-3.1-70b", engine="trtllm", engine_model="/models/Llama-3.1-70B-ckpt",
               engine_bin=stand_in, replicas=1, ready_timeout_s=60,
               extra_args=["--starting-s", "0.5", "--served-id", "trt-llama-70b"])  # fmt: skip
    fleet, supervisor = await launched([trt])
    assert await supervisor.wait_ready(60) == []
    endpoint = fleet.pools["trt"].endpoints[0]
    assert endpoint.state is EndpointState.READY
    assert endpoint.served_model == "trt-llama-70b"  # read back from /v1/models, not guessed
    log_text = await asyncio.to_thread(Path(endpoint.log_path or "").read_text)
    assert "answered starting 1" in log_text  # the 503 "starting" answers were waited through
    assert "enable_iter_perf_stats: true" in log_text  # the generated --config file existed at launch


async def test_kv_event_sockets_per_replica(launched: Any) -> None:
    fleet, supervisor = await launched([sim_pool("kv", replicas=2, kv_events={"enabled": True})])
    assert await supervisor.wait_ready(60) == []
    addresses = [(e.kv_events_endpoint, e.kv_events_replay_endpoint) for e in fleet.pools["kv"].endpoints]
    ports = {int(a.rsplit(":", 1)[1]) for pair in addresses for a in pair if a}
    assert len(ports) == 4  # a publisher and a replay socket per replica, none shared
    assert not any(is_port_free("127.0.0.1", port) for port in ports)  # the engines bound them


async def test_a_crashed_leader_s_orphaned_worker_is_killed_before_the_restart(launched: Any) -> None:
    """vLLM's API server killed with SIGKILL leaves EngineCore alive in its group holding the ZMQ port
    (docs/engines.md): the restart waits until the group is gone and the port free, instead of looping."""
    stand_in = [sys.executable, str(Path(__file__).with_name("stand_in_forking_engine.py"))]
    forking = pool(name="fork", model="m", engine="vllm", engine_bin=stand_in, replicas=1, ready_timeout_s=60,
                   kv_events={"enabled": True, "replay": False})  # fmt: skip
    fleet, supervisor = await launched([forking], crash_loop_restarts=2)
    assert await supervisor.wait_ready(60) == []
    endpoint = fleet.pools["fork"].endpoints[0]
    leader = supervisor.replicas[endpoint.id].process
    assert leader is not None
    log_text = await asyncio.to_thread(Path(endpoint.log_path or "").read_text)
    worker = int(log_text.split("worker ")[1].split()[0])

    os.kill(leader.pid, signal.SIGKILL)
    await wait_for_async(
        lambda: endpoint.restarts == 1 and endpoint.state is EndpointState.READY, what="the restart", timeout_s=60
    )
    assert await asyncio.to_thread(_gone, worker), "the old worker outlived its leader"
    assert supervisor.replicas[endpoint.id].failure is None  # no crash loop on `Address already in use`
