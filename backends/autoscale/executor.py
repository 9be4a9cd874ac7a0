"""The executor: carries the planner's decisions out on the autoscaled pools' replicas.

Per pool and role it compares the desired count with the active replicas (ready, starting, waking)
and acts, each action one task per replica (a replica does one thing at a time):

- up: return a replica that is draining for a scale-down (it never left), else wake a sleeping one
  whose devices are free (seconds), else start a stopped slot on free devices (a cold start);
- down: cancel a start that is not ready yet, else drain the ready replica with the fewest requests
  in flight: the router stops sending it requests (DRAINING: no new requests, no PD legs), the
  requests it runs finish — for at most the pool's `drain_timeout_s`; a drain that runs out is
  counted and logged, and the replica is then stopped only if its streams can move to another
  replica (`migrate_streams`), else it waits for them (never an abort) — then it sleeps (pools with
  `autoscale.sleep`) or stops;
- warm reserve (a pool with `sleep` and `warm_reserve`; the plan's `reserve`, which the planner's
  budget fitted under max_replicas): start one replica per pass and put it to sleep while the role
  has fewer asleep than its reserve and its device group a spare slot; stop sleeping ones past the
  reserve; a replica drained for a scale-down sleeps only while the reserve is short, else it stops.
  Replicas still active above `desired` (a scale-down under way) hold the reserve's room meanwhile.

It decides nothing itself: the plans come from `policies.autoscale` through the gateway's loop, read
through the `PoolTarget` protocol (this room imports none above it). Every start and wake is timed
into the `Timings` it is given (`policies.autoscale.forecast.LeadTimes`: the planner's lead, the
cold-start hold's estimate) and every action is an `Event` in a bounded log (`/admin/pools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from backends.autoscale import sleep as sleep_mode
from backends.autoscale.devices import DeviceBudget, group_of
from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet
from backends.plan import device_inventory
from backends.supervisor import Supervisor
from backends.types import Endpoint, EndpointState, Role

log = logging.getLogger(__name__)

_POLL_S = 0.05
_EVENTS_KEPT = 256
_FAILED_SLOT_PAUSE_S = 60.0
# A prefill replica's last KV blocks are read by decode replicas after its prefill legs answered:
# give those pulls time before the process goes (vLLM's NIXL holds blocks for the decode side).
_PD_HANDOFF_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class RoleState:
    """The replicas of one role of a pool, by what they are doing now (what the planner reads)."""

    ready: int = 0
    starting: int = 0  # launching or waking: capacity soon
    draining: int = 0
    sleeping: int = 0
    stopped: int = 0  # slots without a process (never started, scaled down, dead)

    @property
    def active(self) -> int:
        """Replicas that serve now or soon (what the planner counts as current)."""
        return self.ready + self.starting


class RoleTarget(Protocol):
    """What the executor reads of one role's plan (`policies.autoscale.types.RolePlan`)."""

    @property
    def role(self) -> str: ...
    @property
    def desired(self) -> int: ...
    @property
    def reserve(self) -> int | None: ...  # sleeping replicas to keep (None: no bound)


class PoolTarget(Protocol):
    """What the executor reads of one pool's plan (`policies.autoscale.types.PoolPlan`)."""

    @property
    def pool(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def roles(self) -> Sequence[RoleTarget]: ...
    @property
    def desired(self) -> int: ...


class Timings(Protocol):
    """Where the executor's measured start-up and wake-up times go, and the lead it quotes back
    (`policies.autoscale.forecast.LeadTimes`)."""

    def guess(self, pool: str, startup_s: float) -> None: ...
    def observe_start(self, pool: str, seconds: float) -> None: ...
    def observe_wake(self, pool: str, seconds: float) -> None: ...
    def startup_s(self, pool: str) -> float: ...
    def wake_s(self, pool: str) -> float: ...
    def measured(self, pool: str) -> dict[str, list[float]]: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One thing the executor did (or could not do)."""

    at_unix_s: float
    pool: str
    role: str
    # start | ready | wake | awake | drain | undrain | sleep | stop | drain_timeout | fail | blocked
    action: str
    endpoint: str
    detail: str = ""


class Executor:
    def __init__(
        self,
        supervisor: Supervisor,
        fleet: Fleet,
        settings: BackendsSettings,
        *,
        lead: Timings,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.fleet = fleet
        self.settings = settings
        self.clock = clock
        # (pool, action) after a replica began serving (ready, awake: held requests may go) or
        # gave its devices back (sleep, stop: another pool may use them now)
        self.on_change = on_change
        self.session = session
        self.lead = lead
        self.events: deque[Event] = deque(maxlen=_EVENTS_KEPT)
        self.drain_timeouts: dict[str, int] = {}
        self.scale_events: dict[tuple[str, str], int] = {}  # (pool, up|down) -> count
        self.awake_since_s: dict[str, float] = {}
        self.last_used_s: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._op_kind: dict[str, str] = {}
        self._began: dict[str, float] = {}
        self._reserved: dict[str, tuple[int, ...]] = {}
        self._retiring: set[str] = set()  # drains still waiting for requests (may be undone)
        self._failed_at: dict[str, float] = {}
        self._reserve: dict[tuple[str, str], int | None] = {}  # (pool, role) -> sleepers to keep
        self.budget = DeviceBudget()
        self._owns_session = False

    @property
    def pools(self) -> list[PoolConfig]:
        return [p.config for p in self.fleet.pools.values() if p.config.elastic]

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Build the device budget and launch every autoscaled pool's initial replicas."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
            self._owns_session = True
        configs = [p.config for p in self.fleet.pools.values()]
        inventory, _source = device_inventory(configs, self.settings)
        fixed = {d for e in self.fleet.endpoints() if not self._elastic(e) for d in e.devices}
        self.budget = DeviceBudget.build(configs, inventory, fixed)
        for pool in self.pools:
            assert pool.autoscale is not None
            self.lead.guess(pool.name, pool.autoscale.startup_s or self.lead.startup_s(pool.name))
            for role, count in pool.initial_roles().items():
                for _ in range(count):
                    self._scale_up(pool, Role(role), "initial replicas")

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._owns_session and self.session is not None:
            await self.session.close()
        self.session = None

    # --- what the planner reads ------------------------------------------------------------------

    def role_state(self, pool: str, role: Role) -> RoleState:
        counts = {"ready": 0, "starting": 0, "draining": 0, "sleeping": 0, "stopped": 0}
        for endpoint in self._endpoints(pool, role):
            counts[self._phase(endpoint)] += 1
        return RoleState(**counts)

    def capacity(self) -> dict[str, int]:
        return self.budget.capacity()

    def devices_per_replica(self, pool: str) -> int:
        return self.budget.per_replica.get(pool, 1)

    def note_request(self, pool: str, now_s: float) -> None:
        self.last_used_s[pool] = now_s

    def expected_ready_in_s(self, pool: str) -> float | None:
        """Seconds until a replica of `pool` starting or waking now should serve; None when none is."""
        best: float | None = None
        for endpoint in self.fleet.pools[pool].endpoints:
            kind = self._op_kind.get(endpoint.id)
            if kind not in ("start", "wake"):
                continue
            began = self._began.get(endpoint.id, self.clock())
            total = self.lead.startup_s(pool) if kind == "start" else self.lead.wake_s(pool)
            left = max(total - (self.clock() - began), 0.0)
            best = left if best is None else min(best, left)
        return best

    # --- carrying plans out ----------------------------------------------------------------------

    def apply(self, plans: Sequence[PoolTarget]) -> None:
        """Start the actions that move each pool towards its desired replicas (returns at once)."""
        spare = self._spare_slots(plans)
        for plan in plans:
            pool = self.fleet.pools[plan.pool].config
            for role_plan in plan.roles:
                role = Role(role_plan.role)
                active = self.role_state(pool.name, role).active
                for _ in range(role_plan.desired - active):
                    if not self._scale_up(pool, role, plan.reason):
                        break
                for _ in range(active - role_plan.desired):
                    if not self._scale_down(pool, role, plan.reason):
                        break
                if sleep_mode.sleeps(pool):
                    self._keep_reserve(pool, role, role_plan.reserve, role_plan.desired, spare)

    def _spare_slots(self, plans: Sequence[PoolTarget]) -> dict[str, int]:
        """Device slots per group that no plan's desired replicas take (what a warm reserve may use)."""
        spare = dict(self.capacity())
        for plan in plans:
            group = group_of(self.fleet.pools[plan.pool].config)
            if group in spare:
                spare[group] -= plan.desired * self.devices_per_replica(plan.pool)
        return spare

    def _keep_reserve(
        self, pool: PoolConfig, role: Role, reserve: int | None, desired: int, spare: dict[str, int]
    ) -> None:
        state = self.role_state(pool.name, role)
        target = reserve_left(reserve, desired, state.active)
        self._reserve[(pool.name, role.value)] = target
        group = group_of(pool)
        cost = self.devices_per_replica(pool.name)
        slots = spare.get(group, cost) if group else cost
        step = reserve_step(state.sleeping, target, 1 if slots >= cost else 0)
        endpoints = list(self._endpoints(pool.name, role))
        if step < 0:
            asleep = [e for e in endpoints if self._phase(e) == "sleeping" and not self._busy(e.id)]
            for endpoint in asleep[:-step]:
                self._run(endpoint, "stop", self._stop(pool, role, endpoint, f"warm reserve {target}: surplus"))
        elif step > 0:
            every = list(self.fleet.endpoints())
            for endpoint in self._startable(endpoints):
                devices = self.budget.place(pool, every, self._reserved)
                if devices is None:
                    return
                if group:
                    spare[group] = slots - cost
                self._reserved[endpoint.id] = devices
                self._run(endpoint, "prewarm", self._prewarm(pool, role, endpoint, devices))
                return

    def _startable(self, endpoints: list[Endpoint]) -> Iterator[Endpoint]:
        """The pool's stopped replicas that may start now: none busy with an operation, none whose
        start failed within the last pause (a failing slot is not retried every pass)."""
        now = self.clock()
        for endpoint in endpoints:
            if self._phase(endpoint) != "stopped" or self._busy(endpoint.id):
                continue
            if now - self._failed_at.get(endpoint.id, float("-inf")) < _FAILED_SLOT_PAUSE_S:
                continue
            yield endpoint

    def _scale_up(self, pool: PoolConfig, role: Role, reason: str) -> bool:
        endpoints = list(self._endpoints(pool.name, role))
        for endpoint in endpoints:  # a replica draining for a scale-down goes back to serving
            if endpoint.id in self._retiring and self._busy(endpoint.id):
                self._retiring.discard(endpoint.id)
                self._cancel(endpoint.id)
                endpoint.state, endpoint.state_reason = EndpointState.READY, ""
                self._event(pool, role, "undrain", endpoint, reason)
                self._count(pool.name, "up")
                return True
        every = list(self.fleet.endpoints())
        for endpoint in endpoints:
            sleeping = self._phase(endpoint) == "sleeping" and not self._busy(endpoint.id)
            if sleeping and self.budget.can_wake(endpoint, every, self._reserved):
                self._run(endpoint, "wake", self._wake(pool, role, endpoint, reason))
                self._count(pool.name, "up")
                return True
        for endpoint in self._startable(endpoints):
            devices = self.budget.place(pool, every, self._reserved)
            if devices is None:
                self._event(pool, role, "blocked", endpoint, f"no free devices in {group_of(pool)}")
                return False
            self._reserved[endpoint.id] = devices
            self._run(endpoint, "start", self._start(pool, role, endpoint, devices, reason))
            self._count(pool.name, "up")
            return True
        return False

    def _scale_down(self, pool: PoolConfig, role: Role, reason: str) -> bool:
        endpoints = list(self._endpoints(pool.name, role))
        starting = [e for e in endpoints if self._op_kind.get(e.id) == "start"]
        if starting:  # a start not ready yet holds no requests: cancel it
            endpoint = starting[-1]
            self._cancel(endpoint.id)
            self._run(endpoint, "stop", self._stop(pool, role, endpoint, "start cancelled: " + reason))
            self._count(pool.name, "down")
            return True
        ready = [e for e in endpoints if e.state is EndpointState.READY and not self._busy(e.id)]
        if not ready:
            return False
        endpoint = min(ready, key=lambda e: (e.inflight.requests, e.id))
        self._retiring.add(endpoint.id)
        self._run(endpoint, "drain", self._retire(pool, role, endpoint, reason))
        self._count(pool.name, "down")
        return True

    # --- the actions -----------------------------------------------------------------------------

    async def _start(
        self, pool: PoolConfig, role: Role, endpoint: Endpoint, devices: tuple[int, ...], why: str
    ) -> None:
        began = self.clock()
        self._event(pool, role, "start", endpoint, f"devices {list(devices) or '-'}: {why}")
        try:
            self.supervisor.launch(endpoint.id, devices)
            failures = await self.supervisor.wait_ready(endpoint_ids=[endpoint.id])
        finally:
            self._reserved.pop(endpoint.id, None)
        if failures or endpoint.state is not EndpointState.READY:
            self._failed_at[endpoint.id] = self.clock()
            detail = str(failures[0]) if failures else f"state {endpoint.state.value}"
            self._event(pool, role, "fail", endpoint, detail)
            return
        took = self.clock() - began
        self.lead.observe_start(pool.name, took)
        self.awake_since_s[pool.name] = self.clock()
        self._event(pool, role, "ready", endpoint, f"started in {took:.2f} s")

    async def _prewarm(self, pool: PoolConfig, role: Role, endpoint: Endpoint, devices: tuple[int, ...]) -> None:
        """Start a replica for the warm reserve, then drain (a request may have reached it) and sleep."""
        await self._start(pool, role, endpoint, devices, "warm reserve")
        if endpoint.state is EndpointState.READY:
            self._retiring.add(endpoint.id)
            await self._retire(pool, role, endpoint, "warm reserve: asleep until a step needs it")

    async def _wake(self, pool: PoolConfig, role: Role, endpoint: Endpoint, why: str) -> None:
        began = self.clock()
        self._reserved[endpoint.id] = endpoint.devices
        self._event(pool, role, "wake", endpoint, why)
        endpoint.state, endpoint.state_reason = EndpointState.STARTING, "waking"
        try:
            ok = await self._post(endpoint, sleep_mode.WAKE_PATH, pool.ready_timeout_s)
        finally:
            self._reserved.pop(endpoint.id, None)
        if not ok:
            self._event(pool, role, "fail", endpoint, "wake_up failed: stopping it")
            await self.supervisor.park(endpoint.id, "wake-up failed")
            return
        took = self.clock() - began
        self.lead.observe_wake(pool.name, took)
        endpoint.stats.scraped_at_s = 0.0  # its cache is empty: wait for a fresh scrape's numbers
        endpoint.state, endpoint.state_reason = EndpointState.READY, ""
        self.awake_since_s[pool.name] = self.clock()
        self._event(pool, role, "awake", endpoint, f"woke in {took:.2f} s")

    async def _retire(self, pool: PoolConfig, role: Role, endpoint: Endpoint, why: str) -> None:
        """Drain, then sleep or stop (module docstring)."""
        endpoint.state, endpoint.state_reason = EndpointState.DRAINING, "draining (scale-down)"
        self._event(pool, role, "drain", endpoint, f"{endpoint.inflight.requests} in flight: {why}")
        deadline_s = self.clock() + pool.drain_timeout_s
        timed_out = False
        # The relay updates InFlight without notifying anyone: polling is the contract.
        while endpoint.inflight.requests > 0 and endpoint.state is EndpointState.DRAINING:
            if not timed_out and self.clock() >= deadline_s:
                timed_out = True
                self.drain_timeouts[pool.name] = self.drain_timeouts.get(pool.name, 0) + 1
                moving = pool.migrates_streams
                detail = f"{endpoint.inflight.requests} requests still running after {pool.drain_timeout_s:g} s; " + (
                    "stopping it: its streams continue on another replica" if moving else "waiting for them"
                )
                log.warning("autoscale: drain of %s timed out: %s", endpoint.id, detail)
                self._event(pool, role, "drain_timeout", endpoint, detail)
                if moving:
                    break
            await asyncio.sleep(_POLL_S)
        if role is Role.PREFILL and endpoint.state is EndpointState.DRAINING:
            await asyncio.sleep(_PD_HANDOFF_GRACE_S)
        self._retiring.discard(endpoint.id)
        if endpoint.state is not EndpointState.DRAINING:
            return  # it crashed and the supervisor took over meanwhile
        others = sum(
            1 for e in self._endpoints(pool.name, role) if e.id != endpoint.id and self._phase(e) == "sleeping"
        )
        target = self._reserve.get((pool.name, role.value))
        if sleep_mode.sleeps(pool) and endpoint.inflight.requests == 0 and keeps_asleep(others, target):
            level = sleep_mode.sleep_level(pool)
            endpoint.state_reason = "going to sleep"
            if await self._post(endpoint, sleep_mode.sleep_path(level), pool.ready_timeout_s):
                endpoint.state, endpoint.state_reason = EndpointState.SLEEPING, f"asleep (level {level})"
                self._event(pool, role, "sleep", endpoint, f"level {level}")
                return
            self._event(pool, role, "fail", endpoint, "sleep failed: stopping it")
        await self._stop(pool, role, endpoint, why)

    async def _stop(self, pool: PoolConfig, role: Role, endpoint: Endpoint, why: str) -> None:
        await self.supervisor.park(endpoint.id, "scaled down")
        self._event(pool, role, "stop", endpoint, why)

    async def _post(self, endpoint: Endpoint, path: str, timeout_s: float) -> bool:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        try:
            async with self.session.post(
                endpoint.base_url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("autoscale: POST %s%s failed: %s", endpoint.id, path, exc)
            return False

    # --- bookkeeping -----------------------------------------------------------------------------

    @property
    def settled(self) -> bool:
        """No action in progress (tests and the benchmark wait for it)."""
        return not self._tasks

    def _busy(self, endpoint_id: str) -> bool:
        return endpoint_id in self._tasks

    def _run(self, endpoint: Endpoint, kind: str, work: Coroutine[Any, Any, None]) -> None:
        """One action on one replica as its own task (`_busy` until it ends)."""
        self._op_kind[endpoint.id] = kind
        self._began[endpoint.id] = self.clock()

        async def tracked() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscale: %s of %s failed", kind, endpoint.id)

        task = asyncio.get_running_loop().create_task(tracked(), name=f"autoscale {kind} {endpoint.id}")
        self._tasks[endpoint.id] = task

        def done(finished: asyncio.Task[None]) -> None:
            if self._tasks.get(endpoint.id) is finished:
                del self._tasks[endpoint.id]
                self._op_kind.pop(endpoint.id, None)

        task.add_done_callback(done)

    def _cancel(self, endpoint_id: str) -> None:
        task = self._tasks.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
        self._op_kind.pop(endpoint_id, None)
        self._reserved.pop(endpoint_id, None)

    def _phase(self, endpoint: Endpoint) -> str:
        kind = self._op_kind.get(endpoint.id)
        if kind in ("start", "wake"):
            return "starting"
        if kind == "prewarm":
            return "sleeping"  # started for the warm reserve: asleep once ready, serves nothing
        if kind == "stop":
            return "stopped"
        if endpoint.id in self._retiring or endpoint.state is EndpointState.DRAINING:
            return "draining"
        state = endpoint.state
        if state is EndpointState.READY or state is EndpointState.UNHEALTHY:
            return "ready"
        if state is EndpointState.STARTING:
            return "starting"
        if state is EndpointState.SLEEPING:
            return "sleeping"
        return "stopped"

    def _endpoints(self, pool: str, role: Role) -> Iterable[Endpoint]:
        return (e for e in self.fleet.pools[pool].endpoints if e.launched and e.role is role)

    def _elastic(self, endpoint: Endpoint) -> bool:
        return self.fleet.pools[endpoint.pool].config.elastic

    def _count(self, pool: str, direction: str) -> None:
        key = (pool, direction)
        self.scale_events[key] = self.scale_events.get(key, 0) + 1

    def _event(self, pool: PoolConfig, role: Role, action: str, endpoint: Endpoint, detail: str) -> None:
        self.events.append(Event(time.time(), pool.name, role.value, action, endpoint.id, detail))
        log.info("autoscale %s %s %s: %s", action, endpoint.id, role.value, detail)
        if self.on_change is not None and action in ("ready", "awake", "sleep", "stop"):
            try:
                self.on_change(pool.name, action)
            except Exception:
                log.exception("autoscale: on_change failed")


async def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` until true or `timeout_s` (tests and the benchmark)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


def reserve_left(reserve: int | None, desired: int, active: int) -> int | None:
    """The plan's reserve less the replicas still active above `desired` (a scale-down under way holds
    the reserve's room until it ends); None: no bound."""
    return None if reserve is None else max(reserve - max(active - desired, 0), 0)


def reserve_step(sleeping: int, target: int | None, spare_slots: int) -> int:
    """Replicas to start and put to sleep (> 0, one per pass), or sleeping ones to stop (< 0)."""
    if target is None:
        return 0
    if sleeping > target:
        return target - sleeping
    if sleeping < target and spare_slots > 0:
        return 1
    return 0


def keeps_asleep(others_sleeping: int, target: int | None) -> bool:
    """Whether a replica drained for a scale-down goes to sleep (else it stops)."""
    return target is None or others_sleeping < target
