"""Real processes for end-to-end tests and benchmarks: simulated engines and gateways on free ports.

Everything is started as a subprocess of the test (no in-process shortcuts), talks over real
sockets, and is stopped with a signal at the end so shutdown paths run too.

Nothing started here outlives a failure: `spawn` starts each process in its own process group and
records it in a module-level registry before anything can fail; `stop_process` ends the whole group
(whatever the process forked), and `sweep` (run at interpreter exit, at the end of a pytest session,
and by tests/support/cleanup.py when a fixture or test fails) ends every registered process still
alive. A fixture that raised after starting three gateways used to leave them running for minutes.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
TEST_KEY = "sk-tokenway-test-0001"
OTHER_KEY = "sk-tokenway-test-0002"


# Ports are drawn below Linux's ephemeral range (32768-60999): a client that polls a port in that range
# before its server binds can be handed the same port as its own source and connect to itself (TCP
# simultaneous open), reading its own request back as the "response".
_PORT_LOW, _PORT_HIGH = 20000, 32000


def _port_range() -> tuple[int, int]:
    """This process's share of the range: under pytest-xdist (PYTEST_XDIST_WORKER=gwN of
    PYTEST_XDIST_WORKER_COUNT) each worker draws from its own slice, so two workers cannot both find
    one port free in the moment between one's check and its server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if count <= 1 or not worker.startswith("gw") or not worker[2:].isdigit():
        return _PORT_LOW, _PORT_HIGH
    span = (_PORT_HIGH - _PORT_LOW) // count
    low = _PORT_LOW + (int(worker[2:]) % count) * span
    return low, low + span


# The ports handed out lately: one handed out is free until its server binds, so the next draw must
# not return it again (a test that starts three gateways asks for their ports before any binds).
_handed_out: collections.deque[int] = collections.deque(maxlen=256)
# Ports are drawn from a generator of their own: hypothesis seeds the global `random` the same way in
# every process that runs a derandomized probe (bench/chaos), so two such processes would draw the
# same ports in step, and a server that lost the race to bind answered for the other's.
_draws = random.Random()


def free_port(*, room: int = 1) -> int:
    """A port nothing is bound to now, outside the ephemeral range (see above), in this process's
    share of it (see `_port_range`), not handed out lately; `room` keeps that many ports above it
    inside the share (the base of a run of ports)."""
    low, high = _port_range()
    for _ in range(1000):
        port = _draws.randrange(low, high - room + 1)
        if port not in _handed_out and _port_free(port):
            _handed_out.append(port)
            return port
    raise RuntimeError("no free port found")


def redis_argv(binary: str, port: int, workdir: str | Path) -> list[str]:
    """redis-server on 127.0.0.1:`port` with no persistence, started in `workdir`: redis-server loads
    a dump.rdb from its directory at start, so a test's server starts in a fresh, empty one (a stray
    dump in the checkout once leaked another test's keys into a test that counts keys)."""
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]


def wait_redis(url: str, timeout_s: float = 6.0) -> None:
    """Until the redis-server at `url` answers PING (RuntimeError after `timeout_s`): a server just
    spawned takes a moment to listen."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server at {url} did not start") from None
                time.sleep(0.02)
    finally:
        client.close()


def free_ports(count: int) -> list[int]:
    """`count` consecutive free ports (the simulator's --instances takes P..P+N-1)."""
    for _ in range(200):
        base = free_port(room=count)
        ports = list(range(base, base + count))
        if all(p not in _handed_out and _port_free(p) for p in ports[1:]):
            _handed_out.extend(ports[1:])
            return ports
    raise RuntimeError("no run of free ports found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def http_get(url: str, headers: dict[str, str] | None = None, timeout_s: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, repr(exc)


def metric_total(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample `name` over the samples whose labels include `labels`, at `url`/metrics."""
    status, text = http_get(url + "/metrics")
    assert status == 200, text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen[Any] | None = None, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        code, text = http_get(url)
        if code == status:
            return
        last = f"{code} {text[:200]}"

        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {status} within {timeout_s}s (last: {last})")


# Every process started through `spawn`, by pid, until `stop_process` has ended it.
_LIVE: dict[int, subprocess.Popen[Any]] = {}


def spawn(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **kwargs)` in a process group of its own, registered for `sweep`
    before the caller can fail: whatever happens next, the process (and what it forks) is ended."""
    kwargs.setdefault("start_new_session", True)
    proc: subprocess.Popen[bytes] = subprocess.Popen(list(argv), **kwargs)
    _LIVE[proc.pid] = proc
    return proc


def live_processes() -> dict[int, subprocess.Popen[Any]]:
    """The registered processes not yet stopped (a copy)."""
    return dict(_LIVE)


def _own_group(proc: subprocess.Popen[Any]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except OSError:
        return proc.pid in _LIVE  # exited already: a spawned process led its own group


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
    """Signal `proc` (its shutdown path runs), wait, SIGKILL it after `timeout_s`; then, for a
    process that leads its own group, SIGKILL whatever of the group is left (its forked children)."""
    group = _own_group(proc)
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if group:
                _kill_group(proc.pid)
            proc.kill()
            proc.wait(5)
    if group:
        _kill_group(proc.pid)
    _LIVE.pop(proc.pid, None)
    return int(proc.returncode)


def children(pid: int) -> set[int]:
    """Every live descendant of `pid` (Linux /proc; empty elsewhere), zombies left out."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, waiting to be reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_gone(pids: Sequence[int], timeout_s: float = 10.0) -> bool:
    """Whether every one of `pids` has ended within `timeout_s` (a SIGKILL takes effect when the
    process is next scheduled, not when the signal is sent)."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass(frozen=True)
class Snapshot:
    """Before a step: the registered processes, and the time (Linux's boot clock, in clock ticks:
    what /proc says of a process's start) after which a process is the step's."""

    registered: frozenset[int]
    ticks: int


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _boot_ticks() -> int:
    clock = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return int(time.clock_gettime(clock) * _TICKS_PER_S)


def _started_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (0 when unknown: counted as older)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def snapshot() -> Snapshot:
    """Cheap (no walk of the process table): taken before every fixture and test by
    tests/support/cleanup.py; the table is read only when the step failed."""
    return Snapshot(frozenset(_LIVE), _boot_ticks())


def sweep(since: Snapshot | None = None) -> list[int]:
    """End every registered process still alive, and every descendant of this process, that was not
    running at `since` (all of them without one). Returns the pids ended."""
    ended: list[int] = []
    for pid, proc in list(_LIVE.items()):
        if since is not None and pid in since.registered:
            continue
        if proc.poll() is None:
            ended.append(pid)
            _LAST_SEEN[pid] = command_line(pid)
        with contextlib.suppress(Exception):
            stop_process(proc, signal.SIGKILL, timeout_s=5)
    own = _interpreter_helpers()
    for pid in children(os.getpid()):
        if pid in own or (since is not None and _started_ticks(pid) < since.ticks):
            continue
        _LAST_SEEN[pid] = command_line(pid)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
    return ended


_LAST_SEEN: dict[int, str] = {}  # what each swept process was running, for the report that names it


def _interpreter_helpers() -> set[int]:
    """Children this interpreter keeps for itself: multiprocessing's resource tracker, started by the
    first process a test spawns in it and alive as long as the interpreter (it ends when this process
    does). Not something a test left running, so a sweep leaves it alone."""
    import multiprocessing.resource_tracker

    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    return {pid} if isinstance(pid, int) else set()


def command_line(pid: int) -> str:
    """The process's command line (as much as 160 characters), or what a sweep last saw of it."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return _LAST_SEEN.get(pid, "?")
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:160]


atexit.register(sweep)


@dataclass
class SimEngines:
    """`count` simulated engines in one process, on consecutive ports."""

    proc: subprocess.Popen[bytes]
    ports: list[int]
    log_path: Path

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def stop(self) -> None:
        stop_process(self.proc)


def start_sim(
    log_dir: Path,
    *,
    count: int = 1,
    preset: str = "llama-3.1-8b@h100",
    time_scale: float = 10.0,
    served_model_name: str | None = None,
    args: Sequence[str] = (),
    port: int | None = None,
    wait: bool = True,
) -> SimEngines:
    ports = list(range(port, port + count)) if port is not None else free_ports(count)
    argv = [
        sys.executable,
        "-m",
        "sim",
        "--preset",
        preset,
        "--host",
        "127.0.0.1",
        "--port",
        str(ports[0]),
        "--instances",
        str(count),
        "--time-scale",
        str(time_scale),
        *args,
    ]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    log_path = log_dir / f"sim-{ports[0]}.log"
    with open(log_path, "wb") as log:
        proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
    engines = SimEngines(proc, ports, log_path)
    if not wait:
        return engines
    try:
        for url in engines.urls:
            wait_http(url + "/health", proc=proc)
    except Exception:
        engines.stop()
        raise RuntimeError("simulated engines failed to start:\n" + log_path.read_text()[-3000:]) from None
    return engines


def policies_doc(
    *,
    models: dict[str, Any] | None = None,
    tenants: dict[str, Any] | None = None,
    keys: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A policies.yaml document with a test tenant and two keys (TEST_KEY, OTHER_KEY)."""
    # imported here: tests/conftest.py imports this module in every pytest process, pytest-xdist's
    # controller included, and `policies` brings pydantic and numpy (most of a second of CPU there)
    from policies.policy import hash_key

    return {
        "tenants": tenants if tenants is not None else {"t1": {}, "t2": {"models": ["llama-3.1-8b"]}},
        "keys": keys
        if keys is not None
        else [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": models if models is not None else {"llama-3.1-8b": {"aliases": ["gpt-4o-mini"]}},
        **extra,
    }


def static_pool(name: str, model: str, urls: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "engine": "vllm", "endpoints": [{"url": u} for u in urls], **extra}


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    config_path: Path
    log_path: Path
    workdir: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, sig)


def _predictor_section(given: Any) -> Any:
    """The test's `predictor` section, training in a thread unless it names its worker. The product's
    default worker is a spawned process whose warm-up (a second interpreter importing XGBoost) the
    gateway awaits before its port answers: about 0.7 s of CPU, 1-3 s of wall and a slower stop on
    every gateway a test starts, for a process most tests never send a job. Tests of that process set
    `worker: process` themselves (tests/e2e/test_process_lifetime.py)."""
    if given is None:
        return {"worker": "thread"}
    if isinstance(given, dict):
        return {"worker": "thread", **given}
    return given


def _copy_log(pipe: IO[bytes], path: Path) -> None:
    """Copy a process's output to `path` until it exits (the pipe's end of file)."""
    with pipe, open(path, "ab") as out:
        for line in pipe:
            out.write(line)
            out.flush()


def start_gateway(
    workdir: Path,
    *,
    pools: list[dict[str, Any]],
    policies: dict[str, Any] | None = None,
    wait_ready: bool = True,
    ready_timeout_s: float = 60.0,
    command: str = "serve",
    log_pipe: bool = False,
    **sections: Any,
) -> Gateway:
    """Write gateway.yaml + policies.yaml into `workdir` and start `tokenway serve` (or `command`:
    `epp`) on a free port.

    `sections` are extra top-level gateway.yaml sections (server overrides merge into `server`).
    The predictor trains in a thread unless the test sets `predictor.worker` (see `_predictor_section`).
    `log_pipe`: the gateway writes its log into a pipe this process copies to the file, so a test that
    limits the gateway's file writes (a full disk) still reads everything it logged.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = {"host": "127.0.0.1", "port": port, "drain_timeout_s": 5, **sections.pop("server", {})}
    sections["predictor"] = _predictor_section(sections.get("predictor"))
    config = {"server": server, "policies": "policies.yaml", "pools": pools, **sections}
    (workdir / "policies.yaml").write_text(yaml.safe_dump(policies or policies_doc(), sort_keys=False))
    config_path = workdir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = spawn(
            [sys.executable, "-m", "gateway.app.cli", command, "--config", str(config_path)],
            stdout=subprocess.PIPE if log_pipe else log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=_env(),
        )
    if log_pipe:
        assert proc.stdout is not None
        threading.Thread(target=_copy_log, args=(proc.stdout, log_path), daemon=True).start()
    gateway = Gateway(proc, port, config_path, log_path, workdir)
    try:
        wait_http(gateway.url + "/healthz", proc=proc, timeout_s=ready_timeout_s)
        if wait_ready:
            wait_http(gateway.url + "/readyz", proc=proc, timeout_s=ready_timeout_s)
    except Exception as exc:
        gateway.stop(signal.SIGKILL)
        raise RuntimeError(f"gateway failed to start ({exc}):\n{gateway.log()[-4000:]}") from None
    return gateway


@contextlib.contextmanager
def running(*things: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            with contextlib.suppress(Exception):
                thing.stop()
