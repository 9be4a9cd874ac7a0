"""Nothing the gateway starts outlives it: after a `kill -9` of `tokenway serve`, its predictor training
worker and multiprocessing's resource tracker end too (a real gateway process, a real SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.procs import Gateway, SimEngines, static_pool

pytestmark = pytest.mark.e2e


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_kill_9_of_the_gateway_leaves_no_process_behind(
    gateway_factory: Callable[..., Gateway], sim_factory: Callable[..., SimEngines]
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    # the product's default worker, named: the test gateways train in a thread otherwise (tests/support/procs.py)
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)], predictor={"worker": "process"}
    )
    deadline = time.monotonic() + 60
    started: list[int] = []
    while time.monotonic() < deadline and len(started) < 2:  # the training worker and the resource tracker
        started = children_of(gateway.proc.pid)
        time.sleep(0.1)
    assert len(started) >= 2, f"expected the predictor's worker and resource tracker, found {started}"
    gateway.proc.send_signal(signal.SIGKILL)
    gateway.proc.wait(10)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in started):
            time.sleep(0.1)
        assert [pid for pid in started if alive(pid)] == []
    finally:
        for pid in started:  # never leave them behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
