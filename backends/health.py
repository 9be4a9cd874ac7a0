"""Endpoint health: passive signals from the relay, active checks on an interval, half-open probes.

Passive: the gateway's relay calls `report_failure` on a connect error or a 5xx and `report_success`
on any other answer. `consecutive_failures` in a row eject a READY endpoint: it becomes UNHEALTHY
until a cooldown ends. Active: `run` probes READY endpoints' health path on an interval (the same
threshold ejects), probes static endpoints that have not answered yet, and, once an ejected
endpoint's cooldown is over, sends one half-open probe that decides: success brings it back to
READY, failure ejects it again with a doubled cooldown (up to a maximum).

Launched replicas in STARTING, DRAINING or DEAD belong to the supervisor; health never touches them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from backends.adapters.base import Probe
from backends.adapters.registry import get_adapter
from backends.config import BackendsSettings, EjectionSettings
from backends.endpoint_tasks import EndpointTasks
from backends.fleet import Fleet
from backends.types import Endpoint, EndpointState

log = logging.getLogger(__name__)

DEFAULT_EJECTION = EjectionSettings()


def report_success(endpoint: Endpoint) -> None:
    """An upstream answer that was not a server error: the failure streak ends."""
    endpoint.consecutive_failures = 0


def report_failure(endpoint: Endpoint, now_s: float, ejection: EjectionSettings = DEFAULT_EJECTION) -> bool:
    """A connect error or 5xx from the endpoint. Returns True when this failure ejected it."""
    endpoint.consecutive_failures += 1
    if endpoint.state is EndpointState.READY and endpoint.consecutive_failures >= ejection.consecutive_failures:
        eject(endpoint, now_s, ejection, f"{endpoint.consecutive_failures} consecutive failures")
        return True
    return False


def eject(endpoint: Endpoint, now_s: float, ejection: EjectionSettings, why: str) -> None:
    """UNHEALTHY for a cooldown that doubles with each ejection that was not followed by recovery."""
    cooldown_s = min(ejection.cooldown_s * 2**endpoint.ejections, ejection.max_cooldown_s)
    endpoint.ejections += 1
    endpoint.state = EndpointState.UNHEALTHY
    endpoint.ejected_until_s = now_s + cooldown_s
    endpoint.state_reason = f"ejected: {why}; half-open probe in {cooldown_s:g}s"
    log.warning("endpoint %s ejected for %.1fs: %s", endpoint.id, cooldown_s, why)


def recover(endpoint: Endpoint) -> None:
    """A successful probe: READY again, streaks and cooldowns reset."""
    if endpoint.state is not EndpointState.READY:
        log.info("endpoint %s is ready", endpoint.id)
    endpoint.state = EndpointState.READY
    endpoint.consecutive_failures = 0
    endpoint.ejections = 0
    endpoint.ejected_until_s = 0.0
    endpoint.state_reason = ""


def half_open_due(endpoint: Endpoint, now_s: float) -> bool:
    return endpoint.state is EndpointState.UNHEALTHY and now_s >= endpoint.ejected_until_s


async def probe(endpoint: Endpoint, session: aiohttp.ClientSession, timeout_s: float) -> Probe:
    """One GET of the endpoint's health path, interpreted by its engine's adapter."""
    adapter = get_adapter(endpoint.engine)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    try:
        async with session.get(
            endpoint.base_url + adapter.health_path,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            await response.read()
            return adapter.classify_health(response.status, response.headers)
    except (TimeoutError, aiohttp.ClientConnectionError):
        return adapter.classify_health(None, {})
    except aiohttp.ClientError:
        return Probe.FAILING


class HealthChecker:
    """The active side: one pass decides which endpoints to probe now and applies the outcomes."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._last_probe_s: dict[str, float] = {}
        self._active_failures: dict[str, int] = {}  # kept apart from the relay's passive streak
        self._tasks = EndpointTasks("health")

    def due(self, endpoint: Endpoint, now_s: float) -> bool:
        if self._tasks.busy(endpoint.id):
            return False
        if endpoint.state is EndpointState.UNHEALTHY:
            return half_open_due(endpoint, now_s)
        if endpoint.launched and endpoint.state is not EndpointState.READY:
            return False  # the supervisor watches starting, draining and dead replicas
        if endpoint.state not in (EndpointState.READY, EndpointState.STARTING):
            return False
        remote = not get_adapter(endpoint.engine).launches
        interval_s = self.settings.remote_health_interval_s if remote else self.settings.health_interval_s
        if endpoint.state is EndpointState.STARTING:
            interval_s = min(interval_s, self.settings.health_interval_s)  # static, not yet answered
        return now_s - self._last_probe_s.get(endpoint.id, float("-inf")) >= interval_s

    async def check(self, endpoint: Endpoint, session: aiohttp.ClientSession) -> None:
        self._last_probe_s[endpoint.id] = self.clock()
        verdict = await probe(endpoint, session, self.settings.health_timeout_s)
        self.apply(endpoint, verdict, self.clock())

    def apply(self, endpoint: Endpoint, verdict: Probe, now_s: float) -> None:
        ejection = self.settings.ejection
        if endpoint.launched and endpoint.state not in (EndpointState.READY, EndpointState.UNHEALTHY):
            return  # the supervisor moved it on (restart, drain) while the probe was in flight
        if verdict is Probe.READY:
            self._active_failures[endpoint.id] = 0
            if endpoint.state in (EndpointState.UNHEALTHY, EndpointState.STARTING):
                recover(endpoint)
            return
        if endpoint.state is EndpointState.UNHEALTHY:
            eject(endpoint, now_s, ejection, f"half-open probe failed ({verdict.value})")
        elif endpoint.state is EndpointState.STARTING:
            if verdict is Probe.FAILING:
                eject(endpoint, now_s, ejection, "not answering its health check")
        elif endpoint.state is EndpointState.READY:
            count = self._active_failures.get(endpoint.id, 0) + 1
            self._active_failures[endpoint.id] = count
            if count >= ejection.consecutive_failures:
                self._active_failures[endpoint.id] = 0
                eject(endpoint, now_s, ejection, f"{count} failed health checks")

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        """Start the probes that are due; each runs as its own task so a slow one delays no other."""
        now_s = self.clock()
        for endpoint in fleet.endpoints():
            if self.due(endpoint, now_s):
                self._tasks.start(endpoint.id, self.check(endpoint, session))

    async def close(self) -> None:
        await self._tasks.close()


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Active health checks until cancelled."""
    checker = HealthChecker(settings, clock)
    tick_s = min(settings.health_interval_s, settings.ejection.cooldown_s, 0.5)
    try:
        while True:
            checker.tick(fleet, session)
            await asyncio.sleep(tick_s)
    finally:
        await checker.close()
