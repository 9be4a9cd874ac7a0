"""Endpoint health: passive signals from the relay, active checks on an interval, half-open probes.

Passive: the gateway's relay calls `report_failure` on a connect error or a 5xx and `report_success`
on any other answer. `consecutive_failures` in a row eject a READY endpoint: it becomes UNHEALTHY
until a cooldown ends. Active: `run` probes READY endpoints' health path on an interval (the same
threshold ejects), probes static endpoints that have not answered yet, and, once an ejected
endpoint's cooldown is over, sends one half-open probe that decides: success brings it back to
READY, failure ejects it again with a doubled cooldown (up to a maximum).

Launched replicas in STARTING, DRAINING or DEAD belong to the supervisor; health never touches them.

Overload must not become an outage. An ejection is withheld when it would put more of the pool's
endpoints (of the same role) out than `max_ejection_percent`, or the last one still in (Envoy's
outlier detection caps ejections the same way); one endpoint may always go. A failed health probe
of an endpoint that answered requests or relayed a token within the last few probe intervals does
not count: an engine busy serving is alive, however slowly its health route answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from backends.adapters import get_adapter
from backends.adapters.base import Probe
from backends.config import BackendsSettings, EjectionSettings
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, EndpointState

log = logging.getLogger(__name__)

DEFAULT_EJECTION = EjectionSettings()


class EndpointTasks:
    """At most one background task per endpoint: the shape shared by health probes and metrics
    scrapes. Each probe or scrape runs as its own task so a slow endpoint delays no other; an
    endpoint whose previous task is still running is skipped rather than piled onto."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._running: dict[str, asyncio.Task[Any]] = {}

    def busy(self, endpoint_id: str) -> bool:
        return endpoint_id in self._running

    def start(self, endpoint_id: str, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work, name=f"{self.kind} {endpoint_id}")
        self._running[endpoint_id] = task
        task.add_done_callback(lambda _task: self._running.pop(endpoint_id, None))

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def report_success(endpoint: Endpoint, now_s: float | None = None) -> None:
    """An upstream answer that was not a server error: the failure streak ends."""
    endpoint.consecutive_failures = 0
    endpoint.answered_at_s = time.monotonic() if now_s is None else now_s


def report_failure(
    endpoint: Endpoint, now_s: float, ejection: EjectionSettings = DEFAULT_EJECTION, pool: Pool | None = None
) -> bool:
    """A connect error or 5xx from the endpoint. Returns True when this failure ejected it
    (`pool`, when given, caps ejections: see the module docstring)."""
    endpoint.consecutive_failures += 1
    if endpoint.state is EndpointState.READY and endpoint.consecutive_failures >= ejection.consecutive_failures:
        return eject_capped(endpoint, pool, now_s, ejection, f"{endpoint.consecutive_failures} consecutive failures")
    return False


def may_eject(endpoint: Endpoint, pool: Pool | None, ejection: EjectionSettings) -> bool:
    """Whether ejecting this READY endpoint keeps its pool within `max_ejection_percent`: among the
    endpoints of its role that health manages (ready or ejected), at most that share out (at least one
    may go), and never the last one in."""
    if pool is None:
        return True
    peers = [
        e
        for e in pool.endpoints
        if e.role is endpoint.role and e.state in (EndpointState.READY, EndpointState.UNHEALTHY)
    ]
    ready = sum(1 for e in peers if e.state is EndpointState.READY)
    if ready <= 1:
        return False
    ejected = len(peers) - ready
    allowed = max(1, int(len(peers) * ejection.max_ejection_percent / 100.0))
    return ejected + 1 <= allowed


def eject_capped(endpoint: Endpoint, pool: Pool | None, now_s: float, ejection: EjectionSettings, why: str) -> bool:
    """Eject unless the cap says no; True when ejected. A withheld ejection is logged once."""
    if may_eject(endpoint, pool, ejection):
        eject(endpoint, now_s, ejection, why)
        return True
    reason = f"ejection withheld ({why}): max_ejection_percent {ejection.max_ejection_percent:g} of the pool"
    if endpoint.state_reason != reason:
        log.warning("endpoint %s not ejected (%s): the pool keeps it serving", endpoint.id, why)
        endpoint.state_reason = reason
    return False


def recently_serving(endpoint: Endpoint, now_s: float, window_s: float) -> bool:
    """An answer or a relayed token from the endpoint within `window_s` (monotonic clock)."""
    last_s = max(endpoint.answered_at_s, endpoint.inflight.last_token_s)
    return last_s > 0.0 and 0.0 <= now_s - last_s <= window_s


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
    if not adapter.health_path:  # a hosted API: not probed (backends/adapters/hosted.py), passive ejection only
        return adapter.classify_health(200, {})
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

    async def check(self, endpoint: Endpoint, session: aiohttp.ClientSession, pool: Pool | None = None) -> None:
        self._last_probe_s[endpoint.id] = self.clock()
        verdict = await probe(endpoint, session, self.settings.health_timeout_s)
        self.apply(endpoint, verdict, self.clock(), pool)

    @property
    def alive_window_s(self) -> float:
        """How recently an endpoint must have served for a failed probe not to count: the span over
        which failed probes would eject it."""
        settings = self.settings
        return max(settings.health_interval_s, settings.health_timeout_s) * settings.ejection.consecutive_failures

    def apply(self, endpoint: Endpoint, verdict: Probe, now_s: float, pool: Pool | None = None) -> None:
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
            if recently_serving(endpoint, now_s, self.alive_window_s):
                self._active_failures[endpoint.id] = 0  # busy, not dead: it is answering requests
                return
            count = self._active_failures.get(endpoint.id, 0) + 1
            self._active_failures[endpoint.id] = count
            if count >= ejection.consecutive_failures:
                self._active_failures[endpoint.id] = 0
                eject_capped(endpoint, pool, now_s, ejection, f"{count} failed health checks")

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        """Start the probes that are due; each runs as its own task so a slow one delays no other."""
        now_s = self.clock()
        for pool in fleet.pools.values():
            for endpoint in pool.endpoints:
                if self.due(endpoint, now_s):
                    self._tasks.start(endpoint.id, self.check(endpoint, session, pool))

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
