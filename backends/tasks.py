"""Stopping background tasks when a cancel can be lost.

On Python 3.11, `asyncio.wait_for` returns the awaited result instead of raising when a cancel lands
in the step where the awaited operation completes, and redis-py wraps every socket write in it
(`socket_timeout`; `asyncio.timeout` around its reads has the same window). A loop that talks to Redis
and is cancelled once can therefore run on, and a `stop` that awaits it waits for ever: the batch
runner's outage test hung that way under load. Every `stop` of a loop that may be inside such a call
cancels through `cancel_and_wait`, which cancels again until the tasks end.

Lives in `backends` (the lowest room) so that every room's loops share it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Final

log = logging.getLogger("tokenway.tasks")

RECANCEL_S: Final = 0.1  # how long a cancelled task gets before it is cancelled again
ATTEMPTS: Final = 100  # cancels before a task that keeps ignoring them is left behind (~10 s)


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], *, what: str = "background", attempts: int = ATTEMPTS
) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them to end, cancelling again those still running after
    `RECANCEL_S`. Returns the tasks left behind after `attempts` cancels (logged: a task that
    catches every cancel is a bug, and shutdown must not wait for it for ever). What the ended tasks
    raised is retrieved, not re-raised: it is theirs to log, and asyncio would otherwise report it
    as never retrieved at exit."""
    every = list(tasks)
    pending = {task for task in every if not task.done()}
    for _ in range(attempts):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    if pending:
        log.warning("%d %s task(s) ignored cancellation; left behind", len(pending), what)
    for task in every:
        if task.done() and not task.cancelled():
            task.exception()
    return pending
