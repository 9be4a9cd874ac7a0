"""Engine processes: logs, exit descriptions, group termination with escalation, death with the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backends.adapters.base import LaunchSpec
from backends.process import EngineProcess, crash_tail, describe_exit, error_lines, tail_lines

pytestmark = pytest.mark.e2e  # starts real processes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still "exists": read its state
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state != "Z"


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_tail_lines_reads_the_latest_run_only(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    log.write_text(
        "=== tokenway 2026-01-01 p/both-0 attempt 1\n=== argv: ['x']\nold output\n"
        "=== tokenway 2026-01-01 p/both-0 attempt 2\n=== argv: ['x']\nline 1\n\nline 2\nline 3\n"
    )
    assert tail_lines(str(log), 2) == ("line 2", "line 3")
    assert tail_lines(str(log), 10) == ("line 1", "line 2", "line 3")
    assert tail_lines(str(tmp_path / "missing.log"), 3) == ()
    assert tail_lines(None, 3) == ()


@pytest.mark.parametrize(
    ("code", "text"), [(0, "exit code 0"), (3, "exit code 3"), (-9, "killed by SIGKILL"), (None, "still running")]
)
def test_describe_exit(code: int | None, text: str) -> None:
    assert describe_exit(code) == text


async def test_spawn_writes_files_and_log(tmp_path: Path) -> None:
    config = tmp_path / "run" / "cfg.yaml"
    spec = LaunchSpec(
        argv=(sys.executable, "-c", "import os; print('hello', os.environ['TOKENWAY_T'])"),
        env={"TOKENWAY_T": "42"},
        log_path=str(tmp_path / "logs" / "e.log"),
        files={str(config): "a: 1\n"},
    )
    process = await EngineProcess.spawn(spec, header="p/both-0 attempt 1")
    assert await process.wait() == 0
    assert config.read_text() == "a: 1\n"
    text = (tmp_path / "logs" / "e.log").read_text()
    assert "=== tokenway" in text and "p/both-0 attempt 1" in text
    assert tail_lines(spec.log_path, 5) == ("hello 42",)


async def test_spawn_of_a_missing_executable_raises(tmp_path: Path) -> None:
    spec = LaunchSpec(argv=("/nonexistent/engine",), log_path=str(tmp_path / "e.log"))
    with pytest.raises(OSError):
        await EngineProcess.spawn(spec)
    assert "cannot start" in (tmp_path / "e.log").read_text()


async def test_terminate_escalates_and_reaches_the_whole_group(tmp_path: Path) -> None:
    # A leader that ignores SIGTERM, with a worker child (like an engine core) in its group.
    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("worker", worker.pid, flush=True)
        time.sleep(600)
    """)
    log = tmp_path / "e.log"
    process = await EngineProcess.spawn(LaunchSpec(argv=(sys.executable, "-c", script), log_path=str(log)))
    worker_pid = 0
    for _ in range(400):
        lines = [line for line in tail_lines(str(log), 5) if line.startswith("worker ")]
        if lines:
            worker_pid = int(lines[0].split()[1])
            break
        await asyncio.sleep(0.025)
    assert worker_pid
    code = await process.terminate(grace_s=0.2)
    assert code == -signal.SIGKILL
    assert await asyncio.to_thread(wait_gone, worker_pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_engine_dies_with_a_sigkilled_gateway(tmp_path: Path) -> None:
    gateway = textwrap.dedent(f"""
        import asyncio, sys
        from backends.adapters.base import LaunchSpec
        from backends.process import EngineProcess

        async def main():
            spec = LaunchSpec(argv=(sys.executable, "-c", "import time; time.sleep(600)"),
                              log_path={str(tmp_path / "engine.log")!r})
            process = await EngineProcess.spawn(spec)
            print(process.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", gateway], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        assert parent.stdout is not None
        engine_pid = int(parent.stdout.readline())
        assert alive(engine_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(engine_pid), "the engine outlived a SIGKILLed gateway"
    finally:
        if parent.poll() is None:
            parent.kill()


FIXTURES = Path(__file__).with_name("fixtures")


def test_error_lines_find_the_root_cause_above_vllms_summary() -> None:
    # A real vLLM 0.32 CPU start with --block-size 16: the last lines end at "See root cause above".
    log = str(FIXTURES / "vllm_0_32_cpu_crash.log")
    assert tail_lines(log, 30)[-3].endswith("See root cause above. Failed core proc(s): {}")
    assert error_lines(log) == ("ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).",)


def test_crash_tail_puts_the_error_lines_before_the_last_lines() -> None:
    log = str(FIXTURES / "vllm_0_32_cpu_crash.log")
    shown = crash_tail(log, 30)
    assert shown[:2] == ("error: ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).", "...")
    assert shown[2:] == tail_lines(log, 30)


def test_crash_tail_is_the_plain_tail_when_it_shows_the_error(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    log.write_text(
        "starting\nTraceback (most recent call last):\n  File x\nOSError: [Errno 98] Address already in use\n"
    )
    assert crash_tail(str(log), 5) == tail_lines(str(log), 5)
    assert error_lines(str(log)) == ("OSError: [Errno 98] Address already in use",)


async def test_reap_group_kills_workers_the_leader_left_behind(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import os, signal, sys, time
        worker = os.fork()
        if worker == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stuck worker: only SIGKILL stops it
            time.sleep(600)
        print(worker, flush=True)
        os._exit(0)
    """)
    log = tmp_path / "e.log"
    process = await EngineProcess.spawn(LaunchSpec(argv=(sys.executable, "-c", script), log_path=str(log)))
    await process.wait()
    worker = int(log.read_text().strip().splitlines()[-1])
    assert alive(worker) and process.group_alive()
    assert await process.reap_group(grace_s=0.2)
    assert not alive(worker) and not process.group_alive()
