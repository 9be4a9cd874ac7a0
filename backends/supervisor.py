"""The supervisor: launches every replica of the fleet's pools and keeps them alive.

Per replica, one task runs its life: spawn (own process group, output to a log file) -> wait for
readiness (polling the health path until its adapter says ready, within the pool's deadline) ->
READY -> wait for exit. An unexpected exit restarts it after an exponential backoff; too many exits
within a window is a crash loop: the replica stays DEAD with the reason and its log tail, and the
other pools keep serving. A replica that never becomes ready is stopped and left DEAD with a clear
message. Stopping drains first: no new requests (DRAINING), in-flight ones finish up to the pool's
`drain_timeout_s`, then SIGTERM, then SIGKILL after `term_grace_s`.

A simulated pool with a shared KV store (`kv_store`) has its store process too, started with the
pool's replicas and stopped after them (backends/kv_store_runner.py).

Endpoint ids are stable across restarts ("<pool>/<role>-<index>"), and so are ports and devices, so
routing state keyed by endpoint survives a restart. Before a restart the dead replica's whole process
group is killed and its ports must be free again: workers a crashed leader leaves behind keep its
ports (and GPU memory), and a restart into them would fail and loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp
import orjson

from backends.adapters.base import EngineAdapter, Probe
from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.kv_store_runner import StoreRunner
from backends.plan import PlannedReplica, is_port_free, launch_spec, plan_replicas
from backends.process import EngineProcess, crash_tail, describe_exit, error_lines
from backends.scrape import MAX_LISTING_BYTES, MAX_NAME_CHARS, read_bounded
from backends.types import UNKNOWN, Endpoint, EndpointState, EndpointStats

log = logging.getLogger(__name__)


class _Startup(StrEnum):
    READY = "ready"
    EXITED = "exited"
    TIMEOUT = "timeout"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class ReplicaFailure:
    """A replica that did not become ready: why, and the last lines of its log."""

    endpoint_id: str
    reason: str
    log_path: str | None
    log_tail: tuple[str, ...]

    def __str__(self) -> str:
        tail = "\n".join(f"  | {line}" for line in self.log_tail)
        return f"{self.endpoint_id}: {self.reason}" + (f"\n  last log lines ({self.log_path}):\n{tail}" if tail else "")


@dataclass(eq=False)
class Replica:
    """The supervisor's record of one launched replica."""

    planned: PlannedReplica
    endpoint: Endpoint
    process: EngineProcess | None = None
    task: asyncio.Task[None] | None = None
    crash_times_s: deque[float] = field(default_factory=deque)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready once, or failed for good
    failure: ReplicaFailure | None = None
    stopping: bool = False
    attempts: int = 0


class Supervisor:
    """Launches, watches, restarts, drains and stops the fleet's launched replicas."""

    def __init__(
        self,
        settings: BackendsSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self.stores: dict[str, StoreRunner] = {}  # pool -> its simulated KV store
        self._session: aiohttp.ClientSession | None = None
        self._owns_session = False
        self._stopping = False
        self._atexit: Callable[[], None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, fleet: Fleet, session: aiohttp.ClientSession | None = None) -> None:
        """Plan and launch every replica of the fleet's pools; return at once (readiness is tracked
        in the background). Raises PlanError before launching anything if the pools cannot be planned.
        """
        planned = plan_replicas([p.config for p in fleet.pools.values()], self.settings, port_is_free=is_port_free)
        if session is None:
            session = aiohttp.ClientSession()
            self._owns_session = True
        self._session = session
        for item in planned:
            endpoint = Endpoint(
                id=item.endpoint_id,
                pool=item.pool.name,
                base_url=item.replica.base_url,
                engine=item.pool.engine,
                served_model=item.adapter.served_model(item.pool),
                role=item.replica.role,
                state=EndpointState.STARTING,
                api_key=item.pool.api_key,
                max_model_len=item.pool.max_model_len,
                kv_events_endpoint=item.adapter.kv_events_endpoint(item.pool, item.replica),
                kv_events_replay_endpoint=item.adapter.kv_events_replay_endpoint(item.pool, item.replica),
                launched=True,
                log_path=item.spec.log_path,
                devices=item.replica.devices,
                topology=item.pool.topology.labels() if item.pool.topology is not None else UNKNOWN,
            )
            fleet.pools[item.pool.name].endpoints.append(endpoint)
            replica = Replica(item, endpoint)
            self.replicas[endpoint.id] = replica
            if item.pool.elastic:  # the autoscaler launches it, on devices it assigns
                endpoint.state, endpoint.state_reason = EndpointState.STOPPED, "not started"
                replica.settled.set()
                continue
            replica.task = asyncio.create_task(self._supervise(replica), name=f"supervise {endpoint.id}")
        for store in {item.store.pool: item.store for item in planned if item.store is not None}.values():
            self.stores[store.pool] = StoreRunner.start(store, stopping=lambda: self._stopping)
        if planned:
            self._register_atexit()
        log.info("supervisor: launching %d replicas", len(planned))

    async def wait_ready(
        self, timeout_s: float | None = None, endpoint_ids: Collection[str] | None = None
    ) -> list[ReplicaFailure]:
        """Wait until every replica (or those listed) is ready or has failed for good; return the
        failures. Raises TimeoutError naming the replicas still starting when `timeout_s` passes."""
        replicas = [r for r in self.replicas.values() if endpoint_ids is None or r.endpoint.id in endpoint_ids]
        waits = [asyncio.ensure_future(r.settled.wait()) for r in replicas]
        try:
            if waits:
                _done, pending = await asyncio.wait(waits, timeout=timeout_s)
                if pending:
                    starting = [r.endpoint.id for r in replicas if not r.settled.is_set()]
                    raise TimeoutError(f"replicas still starting after {timeout_s}s: {', '.join(starting)}")
        finally:
            for w in waits:
                w.cancel()
        return [r.failure for r in replicas if r.failure is not None]

    async def stop(self) -> None:
        """Drain and stop everything launched (idempotent)."""
        self._stopping = True
        await asyncio.gather(
            *(self._stop_replica(r, r.planned.pool.drain_timeout_s) for r in self.replicas.values()),
            return_exceptions=True,
        )
        await asyncio.gather(
            *(runner.stop(self.settings.term_grace_s) for runner in self.stores.values()), return_exceptions=True
        )
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None

    async def drain(self, endpoint_id: str, timeout_s: float | None = None) -> None:
        """Stop one replica gracefully: no new requests, in-flight ones finish (up to `timeout_s`,
        default the pool's `drain_timeout_s`), then SIGTERM, then SIGKILL. It is not restarted."""
        replica = self._replica(endpoint_id)
        await self._stop_replica(replica, replica.planned.pool.drain_timeout_s if timeout_s is None else timeout_s)

    async def restart(self, endpoint_id: str, drain_timeout_s: float | None = None) -> None:
        """Drain and stop one replica, then launch it again (same id, port and devices)."""
        replica = self._replica(endpoint_id)
        await self.drain(endpoint_id, drain_timeout_s)
        if self._stopping:
            return
        replica.stopping = False
        replica.crash_times_s.clear()
        replica.failure = None
        replica.settled = asyncio.Event()
        replica.task = asyncio.create_task(self._supervise(replica), name=f"supervise {endpoint_id}")

    def launch(self, endpoint_id: str, devices: tuple[int, ...] = ()) -> None:
        """Start a stopped replica (an autoscaled slot) on `devices`; readiness is tracked as for any
        replica (`wait_ready`). Its id and port are the slot's own."""
        replica = self._replica(endpoint_id)
        if replica.task is not None and not replica.task.done():
            raise RuntimeError(f"replica {endpoint_id!r} is already running")
        planned = replica.planned
        plan = dataclasses.replace(planned.replica, devices=devices)
        replica.planned = dataclasses.replace(
            planned, replica=plan, spec=launch_spec(planned.adapter, planned.pool, plan)
        )
        replica.endpoint.devices = devices
        replica.stopping = False
        replica.crash_times_s.clear()
        replica.failure = None
        replica.settled = asyncio.Event()
        replica.task = asyncio.create_task(self._supervise(replica), name=f"supervise {endpoint_id}")
        self._register_atexit()

    async def park(self, endpoint_id: str, reason: str = "scaled down") -> None:
        """Stop one replica now (the caller drained it) and leave its slot STOPPED, devices freed."""
        replica = self._replica(endpoint_id)
        await self._stop_replica(replica, 0.0)
        replica.endpoint.state, replica.endpoint.state_reason = EndpointState.STOPPED, reason
        replica.endpoint.devices = ()

    def failures(self) -> list[ReplicaFailure]:
        return [r.failure for r in self.replicas.values() if r.failure is not None]

    # --- one replica's life ------------------------------------------------------------------------

    def _replica(self, endpoint_id: str) -> Replica:
        try:
            return self.replicas[endpoint_id]
        except KeyError:
            raise KeyError(f"no launched replica {endpoint_id!r}") from None

    async def _supervise(self, replica: Replica) -> None:
        endpoint = replica.endpoint
        try:
            while not (self._stopping or replica.stopping):
                replica.attempts += 1
                endpoint.state = EndpointState.STARTING
                endpoint.state_reason = f"starting (attempt {replica.attempts})"
                endpoint.stats = EndpointStats()  # a new engine: old counters and cache are gone
                try:
                    replica.process = await EngineProcess.spawn(
                        replica.planned.spec, header=f"{endpoint.id} attempt {replica.attempts}"
                    )
                except OSError as exc:
                    self._fail(replica, f"cannot start {replica.planned.spec.argv[0]!r}: {exc}")
                    return
                endpoint.pid = replica.process.pid
                outcome = await self._await_ready(replica, replica.process)
                if outcome is _Startup.STOPPED:
                    return
                if outcome is _Startup.TIMEOUT:
                    await replica.process.terminate(self.settings.term_grace_s)
                    deadline_s = replica.planned.pool.ready_timeout_s
                    self._fail(
                        replica,
                        f"not ready after {deadline_s:g}s (pool {endpoint.pool!r} ready_timeout_s): the "
                        f"process was alive but {endpoint.base_url}"
                        f"{replica.planned.adapter.health_path} never answered ready; stopped it",
                    )
                    return
                if outcome is _Startup.READY:
                    await self._on_ready(replica)
                    await replica.process.wait()
                if self._stopping or replica.stopping:
                    return
                await self._on_exit(replica, replica.process)
                if replica.failure is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave the replica in limbo
            log.exception("supervisor: replica %s failed", endpoint.id)
            self._fail(replica, f"supervisor error: {exc!r}")

    async def _await_ready(self, replica: Replica, process: EngineProcess) -> _Startup:
        adapter = replica.planned.adapter
        endpoint = replica.endpoint
        deadline_s = self.clock() + replica.planned.pool.ready_timeout_s
        url = endpoint.base_url + adapter.health_path
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        assert self._session is not None
        while True:
            if self._stopping or replica.stopping:
                return _Startup.STOPPED
            if not process.alive:
                return _Startup.EXITED
            remaining_s = deadline_s - self.clock()
            if remaining_s <= 0:
                return _Startup.TIMEOUT
            verdict = await self._probe(url, headers, min(self.settings.health_timeout_s, remaining_s), adapter)
            if verdict is Probe.READY and process.alive:
                return _Startup.READY
            # Sleep until the next poll, waking early if the process exits.
            pause_s = min(self.settings.ready_poll_interval_s, max(0.0, deadline_s - self.clock()))
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(pause_s):
                    await asyncio.shield(process.exited())

    async def _probe(self, url: str, headers: dict[str, str], timeout_s: float, adapter: EngineAdapter) -> Probe:
        assert self._session is not None
        try:
            async with self._session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                return adapter.classify_health(response.status, response.headers)
        except (TimeoutError, aiohttp.ClientConnectionError):
            return adapter.classify_health(None, {})
        except aiohttp.ClientError:
            return Probe.FAILING

    async def _on_ready(self, replica: Replica) -> None:
        endpoint = replica.endpoint
        if replica.planned.adapter.discovers_model_name:
            name = await self._discover_model_name(endpoint)
            if name:
                endpoint.served_model = name
        endpoint.stats = EndpointStats()
        endpoint.consecutive_failures = 0
        endpoint.ejections = 0
        endpoint.state_reason = ""
        endpoint.log_tail = ()
        endpoint.state = EndpointState.READY
        replica.settled.set()
        log.info("replica %s ready at %s (attempt %d)", endpoint.id, endpoint.base_url, replica.attempts)

    async def _discover_model_name(self, endpoint: Endpoint) -> str | None:
        """The id the engine serves, from GET /v1/models (TRT-LLM has no --served_model_name)."""
        assert self._session is not None
        try:
            async with self._session.get(
                endpoint.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            ) as response:
                body = await read_bounded(response, MAX_LISTING_BYTES)  # an engine's answer is input
            model_id = orjson.loads(body or b"null")["data"][0]["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None
        return model_id if isinstance(model_id, str) and 0 < len(model_id) <= MAX_NAME_CHARS else None

    async def _on_exit(self, replica: Replica, process: EngineProcess) -> None:
        """An unexpected exit: restart after a backoff, or declare a crash loop."""
        endpoint = replica.endpoint
        now_s = self.clock()
        replica.crash_times_s.append(now_s)
        while replica.crash_times_s and now_s - replica.crash_times_s[0] > self.settings.crash_loop_window_s:
            replica.crash_times_s.popleft()
        exits = len(replica.crash_times_s)
        endpoint.state = EndpointState.DEAD
        endpoint.pid = None
        endpoint.log_tail = crash_tail(endpoint.log_path, self.settings.log_tail_lines)
        how = describe_exit(process.returncode)
        errors = error_lines(endpoint.log_path, count=1)
        if errors:
            how += f": {errors[0]}"
        endpoint.state_reason = f"exited ({how}); stopping what is left of its process group"
        if not await process.reap_group(min(self.settings.term_grace_s, 5.0)):
            self._fail(replica, f"exited ({how}); not restarting: processes of its group survived SIGKILL")
            return
        busy = await self._wait_ports_free(replica)
        if busy:
            ports = ", ".join(map(str, busy))
            self._fail(replica, f"exited ({how}); not restarting: port(s) {ports} stay in use by another process")
            return
        if exits >= self.settings.crash_loop_restarts:
            self._fail(
                replica,
                f"crash loop: exited {exits} times within {self.settings.crash_loop_window_s:g}s "
                f"(last: {how}); not restarting",
            )
            return
        backoff_s = min(self.settings.restart_backoff_s * 2 ** (exits - 1), self.settings.restart_backoff_max_s)
        endpoint.state_reason = f"exited ({how}); restarting in {backoff_s:g}s"
        log.warning("replica %s exited (%s); restarting in %.1fs", endpoint.id, how, backoff_s)
        await asyncio.sleep(backoff_s)
        endpoint.restarts += 1

    async def _wait_ports_free(self, replica: Replica, timeout_s: float = 30.0) -> list[int]:
        """Wait until the replica's ports can be bound again; the ones still busy after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while True:
            busy = busy_ports(replica)
            if not busy or loop.time() >= deadline_s:
                return busy
            await asyncio.sleep(0.2)

    def _fail(self, replica: Replica, reason: str) -> None:
        endpoint = replica.endpoint
        endpoint.state = EndpointState.DEAD
        endpoint.pid = None
        endpoint.log_tail = crash_tail(endpoint.log_path, self.settings.log_tail_lines)
        endpoint.state_reason = reason
        replica.failure = ReplicaFailure(endpoint.id, reason, endpoint.log_path, endpoint.log_tail)
        replica.settled.set()
        log.error("replica %s failed: %s", endpoint.id, replica.failure)

    async def _stop_replica(self, replica: Replica, drain_timeout_s: float) -> None:
        endpoint = replica.endpoint
        replica.stopping = True
        process = replica.process
        if process is not None and process.alive:
            if endpoint.state is EndpointState.READY or endpoint.state is EndpointState.UNHEALTHY:
                endpoint.state = EndpointState.DRAINING
                endpoint.state_reason = "draining"
                deadline_s = self.clock() + drain_timeout_s
                # The relay updates InFlight without notifying anyone: polling is the contract.
                while endpoint.inflight.requests > 0 and self.clock() < deadline_s and process.alive:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await process.terminate(self.settings.term_grace_s)
        task = replica.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        endpoint.state = EndpointState.DEAD
        endpoint.pid = None
        if replica.failure is None:
            endpoint.state_reason = "stopped"
        replica.settled.set()

    # --- last resort -------------------------------------------------------------------------------

    def kill_all_now(self) -> None:
        """Synchronous: SIGTERM then SIGKILL every live process group (interpreter exit, no loop)."""
        for replica in self.replicas.values():
            if replica.process is not None:
                replica.process.kill_now()
        for runner in self.stores.values():
            runner.kill_now()

    def _register_atexit(self) -> None:
        if self._atexit is not None:
            return
        ref = weakref.ref(self)

        def kill() -> None:
            supervisor = ref()
            if supervisor is not None:
                supervisor.kill_all_now()

        self._atexit = kill
        atexit.register(kill)


def replica_ports(replica: Replica) -> list[int]:
    """The ports a replica's engine binds: HTTP, KV-event publisher and replay, KV-transfer channel."""
    plan = replica.planned.replica
    ports = [plan.port, plan.kv_events_port, plan.kv_events_replay_port, plan.kv_transfer_port]
    return [p for p in ports if p is not None]


def busy_ports(replica: Replica) -> list[int]:
    host = replica.planned.replica.host
    return [p for p in replica_ports(replica) if not is_port_free(host, p)]
