"""`tokenway serve --workers N`: N gateway processes on one port, acting as one gateway.

One event loop is one core; a host with more cores serves more with more processes. The parent process
serves no request. In order, it:

1. checks what would stop a worker anyway (exposure, the port, pools a group cannot run) before anything
   starts;
2. with `state: memory`, starts the group's private Redis (`PrivateRedis`, below), and puts
   the durable copy of API-made keys (`state.keys_db`) back into it before any worker answers;
3. launches and supervises the engines once (the same `Supervisor` as a single gateway: restarts,
   backoff, drain, and every engine dies with this process); workers see them as static endpoints;
4. starts N workers (`python -m gateway.workers.worker`), each binding the port with SO_REUSEPORT: the
   kernel spreads new connections over them; limits, budgets, keys, stored responses, batches and
   routing state are shared through Redis exactly as between gateway replicas (docs/scale-out.md);
5. until SIGTERM or SIGINT: a worker that dies is restarted, at most `MAX_RESTARTS` times in any
   `RESTART_WINDOW_S` for the group; past that (a crash loop), or when a worker exits with status 2
   (its configuration was refused), the group stops with an error. SIGHUP is passed on (policy reload).
6. On SIGTERM/SIGINT: SIGTERM to every worker (each stops accepting and drains, up to
   `server.drain_timeout_s`; SIGKILL after that and a grace), then the engines are drained and stopped,
   then the private Redis, then the private directory is removed. Nothing outlives the group: workers
   and Redis also carry the kernel's parent-death signal for a parent that is killed outright.

## The group's private Redis (`PrivateRedis`)

The group's own Redis: what N workers share when gateway.yaml says `state: memory`.

`state: memory` means "this gateway alone, nothing to run beside it"; a group of workers is still one
gateway, so it brings its shared state along instead of asking for a Redis: a `redis-server` listening
on a Unix socket only (no TCP port, socket mode 0700 in a private 0700 directory), nothing written to
disk (no RDB, no AOF: what `state: memory` loses on a restart, this loses too), in its own session so a
terminal's Ctrl-C reaches the workers (which drain) and not the store they drain into, and tied to the
parent by the kernel's parent-death signal, so even a `kill -9`ed parent leaves no Redis behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import aiohttp
from redis.asyncio import Redis
from redis.exceptions import RedisError

from backends.fleet import Fleet
from backends.process import death_signal_preexec
from backends.supervisor import Supervisor
from backends.types import PlanError
from gateway.app.factory import directory_store
from gateway.app.server import listen_socket, port_problem, run_loop
from gateway.app.settings import GatewaySettings
from gateway.http.access import exposure_problem
from gateway.workers.plan import group_problem, static_pools, worker_settings
from gateway.workers.worker import RESTARTED, WorkerSpec
from policies.keys.store import KeyStoreDamaged

INSTALL_HINT = (
    "apt-get install redis-server (Debian/Ubuntu), dnf install redis (Fedora), brew install redis (macOS); "
    "or point state.redis_url at a Redis (state: redis)"
)
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class PrivateRedisError(Exception):
    """The private Redis cannot start; the message says why and what to install."""


class PrivateRedis:
    def __init__(self, proc: asyncio.subprocess.Process, socket_path: Path, log_path: Path) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @classmethod
    async def start(cls, directory: Path, binary: str | None = None) -> PrivateRedis:
        """Start it in `directory` (private to this user) and wait until it answers PING."""
        exe = binary or shutil.which("redis-server")
        if exe is None:
            raise PrivateRedisError(
                "server.workers > 1 with state: memory runs a private redis-server, and none is installed: "
                + INSTALL_HINT
            )
        socket_path = directory / "redis.sock"
        log_path = directory / "redis.log"
        argv = [exe, "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--dir", str(directory), "--logfile", str(log_path),
                "--daemonize", "no", "--databases", "1"]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=death_signal_preexec(os.getpid()),
        )
        redis = cls(proc, socket_path, log_path)
        try:
            await redis._wait_ready()
        except PrivateRedisError:
            await redis.stop()
            raise
        return redis

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise PrivateRedisError(f"the private redis-server exited ({self.proc.returncode}): {self._tail()}")
            if self.socket_path.exists():
                client = Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)
                try:
                    if await client.ping():
                        return
                except (OSError, RedisError):  # still loading: try again
                    pass
                finally:
                    await client.aclose()
            await asyncio.sleep(0.05)
        raise PrivateRedisError(f"the private redis-server did not answer within {READY_TIMEOUT_S:g} s: {self._tail()}")

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    async def stop(self) -> None:
        """SIGTERM (it saves nothing: no save points), SIGKILL if it lingers."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


log = logging.getLogger("tokenway.workers")

MAX_RESTARTS = 5  # worker restarts the group allows in any RESTART_WINDOW_S; one more stops the group
RESTART_WINDOW_S = 60.0
KILL_GRACE_S = 10.0  # after the drain timeout, before SIGKILL
CONFIG_REFUSED = 2  # a worker's exit status when its settings or policies were refused


def run_group(settings: GatewaySettings, workers: int, *, log_level: str = "INFO") -> int:
    return run_loop(serve_group(settings, workers, log_level=log_level))


def _say(message: str) -> None:
    print(f"tokenway: {message}", file=sys.stderr, flush=True)


async def serve_group(settings: GatewaySettings, workers: int, *, log_level: str = "INFO") -> int:
    server = settings.server
    problem = exposure_problem(server.host, server.admin_token) or group_problem(settings)
    if problem is not None:
        _say(problem)
        return 2
    try:  # the port first, as a single gateway does: nothing starts when it is taken
        probe = listen_socket(server.host, server.port)  # without SO_REUSEPORT: refused by any holder
    except OSError as exc:
        _say(port_problem(server.host, server.port, exc))
        return 2
    port = int(probe.getsockname()[1])  # port 0: the one the kernel chose, for every worker
    probe.close()
    stop = asyncio.Event()  # a stop signal during start-up is kept, and answered once everything started
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    directory = Path(tempfile.mkdtemp(prefix="tokenway-workers-"))  # 0700: the sockets and the Redis
    redis: PrivateRedis | None = None
    supervisor = Supervisor(settings.backends)
    session = aiohttp.ClientSession()
    group: Group | None = None
    watch: asyncio.Task[None] | None = None
    try:
        if settings.state.backend == "memory":
            try:
                redis = await PrivateRedis.start(directory)
            except PrivateRedisError as exc:
                _say(str(exc))
                return 2
        fleet = Fleet.from_configs(settings.pools)
        try:
            await supervisor.start(fleet, session)
        except PlanError as exc:
            _say(str(exc))
            return 2
        launched = [replica.endpoint for replica in supervisor.replicas.values()]
        pools = static_pools(settings.pools, launched)
        url = redis.url if redis is not None else None
        specs = [
            WorkerSpec(
                index=i,
                workers=workers,
                directory=directory,
                parent_pid=os.getpid(),
                log_level=log_level,
                source=settings.source,
                settings=worker_settings(settings, i, port=port, pools=pools, private_redis_url=url).model_dump(
                    mode="json"
                ),
            )
            for i in range(workers)
        ]
        if redis is not None:
            try:
                await _restore_keys(specs[0])
            except KeyStoreDamaged as exc:  # one line naming the file, as a single process says it
                _say(str(exc))
                return 2
        group = Group(specs, stop, drain_timeout_s=server.drain_timeout_s)
        await group.start()
        engines = f"; {len(launched)} engine(s) supervised here" if launched else ""
        state = "a private Redis" if redis is not None else "Redis"
        _say(f"{workers} workers on port {port} (pids {group.pids()}), sharing state through {state}{engines}")
        if launched:
            watch = asyncio.get_running_loop().create_task(_report_engines(supervisor))
        return await group.run()
    finally:
        if watch is not None:
            watch.cancel()
        if group is not None:
            await group.stop()
        await supervisor.stop()
        await session.close()
        if redis is not None:
            await redis.stop()
        shutil.rmtree(directory, ignore_errors=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _restore_keys(spec: WorkerSpec) -> None:
    """Keys made through the admin API, put back from the durable copy into the fresh private Redis
    now, so that no worker answers 401 for one while another restores it (policies/keys/store.py)."""
    state = spec.gateway_settings().state
    if not state.keys_db:
        return
    store = directory_store(state)
    try:
        await store.load()
    finally:
        await store.close()


async def _report_engines(supervisor: Supervisor) -> None:
    for failure in await supervisor.wait_ready():
        _say(f"replica failed: {failure}")


class Group:
    """The worker processes: started, watched, restarted within bounds, stopped."""

    def __init__(self, specs: list[WorkerSpec], stop: asyncio.Event, *, drain_timeout_s: float) -> None:
        self.specs = specs
        self.drain_timeout_s = drain_timeout_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.restarts: deque[float] = deque()
        self._exited: asyncio.Queue[int] = asyncio.Queue()
        self._stop = stop
        self._waits: list[asyncio.Task[None]] = []

    def pids(self) -> str:
        return ", ".join(str(self.procs[i].pid) for i in sorted(self.procs))

    async def start(self) -> None:
        for spec in self.specs:
            await self._spawn(spec.index)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)

    async def _spawn(self, index: int, *, restarted: bool = False) -> None:
        argv = [sys.executable, "-m", "gateway.workers.worker", *([RESTARTED] if restarted else [])]
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE)
        assert proc.stdin is not None
        # over a pipe, never a file: the settings carry resolved secrets (admin token, upstream keys)
        proc.stdin.write(self.specs[index].dump().encode())
        with contextlib.suppress(ConnectionError):
            await proc.stdin.drain()
        proc.stdin.close()
        self.procs[index] = proc
        self._waits.append(asyncio.get_running_loop().create_task(self._wait(index, proc)))

    async def _wait(self, index: int, proc: asyncio.subprocess.Process) -> None:
        await proc.wait()
        if self.procs.get(index) is proc:
            await self._exited.put(index)

    def _forward(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def run(self) -> int:
        """Until a stop signal (0) or a failure the group does not restart past (its status)."""
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            while True:
                exited = asyncio.ensure_future(self._exited.get())
                done, _ = await asyncio.wait({stopped, exited}, return_when=asyncio.FIRST_COMPLETED)
                if stopped in done:
                    exited.cancel()
                    return 0
                index = exited.result()
                code = self.procs[index].returncode
                pid = self.procs[index].pid
                if code == CONFIG_REFUSED:
                    _say(f"worker {index} (pid {pid}) refused its configuration; stopping the group")
                    return CONFIG_REFUSED
                now = time.monotonic()
                while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
                    self.restarts.popleft()
                if len(self.restarts) >= MAX_RESTARTS:
                    _say(
                        f"worker {index} (pid {pid}) exited ({code}); {MAX_RESTARTS} restarts in "
                        f"{RESTART_WINDOW_S:g} s already: stopping the group"
                    )
                    return 1
                self.restarts.append(now)
                await self._spawn(index, restarted=True)
                _say(
                    f"worker {index} (pid {pid}) exited ({code}); restarted as pid {self.procs[index].pid} "
                    f"({len(self.restarts)} of {MAX_RESTARTS} restarts allowed in {RESTART_WINDOW_S:g} s)"
                )
        finally:
            stopped.cancel()

    async def stop(self) -> None:
        """SIGTERM every worker, wait for their drain, SIGKILL what is left."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        self._forward(signal.SIGTERM)
        live = [proc for proc in self.procs.values() if proc.returncode is None]
        if live:
            _done, pending = await asyncio.wait(
                [asyncio.ensure_future(proc.wait()) for proc in live], timeout=self.drain_timeout_s + KILL_GRACE_S
            )
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for waiting in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
        for task in self._waits:
            task.cancel()
