"""Issue 40's bounds on the request's walk, kept: a streamed chat completion through the embedded
default gateway touches at most 50 production modules, and the tree holds at most 240.

The walk grew past 50 unnoticed once (stop 54: a metric priced every dispatch through three
`backends/perf` modules) because only a benchmark measured it. This runs the same tracer
(`bench/walk/tracer.py`: the gateway built in process, the simulated engines as subprocesses, one
warm-up and one traced request of each kind) and fails when a change puts the walk over the bound:
fold the new code into a module the walk already has, or keep it off the request's path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.procs import spawn, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MAX_WALK_MODULES = 50
MAX_TREE_MODULES = 240


def test_a_streamed_chat_walks_at_most_50_modules_of_a_tree_of_at_most_240(tmp_path: Path) -> None:
    out = tmp_path / "walk.json"
    state = tmp_path / "cwd"  # the default config's var/ (keys, audit, usage, batch) away from the tree's
    state.mkdir()
    tracer = [sys.executable, str(REPO / "bench/walk/tracer.py"), "--root", str(REPO), "--cwd", str(state)]
    errors = tmp_path / "walk.err"
    with out.open("wb") as sink, errors.open("wb") as err:
        proc = spawn([*tracer, "--warm-ups", "1", "--repeats", "1"], stdout=sink, stderr=err, cwd=REPO)
        try:
            assert proc.wait(240) == 0, errors.read_text()[-2000:]
        finally:
            stop_process(proc)
    found = json.loads(out.read_text())
    (run,) = found["requests"]["chat, streamed"]["runs"]
    assert run["status"] == 200 and not run["unfinished_tasks"]
    modules = sorted(run["modules"])
    assert len(modules) <= MAX_WALK_MODULES, f"{len(modules)} modules on the walk: {modules}"
    tree = sum(room["all"] for room in found["production_modules"].values())
    assert tree <= MAX_TREE_MODULES
