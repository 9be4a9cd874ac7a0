"""The ledger survives `kill -9` under load: every record appended more than one commit interval
before the kill is in the files, and nothing is corrupt except possibly a torn last line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.ledger.reader import ReadStats, iter_entries, ledger_files

pytestmark = pytest.mark.e2e  # starts real processes

REPO = Path(__file__).resolve().parents[3]
PROC = Path(__file__).with_name("_writer_proc.py")


@pytest.mark.parametrize("run_s", [0.7, 1.3], ids=["short", "long"])
def test_kill_9_loses_nothing_older_than_one_commit_interval(tmp_path: Path, run_s: float) -> None:
    directory = tmp_path / "usage"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(PROC), str(directory), "100", str(256 * 1024)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"READY\n"
    time.sleep(run_s)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    acked = [line for line in out.decode().split("\n")[:-1]]  # a line cut by the kill has no newline
    assert len(acked) > 100, "the writer process did not get going"

    stats = ReadStats()
    ids = [e["request_id"] for e in iter_entries(directory, stats=stats, warn=lambda m: None)]
    missing = set(acked) - set(ids)
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {sorted(missing)[:3]}"
    assert stats.corrupt_lines == 0, stats.warnings
    assert stats.torn_lines <= 1
    assert len(ids) == len(set(ids)), "no record written twice"
    assert ids == sorted(ids), "records keep their append order across rotated files"
    assert len(ledger_files(directory)) > 1, "the run rotated files under load"
