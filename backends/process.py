"""One engine process: spawned in its own process group, tied to the gateway's life, logged to a file.

Why a process group: engines fork workers (vLLM's engine core, TRT-LLM's MPI ranks); signalling the
group stops them all. When the leader dies on its own (a crash, `kill -9` of vLLM's API server), its
workers live on in the group holding their ZMQ ports (and, on a GPU, the GPU memory), and a restart
fails with `Address already in use`: `reap_group` kills what is left before anything is restarted.
Why PR_SET_PDEATHSIG (Linux): if the gateway is SIGKILLed, no cleanup code runs, and the kernel is
the only one left to tell the engine; it then gets SIGTERM, which vLLM and trtllm-serve handle by
shutting their own workers down (checked against the real vLLM: `make test-vllm`). The signal is
tied to the thread that spawned the child, here the event loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from backends.adapters.base import LaunchSpec

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _death_signal_preexec(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when the gateway dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the gateway died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def death_signal_preexec(parent_pid: int) -> Callable[[], None] | None:
    """The same, for any child that is not an engine (the private Redis of a group of workers)."""
    return _death_signal_preexec(parent_pid)


_RUN_MARKER = "=== tokenway "
_ARGV_MARKER = "=== argv: "


def tail_lines(path: str | None, count: int, max_bytes: int = 64 * 1024) -> tuple[str, ...]:
    """The last `count` non-empty lines the latest run wrote to its log (the file is appended to on
    every start; this reads at most `max_bytes` from its end and skips tokenway's header lines)."""
    if not path:
        return ()
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ()
    lines = [line.rstrip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith(_RUN_MARKER)]
    if starts:
        lines = lines[starts[-1] + 1 :]
    lines = [line for line in lines if not line.startswith(_ARGV_MARKER)]
    return tuple(lines[-count:])


# A Python exception line as a traceback ends it, possibly behind a process prefix vLLM adds
# ("(EngineCore pid=7) ValueError: ..."): the engine's own summary ("... See root cause above") says
# only that an error happened; the lines before it say which.
_ERROR_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\)\s+)?"  # vLLM's process prefix: "(EngineCore pid=7) "
    r"(?:[A-Z]+ \S+ \S+ \[[^\]]+\]\s+)?"  # its log prefix: "ERROR 12-01 17:45:07 [core.py:1510] "
    r"((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b.*)$"
)
_SUMMARY_ONLY = ("See root cause above", "check the stack trace above")


def error_lines(path: str | None, count: int = 5, max_bytes: int = 256 * 1024) -> tuple[str, ...]:
    """The distinct exception lines (`ValueError: ...`) the latest run wrote, first to last, without
    the engine's generic summaries; at most `count`, the earliest kept (the root cause comes first)."""
    found: list[str] = []
    for line in tail_lines(path, 1_000_000, max_bytes):
        match = _ERROR_LINE.match(line.strip())
        if match is None:
            continue
        text = match.group(1)
        if any(marker in text for marker in _SUMMARY_ONLY) or text in found:
            continue
        found.append(text)
    return tuple(found[:count])


def crash_tail(path: str | None, count: int) -> tuple[str, ...]:
    """What an operator needs from a crashed engine's log: its exception lines, then the last lines.

    The last lines of vLLM's output end with the engine's summary ("See root cause above"); the real
    error sits above them, so the error lines are put first when the tail does not show them."""
    tail = tail_lines(path, count)
    errors = [line for line in error_lines(path) if not any(line in t for t in tail)]
    if not errors:
        return tail
    return (*(f"error: {line}" for line in errors), "...", *tail)


def group_has_live_members(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie. Zombies are skipped: an orphan
    is reaped by whoever adopted it, and a container's init may be slow to do that or never do."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _prepare(spec: LaunchSpec, header: str) -> BinaryIO:
    """Write the spec's files and open its log for appending, with a header line per start."""
    for path, content in spec.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content, encoding="utf-8")
    if spec.log_path:
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.log_path or os.devnull, "ab")  # noqa: SIM115 - handed to the caller's `with`
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    log.write(f"{_RUN_MARKER}{stamp} {header}\n{_ARGV_MARKER}{list(spec.argv)}\n".encode())
    log.flush()
    return log


class EngineProcess:
    """A launched engine. `wait`, `terminate` and `kill_now` act on its whole process group."""

    def __init__(self, process: asyncio.subprocess.Process, spec: LaunchSpec) -> None:
        self.process = process
        self.spec = spec
        self.pid = process.pid
        self._waiter: asyncio.Task[int] = asyncio.ensure_future(process.wait())

    @classmethod
    async def spawn(cls, spec: LaunchSpec, header: str = "") -> EngineProcess:
        """Write the spec's files, open its log (appending), start it. OSError if it cannot start."""
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        with _prepare(spec, header) as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    *spec.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=spec.cwd,
                    start_new_session=True,  # own process group: signal the engine and its workers
                    preexec_fn=_death_signal_preexec(os.getpid()),
                )
            except OSError as exc:
                log.write(f"=== cannot start: {exc}\n".encode())
                raise
        return cls(process, spec)

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait(self) -> int:
        return await asyncio.shield(self._waiter)

    def exited(self) -> asyncio.Future[int]:
        """A future resolved with the exit code (for waiting on exit or something else)."""
        return self._waiter

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def terminate(self, grace_s: float) -> int:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL it. Returns the exit code."""
        if self.alive:
            self.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), timeout=grace_s)
            except TimeoutError:
                self.signal_group(signal.SIGKILL)
        code = await self.wait()
        self.signal_group(signal.SIGKILL)  # workers that outlived their leader
        return code

    def group_alive(self) -> bool:
        """True while any live process of the group (workers the leader left behind) exists."""
        return group_has_live_members(self.pid)

    async def reap_group(self, grace_s: float, timeout_s: float = 30.0) -> bool:
        """After the leader exited: SIGTERM what is left of the group, SIGKILL it after `grace_s`, and
        wait until the group is empty (at most `timeout_s`). True when nothing is left."""
        await self.wait()
        loop = asyncio.get_running_loop()
        if not self.group_alive():
            return True
        self.signal_group(signal.SIGTERM)
        deadline_s = loop.time() + grace_s
        # Nothing notifies about grandchildren (they are not ours to wait for): polling is the contract.
        while self.group_alive() and loop.time() < deadline_s:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        self.signal_group(signal.SIGKILL)
        deadline_s = loop.time() + timeout_s
        while self.group_alive() and loop.time() < deadline_s:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        return not self.group_alive()

    def kill_now(self, grace_s: float = 2.0) -> None:
        """Synchronous stop for interpreter exit (no event loop): SIGTERM, short wait, SIGKILL."""
        if self.process.returncode is not None:
            self.signal_group(signal.SIGKILL)
            return
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                break
            time.sleep(0.05)
        self.signal_group(signal.SIGKILL)


WATCH_INTERVAL_S = 1.0


def die_with_parent(parent_pid: int, *, watch_interval_s: float = WATCH_INTERVAL_S) -> None:
    """Make this process end when `parent_pid` does (call early in the child): a child process that
    must not outlive the process that started it, even a `kill -9`ed one (the predictor's trainer).

    Nothing runs in a parent killed with SIGKILL, so its children have to notice on their own. Two
    ways, both set up here in the child (e.g. as a `ProcessPoolExecutor` initializer):

    - Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the child the
      moment the thread that forked it ends. That thread is the parent's main thread here (the event
      loop submits the work), so it fires when the parent dies; if the parent died before the child
      got this far, the signal is never sent, hence the check of the parent's pid right after.
    - A watchdog thread that polls the parent's pid and exits the child once it changes (re-parented
      to init or a subreaper): the fallback where prctl is missing (macOS) or was not set.

    A child killed this way lets `multiprocessing`'s resource tracker (another child of the parent,
    whose pipe the workers hold open) see end-of-file and exit too.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent is gone already
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid, watch_interval_s), name="lifeline", daemon=True).start()


def _watch(parent_pid: int, interval_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(1)
