"""The ledger's copies beside its files: how they are sent, the Redis stream, and several at once.

The files stay the record of truth; a copy (the Redis stream here, PostgreSQL in `postgres.py`) is
handed each committed group and can neither block nor lose a file commit.

## Sending (`QueuedSender`)

The ledger's copies elsewhere (the Redis stream, PostgreSQL) share one way of sending: committed
groups queue without blocking the writer, one thread sends them in order, a failure is retried with
backoff (0.1 s doubling to 5 s) while the queue is bounded by dropping its oldest group (counted), and
at close what is queued is sent as far as the time allows, then dropped (counted).

Each group carries the sequence number of its first line in this process (the PostgreSQL sink makes
its rows idempotent with it); a sink implements `_send` (True when the group is safely out) and may
hook the thread's exit and the close.

## The Redis stream (`RedisStreamExporter`)

Optional copy of the ledger into a Redis stream, for collecting usage from many replicas.

The file ledger stays the record of truth: the writer hands each committed group to `submit`, which
only appends to a bounded queue; a thread sends the group as one pipelined round trip of
`XADD <stream> MAXLEN ~ <maxlen> * record <json line>`. When Redis is slow or down, groups wait in
the queue, the oldest are dropped past `max_pending_batches`, and failures are counted
(`tokenway_ledger_redis_*`); nothing here can block or lose a file commit.

Consumers read with `XREAD`/`XREADGROUP`; each entry has one field, `record`, holding the ledger
line (see writer.py). Delivery is at least once: a group whose round trip failed midway is sent again,
so consumers dedupe on `request_id`.

## Several sinks (`SinkGroup`)

Several ledger sinks behind the writer's one (`ledger.redis_stream` and `ledger.postgres` together).

Each sink keeps its own queue and thread; the group only hands every committed batch to each in turn
(`submit` never blocks, so neither can delay the other) and merges their counters, whose names are
already distinct (`redis_*`, `postgres_*`).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

from gateway.app.settings import RedisStreamConfig
from gateway.ledger.writer import BatchSink


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


log = logging.getLogger("tokenway.ledger")

FIELD = b"record"
_CHUNK = 1000  # XADDs per pipeline round trip


class RedisStreamExporter(QueuedSender):
    def __init__(
        self,
        config: RedisStreamConfig,
        *,
        client: Any = None,
    ) -> None:
        """`client`: a synchronous redis.Redis (built from `config.url` when None). Its latency is
        kept in `stats()` rather than reported to GatewayMetrics, whose series are written from the
        event loop thread only."""
        super().__init__(config.max_pending_batches, "ledger-redis-stream")
        self.config = config
        if client is None:
            import redis

            client = redis.Redis.from_url(
                config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
            )
        self._client = client
        self.exported_total = 0
        self._start()

    def stats(self) -> dict[str, float]:
        return {
            "redis_exported_total": self.exported_total,
            "redis_dropped_total": self.dropped_total,
            "redis_errors_total": self.errors_total,
            "redis_round_trips_total": self.round_trips_total,
            "redis_round_trip_seconds_total": self.round_trip_seconds_total,
            "redis_pending_batches": self.pending_batches(),
        }

    def _closed(self) -> None:
        try:
            self._client.close()
        except Exception as exc:  # closing a broken connection: nothing left to lose, say so and go on
            log.debug("closing the usage stream's Redis client failed: %s", exc)

    def _send(self, first_seq: int, lines: Sequence[bytes]) -> bool:
        for start in range(0, len(lines), _CHUNK):
            if not self._send_chunk(lines[start : start + _CHUNK]):
                return False
        self.exported_total += len(lines)
        return True

    def _send_chunk(self, lines: Sequence[bytes], again: bool = True) -> bool:
        cfg = self.config
        started_s = time.perf_counter()
        try:
            pipe = self._client.pipeline(transaction=False)
            for line in lines:
                pipe.xadd(cfg.stream, {FIELD: line.rstrip(b"\n")}, maxlen=cfg.maxlen, approximate=True)
            pipe.execute()
        except Exception as exc:
            self.errors_total += 1
            if self.errors_total == 1 or self.errors_total % 100 == 0:
                log.warning("usage stream %s: XADD failed (%d failures): %s", cfg.stream, self.errors_total, exc)
            # a key of another type holds no records: replaced, the chunk goes again at once (not after
            # the backoff: a stopping exporter would drop it)
            return again and "WRONGTYPE" in str(exc) and self._replace_stream() and self._send_chunk(lines, False)
        finally:
            self.round_trips_total += 1
            self.round_trip_seconds_total += time.perf_counter() - started_s
        return True

    def _replace_stream(self) -> bool:
        """The stream's key holds another type (a hand edit, another program on the prefix): it holds
        no records, so it is deleted and the retry starts the stream afresh, rather than every record
        waiting (and, past `max_pending_batches`, dropped) until an operator repairs it."""
        try:
            if self._client.type(self.config.stream) not in (b"stream", b"none", "stream", "none"):
                self._client.delete(self.config.stream)
        except Exception as exc:  # the retry's backoff covers a Redis that does not answer this either
            log.debug("usage stream %s: replacing it failed: %s", self.config.stream, exc)
            return False
        return True


class SinkGroup:
    def __init__(self, sinks: Sequence[BatchSink]) -> None:
        self.sinks = list(sinks)

    def submit(self, lines: Sequence[bytes]) -> None:
        for sink in self.sinks:
            sink.submit(lines)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sink in self.sinks:
            out.update(sink.stats())
        return out

    def close_sync(self, timeout_s: float = 5.0) -> None:
        for sink in self.sinks:
            sink.close_sync(timeout_s)
