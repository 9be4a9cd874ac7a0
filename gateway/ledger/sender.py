"""The ledger's copies elsewhere (the Redis stream, PostgreSQL) share one way of sending: committed
groups queue without blocking the writer, one thread sends them in order, a failure is retried with
backoff (0.1 s doubling to 5 s) while the queue is bounded by dropping its oldest group (counted), and
at close what is queued is sent as far as the time allows, then dropped (counted).

Each group carries the sequence number of its first line in this process (the PostgreSQL sink makes
its rows idempotent with it); a sink implements `_send` (True when the group is safely out) and may
hook the thread's exit and the close.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence


class QueuedSender(ABC):
    def __init__(self, max_pending_batches: int, thread_name: str) -> None:
        self.max_pending_batches = max_pending_batches
        self._queue: deque[tuple[int, Sequence[bytes]]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._next_seq = 0
        self.dropped_total = 0
        self.errors_total = 0
        self.round_trips_total = 0
        self.round_trip_seconds_total = 0.0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        """Start the sender thread (the subclass's own fields set first)."""
        self._thread.start()

    def submit(self, lines: Sequence[bytes]) -> None:
        """Queue one committed group. Never blocks; drops the oldest group when full."""
        with self._cond:
            if len(self._queue) >= self.max_pending_batches:
                _, dropped = self._queue.popleft()
                self.dropped_total += len(dropped)
            self._queue.append((self._next_seq, lines))
            self._next_seq += len(lines)
            self._cond.notify()

    def pending_batches(self) -> int:
        return len(self._queue)

    def close_sync(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (best effort within `timeout_s`), then stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._closed()

    def _closed(self) -> None:
        """After the thread was given its time to send what was queued."""
        return None

    def _exiting(self) -> None:
        """The sender thread's last act (close a connection)."""
        return None

    def _dropped_at_stop(self, records: int) -> None:
        """Records left unsent when the sink stopped (counted already)."""
        return None

    @abstractmethod
    def _send(self, first_seq: int, lines: Sequence[bytes]) -> bool:
        """Send one group; True when it is safely out (a False is retried after a backoff)."""

    def _run(self) -> None:
        backoff_s = 0.0
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return
                    first_seq, lines = self._queue[0]
                if self._send(first_seq, lines):
                    backoff_s = 0.0
                    with self._cond:
                        if self._queue and self._queue[0][1] is lines:
                            self._queue.popleft()
                    continue
                if self._stopping:
                    with self._cond:
                        left = sum(len(b) for _, b in self._queue)
                        self.dropped_total += left
                        self._queue.clear()
                    if left:
                        self._dropped_at_stop(left)
                    return
                backoff_s = min(max(backoff_s * 2, 0.1), 5.0)
                with self._cond:
                    self._cond.wait(backoff_s)  # woken early only by close
        finally:
            self._exiting()
