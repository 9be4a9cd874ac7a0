"""Health: passive ejection after consecutive failures, cooldown, half-open probe, active checks."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from backends.adapters.base import Probe
from backends.config import BackendsSettings, EjectionSettings
from backends.fleet import Fleet, HealthChecker, Pool, probe, report_failure, report_success, run
from backends.types import Endpoint, EndpointState
from tests.backends.builders import pool
from tests.backends.fake_engine import fake_engine
from tests.support.polling import wait_for_async

EJECTION = EjectionSettings(consecutive_failures=3, cooldown_s=5.0, max_cooldown_s=12.0)


def endpoint(**fields: Any) -> Endpoint:
    fields.setdefault("id", "p/both-0")
    fields.setdefault("pool", "p")
    fields.setdefault("base_url", "http://127.0.0.1:1")
    fields.setdefault("engine", "vllm")
    fields.setdefault("served_model", "m")
    fields.setdefault("state", EndpointState.READY)
    return Endpoint(**fields)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_consecutive_failures_eject_for_a_cooldown() -> None:
    e = endpoint()
    assert not report_failure(e, 100.0, EJECTION)
    assert not report_failure(e, 100.0, EJECTION)
    assert e.state is EndpointState.READY
    assert report_failure(e, 100.0, EJECTION)
    assert e.state is EndpointState.UNHEALTHY  # type: ignore[comparison-overlap]
    assert e.ejected_until_s == 105.0
    assert "3 consecutive failures" in e.state_reason


def test_a_success_breaks_the_streak() -> None:
    e = endpoint()
    report_failure(e, 0.0, EJECTION)
    report_failure(e, 0.0, EJECTION)
    report_success(e)
    report_failure(e, 0.0, EJECTION)
    assert e.state is EndpointState.READY


@pytest.mark.parametrize(
    "state", [EndpointState.STARTING, EndpointState.DRAINING, EndpointState.DEAD, EndpointState.UNHEALTHY]
)
def test_only_ready_endpoints_are_ejected(state: EndpointState) -> None:
    e = endpoint(state=state)
    for _ in range(5):
        report_failure(e, 0.0, EJECTION)
    assert e.state is state


def test_half_open_probe_decides_and_cooldown_doubles_up_to_max() -> None:
    clock = Clock()
    checker = HealthChecker(BackendsSettings(ejection=EJECTION), clock)
    e = endpoint()
    for _ in range(3):
        report_failure(e, clock.now_s, EJECTION)
    assert not checker.due(e, clock.now_s + 4.9)  # still cooling down: no probe
    assert checker.due(e, clock.now_s + 5.0)
    checker.apply(e, Probe.FAILING, 105.0)  # half-open probe fails: ejected again, twice as long
    assert (e.state, e.ejected_until_s) == (EndpointState.UNHEALTHY, 115.0)
    checker.apply(e, Probe.FAILING, 115.0)
    assert e.ejected_until_s == 127.0  # capped at max_cooldown_s
    checker.apply(e, Probe.READY, 127.0)  # half-open probe succeeds
    assert (e.state, e.consecutive_failures, e.ejections, e.state_reason) == (EndpointState.READY, 0, 0, "")
    for _ in range(3):
        report_failure(e, 200.0, EJECTION)
    assert e.ejected_until_s == 205.0  # recovery reset the doubling


def test_active_checks_eject_after_the_same_threshold_and_leave_supervised_states_alone() -> None:
    checker = HealthChecker(BackendsSettings(ejection=EJECTION))
    e = endpoint()
    checker.apply(e, Probe.FAILING, 0.0)
    checker.apply(e, Probe.FAILING, 0.0)
    checker.apply(e, Probe.READY, 0.0)
    checker.apply(e, Probe.FAILING, 0.0)
    checker.apply(e, Probe.FAILING, 0.0)
    assert e.state is EndpointState.READY
    checker.apply(e, Probe.FAILING, 0.0)
    assert e.state is EndpointState.UNHEALTHY  # type: ignore[comparison-overlap]
    launched = endpoint(state=EndpointState.STARTING, launched=True)
    assert not checker.due(launched, 0.0)
    checker.apply(launched, Probe.READY, 0.0)  # a probe that was in flight when the supervisor restarted it
    assert launched.state is EndpointState.STARTING


def test_static_endpoint_becomes_ready_after_its_first_probe() -> None:
    checker = HealthChecker(BackendsSettings())
    e = endpoint(state=EndpointState.STARTING)
    assert checker.due(e, 0.0)
    checker.apply(e, Probe.READY, 0.0)
    assert e.state is EndpointState.READY


@pytest.mark.slow
async def test_ejected_endpoint_recovers_through_a_real_half_open_probe() -> None:
    settings = BackendsSettings(
        health_interval_s=0.05, ejection=EjectionSettings(consecutive_failures=2, cooldown_s=0.05)
    )
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/health", 503)
        fleet = Fleet.from_configs([pool(name="p", engine="vllm", endpoints=[{"url": engine.base_url}])])
        e = fleet.pools["p"].endpoints[0]
        task = asyncio.create_task(run(fleet, session, settings))
        try:
            await wait_for_state(e, EndpointState.UNHEALTHY)  # static: first probe fails
            assert e.state_reason.startswith("ejected: not answering its health check")  # the probe's 503
            engine.set("/health", 200)
            await wait_for_state(e, EndpointState.READY)
            # Passive failures eject it; the next half-open probe (engine healthy) brings it back.
            report_failure(e, asyncio.get_running_loop().time(), settings.ejection)
            report_failure(e, asyncio.get_running_loop().time(), settings.ejection)
            assert e.state is EndpointState.UNHEALTHY
            await wait_for_state(e, EndpointState.READY)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_remote_api_health_uses_models_with_its_key() -> None:
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/v1/models", 200, '{"data": []}')
        e = endpoint(engine="openai", base_url=engine.base_url, api_key="sk-x", state=EndpointState.STARTING)
        assert await probe(e, session, 1.0) is Probe.READY
        assert engine.hits == {"/v1/models": 1}
        closed = endpoint(engine="openai", base_url="http://127.0.0.1:9", state=EndpointState.STARTING)
        assert await probe(closed, session, 1.0) is Probe.FAILING


async def wait_for_state(e: Endpoint, state: EndpointState) -> None:
    await wait_for_async(lambda: e.state is state, what=f"{e.id} to be {state.value}")


def pool_of(count: int) -> Pool:
    p = Pool(pool(endpoints=[{"url": f"http://127.0.0.1:{1000 + i}"} for i in range(count)]))
    p.endpoints = [endpoint(id=f"p/both-{i}") for i in range(count)]
    return p


@pytest.mark.parametrize(
    ("count", "percent", "ejectable"),
    [
        pytest.param(1, 50.0, 0, id="the-only-endpoint-stays"),
        pytest.param(2, 50.0, 1, id="one-of-two"),
        pytest.param(2, 0.0, 1, id="one-may-always-go"),
        pytest.param(4, 50.0, 2, id="half-of-four"),
        pytest.param(4, 100.0, 3, id="never-the-last"),
        pytest.param(10, 10.0, 1, id="envoy-default-ten-percent"),
    ],
)
def test_ejections_are_capped_so_the_pool_never_empties(count: int, percent: float, ejectable: int) -> None:
    ejection = EjectionSettings(consecutive_failures=1, max_ejection_percent=percent)
    p = pool_of(count)
    for e in p.endpoints:  # every endpoint fails at once (an overload, a poison request)
        report_failure(e, 0.0, ejection, p)
    out = [e for e in p.endpoints if e.state is EndpointState.UNHEALTHY]
    assert len(out) == ejectable
    assert p.has_ready
    kept = [e for e in p.endpoints if e.state is EndpointState.READY]
    assert all("withheld" in e.state_reason for e in kept[: count - ejectable - 1])


def test_the_cap_also_holds_for_failed_health_checks() -> None:
    checker = HealthChecker(BackendsSettings(ejection=EjectionSettings(consecutive_failures=1)))
    p = pool_of(2)
    for e in p.endpoints:
        checker.apply(e, Probe.FAILING, 0.0, p)
    assert [e.state for e in p.endpoints].count(EndpointState.READY) == 1


def test_a_failed_probe_of_an_endpoint_busy_serving_does_not_count() -> None:
    clock = Clock()
    settings = BackendsSettings(ejection=EjectionSettings(consecutive_failures=2), health_interval_s=1.0)
    checker = HealthChecker(settings, clock)
    streaming, answering, idle = endpoint(id="p/a"), endpoint(id="p/b"), endpoint(id="p/c")
    for _ in range(5):  # health checks time out while tokens flow and requests are answered
        clock.now_s += 1.0
        streaming.inflight.last_token_s = clock.now_s - 0.5
        report_success(answering, clock.now_s - 0.5)
        for e in (streaming, answering, idle):
            checker.apply(e, Probe.STARTING, clock.now_s)
    assert streaming.state is EndpointState.READY and answering.state is EndpointState.READY
    assert idle.state is EndpointState.UNHEALTHY
    clock.now_s += 100.0  # silent since: failed probes count again
    checker.apply(streaming, Probe.STARTING, clock.now_s)
    checker.apply(streaming, Probe.STARTING, clock.now_s)
    assert streaming.state is EndpointState.UNHEALTHY  # type: ignore[comparison-overlap]
