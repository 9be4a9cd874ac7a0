"""The executor with the real supervisor and simulated engines as subprocesses: starts on free
simulated devices, drains before it stops, sleeps and wakes, and never starts past the budget."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from backends.autoscale.executor import Executor
from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.supervisor import Supervisor
from backends.types import EndpointState, Role
from policies.autoscale.forecast import LeadTimes
from policies.autoscale.types import PoolPlan, RolePlan
from tests.support.polling import wait_for_async
from tests.support.procs import free_ports

pytestmark = pytest.mark.e2e


def elastic_pool(name: str, **fields: Any) -> PoolConfig:
    autoscale = {"min_replicas": 0, "max_replicas": 3, **fields.pop("autoscale", {})}
    config = {"name": name, "model": f"model-{name}", "engine": "sim", "replicas": 1, "devices": "auto"}
    config.update(ready_timeout_s=60, drain_timeout_s=fields.pop("drain_timeout_s", 30), **fields)
    return PoolConfig.model_validate({**config, "autoscale": autoscale})


def settings(tmp_path: Path, devices: list[int]) -> BackendsSettings:
    return BackendsSettings.model_validate(
        {
            "devices": devices,
            "log_dir": str(tmp_path / "logs"),
            "run_dir": str(tmp_path / "run"),
            "port_base": free_ports(1)[0],
            "ready_poll_interval_s": 0.05,
            "term_grace_s": 5.0,
        }
    )


def plan(pool: str, desired: int, role: str = "both") -> PoolPlan:
    return PoolPlan(pool, (RolePlan(role, 0, float(desired), desired, desired),), "test")


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[Supervisor, Executor]] = []

    async def build(pools: list[PoolConfig], devices: list[int]) -> tuple[Fleet, Executor]:
        fleet = Fleet.from_configs(pools)
        backends = settings(tmp_path, devices)
        supervisor = Supervisor(backends)
        await supervisor.start(fleet)
        executor = Executor(supervisor, fleet, backends, lead=LeadTimes())
        made.append((supervisor, executor))
        executor.start()
        return fleet, executor

    yield build
    for supervisor, executor in made:
        await executor.close()
        await supervisor.stop()
        for replica in supervisor.replicas.values():
            assert replica.process is None or not replica.process.alive


def states(fleet: Fleet, pool: str) -> list[str]:
    return [e.state.value for e in fleet.pools[pool].endpoints]


async def test_starts_on_free_devices_and_stops_at_the_budget(executor: Callable[..., Any]) -> None:
    fleet, ex = await executor([elastic_pool("a")], devices=[4, 5])
    endpoints = fleet.pools["a"].endpoints
    assert [e.id for e in endpoints] == ["a/both-0", "a/both-1", "a/both-2"]  # every slot, one launched
    await wait_for_async(
        lambda: states(fleet, "a") == ["ready", "stopped", "stopped"] and ex.settled, what="ready", timeout_s=60
    )
    assert endpoints[0].devices == (4,)
    assert ex.lead.measured("a")["starts_s"]  # the launch was timed

    ex.apply([plan("a", 3)])
    await wait_for_async(
        lambda: states(fleet, "a").count("ready") == 2 and ex.settled, what="a second replica", timeout_s=60
    )
    assert sorted(e.devices for e in endpoints if e.state is EndpointState.READY) == [(4,), (5,)]
    blocked = [ev for ev in ex.events if ev.action == "blocked"]
    assert blocked, "the third replica found no free device"
    assert {(ev.endpoint, ev.detail) for ev in blocked} == {("a/both-2", "no free devices in auto")}
    assert ex.role_state("a", Role.BOTH).active == 2

    ex.apply([plan("a", 1)])
    await wait_for_async(
        lambda: states(fleet, "a").count("ready") == 1 and ex.settled, what="a scale-down", timeout_s=60
    )
    await wait_for_async(
        lambda: states(fleet, "a").count("stopped") == 2, what="the drained replica stopped", timeout_s=60
    )
    stopped = [e for e in endpoints if e.state is EndpointState.STOPPED]
    assert all(e.devices == () for e in stopped)
    assert [ev.action for ev in ex.events if ev.action in ("drain", "stop")] == ["drain", "stop"]
    assert ex.scale_events[("a", "down")] == 1


async def test_drain_waits_for_requests_and_never_aborts(executor: Callable[..., Any]) -> None:
    fleet, ex = await executor([elastic_pool("d", drain_timeout_s=0.2, migrate_streams=False)], devices=[0])
    endpoint = fleet.pools["d"].endpoints[0]
    await wait_for_async(lambda: endpoint.state is EndpointState.READY and ex.settled, what="ready", timeout_s=60)
    ticket = endpoint.inflight.begin(100)  # a request the relay is serving
    ex.apply([plan("d", 0)])
    await wait_for_async(
        lambda: any(ev.action == "drain_timeout" for ev in ex.events), what="the drain to time out", timeout_s=30
    )
    assert endpoint.state is EndpointState.DRAINING  # still waiting: without migration it never cuts a request
    assert ex.drain_timeouts["d"] == 1
    ticket.end()
    await wait_for_async(
        lambda: endpoint.state is EndpointState.STOPPED, what="the stop after the last request", timeout_s=30
    )


async def test_sleep_frees_the_device_and_wake_takes_it_back(executor: Callable[..., Any]) -> None:
    sleepy = elastic_pool("s", autoscale={"sleep": {"level": 1}, "max_replicas": 1}, preset="llama-3.1-8b@h100")
    other = elastic_pool("o", replicas=0, autoscale={"max_replicas": 1})
    fleet, ex = await executor([sleepy, other], devices=[0])
    asleep = fleet.pools["s"].endpoints[0]
    await wait_for_async(lambda: asleep.state is EndpointState.READY and ex.settled, what="ready", timeout_s=60)

    ex.apply([plan("s", 0)])
    await wait_for_async(lambda: asleep.state is EndpointState.SLEEPING and ex.settled, what="asleep", timeout_s=30)
    assert asleep.devices == (0,) and asleep.pid is not None  # the process lives on, bound to its device

    ex.apply([plan("o", 1)])  # the freed device goes to the other pool
    guest = fleet.pools["o"].endpoints[0]
    await wait_for_async(
        lambda: guest.state is EndpointState.READY and ex.settled, what="the other pool on the device", timeout_s=60
    )
    ex.apply([plan("s", 1)])
    assert asleep.state is EndpointState.SLEEPING  # no slot to wake into
    ex.apply([plan("o", 0)])
    await wait_for_async(
        lambda: guest.state is EndpointState.STOPPED and ex.settled, what="the guest stopped", timeout_s=30
    )
    ex.apply([plan("s", 1)])
    await wait_for_async(lambda: asleep.state is EndpointState.READY and ex.settled, what="awake again", timeout_s=30)
    assert ex.lead.measured("s")["wakes_s"]
    assert [ev.action for ev in ex.events if ev.pool == "s"][-2:] == ["wake", "awake"]


async def test_a_warm_reserve_is_started_asleep_and_its_surplus_stopped(executor: Callable[..., Any]) -> None:
    sleepy = elastic_pool(
        "w", autoscale={"sleep": {"level": 1}, "max_replicas": 3, "warm_reserve": 1}, preset="llama-3.1-8b@h100"
    )
    fleet, ex = await executor([sleepy], devices=[0, 1, 2])
    endpoints = fleet.pools["w"].endpoints
    await wait_for_async(lambda: endpoints[0].state is EndpointState.READY and ex.settled, what="ready", timeout_s=60)

    def reserve_plan(desired: int, reserve: int) -> PoolPlan:
        return PoolPlan("w", (RolePlan("both", 0, float(desired), desired, desired, reserve),), "test")

    ex.apply([reserve_plan(1, 1)])  # one serving, one to start and put to sleep
    await wait_for_async(
        lambda: ex.settled and states(fleet, "w").count("sleeping") == 1, what="one asleep in reserve", timeout_s=60
    )
    assert states(fleet, "w").count("ready") == 1
    assert ex.role_state("w", Role.BOTH).active == 1  # the reserve is not counted as serving
    ex.apply([reserve_plan(1, 1)])
    assert ex.settled  # the reserve is full: nothing to do

    ex.apply([reserve_plan(2, 1)])  # a step: the sleeper wakes, and a new one is started for the reserve
    await wait_for_async(
        lambda: ex.settled and states(fleet, "w").count("ready") == 2, what="the sleeper awake", timeout_s=60
    )
    assert any(ev.action == "awake" for ev in ex.events)
    ex.apply([reserve_plan(2, 1)])
    await wait_for_async(
        lambda: ex.settled and states(fleet, "w").count("sleeping") == 1, what="the reserve refilled", timeout_s=60
    )

    ex.apply([reserve_plan(0, 0)])  # down, and no reserve: the drained ones stop, the sleeper too
    await wait_for_async(lambda: ex.settled and states(fleet, "w").count("ready") == 0, what="drained", timeout_s=60)
    ex.apply([reserve_plan(0, 0)])
    await wait_for_async(lambda: ex.settled and states(fleet, "w") == ["stopped"] * 3, what="all stopped", timeout_s=60)
