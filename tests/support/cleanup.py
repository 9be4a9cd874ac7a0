"""A pytest plugin: processes a failing fixture or test started do not outlive the failure.

A fixture that starts engines and gateways and then raises never reaches its `finally` or the yield
its teardown follows: what it had started kept running (three gateways and a simulated fleet, for
fifteen minutes, once). Here every fixture's setup and every test's call is bracketed by a snapshot
of the processes running (those registered by `tests.support.procs.spawn`, and every descendant of
the pytest process, so a bare `subprocess.Popen` counts too): when the step fails, whatever it
started and left running is killed (its process group included) before pytest moves on. The end of
the session sweeps whatever is left, and `procs` registers the same sweep at interpreter exit.

tests/conftest.py loads it for the suite; `pytest -p tests.support.cleanup` loads it anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

import pytest

from tests.support import procs


def _ended(what: str, pids: list[int]) -> None:
    """Name what was left running (its command line: which fixture or test forgot it is then plain)."""
    if pids:
        left = "; ".join(f"{pid}: {procs.command_line(pid)}" for pid in sorted(pids))
        print(f"\n[cleanup] {what}: ended processes left running: {left}", file=sys.stderr)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    before = procs.snapshot()
    try:
        return (yield)
    except BaseException:
        _ended(f"fixture {fixturedef.argname!r}", procs.sweep(since=before))
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    before = procs.snapshot()
    try:
        return (yield)
    except BaseException:
        _ended(f"test {item.nodeid}", procs.sweep(since=before))
        raise


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.pluginmanager.has_plugin("dsession"):
        return  # pytest-xdist's controller: runs no test, and its children are the workers (each sweeps its own)
    _ended("the session (left over at its end)", procs.sweep())
