"""The group's own Redis: what N workers share when gateway.yaml says `state: memory`.

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
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from backends.process import death_signal_preexec

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
