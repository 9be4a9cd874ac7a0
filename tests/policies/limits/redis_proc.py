"""A Redis server the test owns, on its own port, so it can be killed and restarted mid-run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator

import pytest
import redis

from tests.support.procs import free_port, redis_argv, wait_redis


class RedisProcess:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("TOKENWAY_REQUIRE_REDIS") == "1":  # make test, .ci/run: never skip silently
                pytest.fail("redis-server is required (TOKENWAY_REQUIRE_REDIS=1) but not installed")
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="tokenway-redis-")
        self.proc = subprocess.Popen(
            redis_argv(self.binary, self.port, self.workdir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_redis(self.url)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (nothing is saved, connections just drop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    @contextlib.contextmanager
    def stalled(self, seconds: float) -> Iterator[None]:
        """SIGSTOP the server now and SIGCONT it `seconds` later (from a timer: the body may await).

        A stopped server is a stall, not a crash: commands already sent wait in its socket buffer and
        run when it resumes, after their callers' timeouts. (CLIENT PAUSE is no stand-in: a paused
        server drops the commands of a client that disconnected meanwhile.)
        """
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
        timer.start()
        try:
            yield
        finally:
            timer.join()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
