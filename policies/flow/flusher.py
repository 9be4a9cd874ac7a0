"""Changes batched for Redis: what `redis_counters.py` (tenants' virtual counters) and
`redis_programs.py` (programs' attained service) share.

Each keeps a local view per key group that ordering reads at once, and sends what changed as one
script call per group every `flush_s`, at most one flush in flight: a change arms a timer, the timer
starts a flush when something is due, the flush's end re-arms the timer if more is pending. At
close, a last flush sends what is left (bounded by a second). The stores say what is due (`_due`),
what must still go out at close (`_pending`), and how a flush runs (`_flush`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import Any

from backends.tasks import cancel_and_wait
from policies.limits.scriptpipe import ScriptPipe


class BatchedFlush(ABC):
    """The timer and the one flush in flight of a Redis-shared view (see the module docstring)."""

    client: Any
    pipeline: Any
    flush_s: float
    calls: int  # script calls made (the subclass starts it at 0)

    def _init_flush(self) -> None:
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None

    @abstractmethod
    def _due(self) -> bool:
        """Some group has changes (or reads) to send now."""

    def _pending(self) -> bool:
        """Some group has changes that must still reach Redis (at close)."""
        return self._due()

    @abstractmethod
    async def _flush(self) -> None:
        """One script call per due group (then `_answered`)."""

    @abstractmethod
    def _failed(self, view: Any, exc: BaseException) -> None:
        """A group's call failed: its sent changes stay in this replica's view."""

    @abstractmethod
    def _apply(self, view: Any, reply: Any) -> None:
        """A group's call answered: the values Redis holds now."""

    async def _answered(self, batch: Sequence[tuple[Any, Any]], calls: Sequence[Awaitable[Any]]) -> None:
        """Wait for a flush's calls, one per (key, view) of `batch`, and apply each answer or failure."""
        self.calls += len(calls)
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for (_, view), reply in zip(batch, replies, strict=True):
            if isinstance(reply, BaseException):
                self._failed(view, reply)
            else:
                view.sent = None
                self._apply(view, reply)

    def _idle(self) -> bool:
        """No flush armed or running (the refresh loop starts one of its own only then)."""
        return self._flush_timer is None and self._flushing is None

    def _changed(self) -> None:
        if self._idle():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller in a test): it stays queued
                return
            self._flush_timer = loop.call_later(self.flush_s, self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        if self._flushing is None and self._due():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
            self._flushing.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task[None]) -> None:
        if self._flushing is task:
            self._flushing = None
        if self._flush_timer is None and self._pending():
            self._flush_timer = asyncio.get_running_loop().call_later(self.flush_s, self._start_flush)

    async def close(self) -> None:
        if self._refresher is not None:
            await cancel_and_wait([self._refresher], what="flow counters refresher")
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._flushing is not None:
            await asyncio.wait([self._flushing], timeout=1.0)
        if self._pending():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())  # the last changes
            await asyncio.wait([self._flushing], timeout=1.0)
        if isinstance(self.pipeline, ScriptPipe):
            await self.pipeline.close()
        await self.client.aclose()
