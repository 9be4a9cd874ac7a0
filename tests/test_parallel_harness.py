"""What keeps pytest-xdist workers apart (docs/testing.md): each draws ports from its own slice and uses
its own Redis database."""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import _worker_database
from tests.support import procs


def _as_worker(monkeypatch: pytest.MonkeyPatch, worker: str, count: int) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))


def test_each_worker_draws_ports_from_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    slices = []
    for index in range(4):
        _as_worker(monkeypatch, f"gw{index}", 4)
        low, high = procs._port_range()
        slices.append((low, high))
        for _ in range(50):
            assert low <= procs.free_port() < high
            run = procs.free_ports(3)
            assert low <= run[0] and run[-1] < high and run == list(range(run[0], run[0] + 3))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(slices))  # disjoint
    assert slices[0][0] >= 20000 and slices[-1][1] <= 32000  # below the ephemeral range


def test_a_port_handed_out_is_not_handed_out_again_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_worker(monkeypatch, "gw0", 1)  # one worker: the whole range
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_each_worker_uses_a_redis_database_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert _worker_database("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"  # a serial run
    _as_worker(monkeypatch, "gw0", 4)
    assert _worker_database("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/1"
    _as_worker(monkeypatch, "gw3", 4)
    assert _worker_database("redis://:secret@127.0.0.1:6380/0") == "redis://:secret@127.0.0.1:6380/4"
