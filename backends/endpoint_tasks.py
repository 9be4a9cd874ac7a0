"""At most one background task per endpoint: the shape shared by health probes and metrics scrapes.

Each probe or scrape runs as its own task so a slow endpoint delays no other; an endpoint whose
previous task is still running is skipped rather than piled onto.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class EndpointTasks:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._running: dict[str, asyncio.Task[Any]] = {}

    def busy(self, endpoint_id: str) -> bool:
        return endpoint_id in self._running

    def start(self, endpoint_id: str, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work, name=f"{self.kind} {endpoint_id}")
        self._running[endpoint_id] = task
        task.add_done_callback(lambda _task: self._running.pop(endpoint_id, None))

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
