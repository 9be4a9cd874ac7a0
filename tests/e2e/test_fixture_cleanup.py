"""A fixture that starts processes and then raises leaves nothing running: an inner pytest session
(with the suite's cleanup plugin) runs a fixture that starts a process through `procs.spawn`, one
through a bare `subprocess.Popen` and one that forks a child of its own, then fails; the next test
of that session finds all three gone while the session still runs, and nothing is left after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.procs import REPO, alive, all_gone, spawn, stop_process

pytestmark = pytest.mark.e2e

INNER = """
import subprocess
from pathlib import Path

import pytest

from tests.support.procs import all_gone, spawn

PIDS = Path(__file__).parent / "pids"


@pytest.fixture
def fleet():
    spawned = spawn(["sleep", "600"])
    bare = subprocess.Popen(["sleep", "600"])
    forked = spawn(["sh", "-c", "sleep 600 & echo $! > grandchild; wait"], cwd=PIDS.parent)
    for _ in range(200):
        if (PIDS.parent / "grandchild").exists() and (PIDS.parent / "grandchild").read_text().strip():
            break
        import time; time.sleep(0.02)
    grandchild = int((PIDS.parent / "grandchild").read_text())
    PIDS.write_text(f"{spawned.pid} {bare.pid} {forked.pid} {grandchild}")
    raise RuntimeError("the fixture failed after starting its processes")


def test_with_the_failing_fixture(fleet):
    pass


def test_after_it():
    pids = [int(p) for p in PIDS.read_text().split()]
    assert all_gone(pids)
"""


def test_a_failing_fixture_leaves_no_process_running(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    plugin = ["-p", "tests.support.cleanup", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugin, "test_inner.py"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    try:
        assert "1 passed, 1 error" in out, out  # the fixture failed; the test after it passed
        assert "ended processes left running" in out, out
        assert all_gone(pids)
    finally:
        for pid in pids:  # should this test fail, it must not leak what it checks for either
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)


def test_stop_process_ends_the_whole_group(tmp_path: Path) -> None:
    proc = spawn(["sh", "-c", "sleep 600 & echo $! > child; wait"], cwd=tmp_path)
    try:
        for _ in range(500):
            if (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip():
                break
            subprocess.run(["sleep", "0.02"])
        child = int((tmp_path / "child").read_text())
        assert alive(child)
    finally:
        stop_process(proc)
    assert all_gone([proc.pid, child])  # the child it forked ended with its group
