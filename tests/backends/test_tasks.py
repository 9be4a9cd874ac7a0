"""`cancel_and_wait`: a stop that survives a dropped cancel, and gives up on a task that ignores all."""

from __future__ import annotations

import asyncio

import pytest

from backends.tasks import cancel_and_wait


async def _drops_first_cancel(started: asyncio.Event) -> None:
    """Swallows one cancel, as redis-py's `wait_for` can on Python 3.11, then loops on."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # the dropped cancel: the loop runs on
    await asyncio.Event().wait()  # until the next cancel


async def _ignores_every_cancel(started: asyncio.Event, stop: asyncio.Event) -> None:
    started.set()
    while not stop.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            continue


async def _fails() -> None:
    raise RuntimeError("the loop's own failure")


async def test_a_task_that_drops_a_cancel_is_cancelled_again_until_it_ends() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(_drops_first_cancel(started))
    await started.wait()
    left = await cancel_and_wait([task])
    assert left == set() and task.cancelled()


@pytest.mark.slow
async def test_a_task_that_ignores_every_cancel_is_left_behind_and_named() -> None:
    started, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_ignores_every_cancel(started, stop))
    await started.wait()
    left = await cancel_and_wait([task], attempts=3)
    assert left == {task} and not task.done()
    stop.set()
    await task


async def test_ended_tasks_are_retrieved_not_reraised() -> None:
    task = asyncio.create_task(_fails())
    await asyncio.wait([task])
    assert await cancel_and_wait([task]) == set()
