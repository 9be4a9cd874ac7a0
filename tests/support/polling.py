"""Wait until a condition holds: the one polling helper of the suite, in a blocking and an async form.

Tests assert behaviour, never timings: the timeout is only a ceiling that stops a hung test, and the
failure names what was awaited (`what`, a text or a function called at the failure for a text that
describes the state then, e.g. the last reading).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

Description = str | Callable[[], str]


def _timed_out(what: Description, timeout_s: float) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout_s} s waiting for {text}")


def wait_for(
    predicate: Callable[[], T | None],
    *,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    what: Description = "condition",
) -> T:
    """Call `predicate` every `interval_s` (blocking) until it returns a truthy value, and return that
    value; raise AssertionError naming `what` once `timeout_s` has passed without one."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s)
        time.sleep(interval_s)
    return value


async def wait_for_async(
    predicate: Callable[[], T | None],
    *,
    timeout_s: float = 30.0,
    interval_s: float = 0.005,
    what: Description = "condition",
) -> T:
    """`wait_for` for a test on an event loop: sleeps with `asyncio.sleep`, so the tasks that make the
    predicate true run meanwhile. The predicate itself is a plain (non-async) function."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s)
        await asyncio.sleep(interval_s)
    return value
