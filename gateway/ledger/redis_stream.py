"""Optional copy of the ledger into a Redis stream, for collecting usage from many replicas.

The file ledger stays the record of truth: the writer hands each committed group to `submit`, which
only appends to a bounded queue; a thread sends the group as one pipelined round trip of
`XADD <stream> MAXLEN ~ <maxlen> * record <json line>`. When Redis is slow or down, groups wait in
the queue, the oldest are dropped past `max_pending_batches`, and failures are counted
(`tokenway_ledger_redis_*`); nothing here can block or lose a file commit.

Consumers read with `XREAD`/`XREADGROUP`; each entry has one field, `record`, holding the ledger
line (see codec.py). Delivery is at least once: a group whose round trip failed midway is sent again,
so consumers dedupe on `request_id`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from gateway.app.schema import RedisStreamConfig
from gateway.ledger.sender import QueuedSender

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
        cfg = self.config
        for start in range(0, len(lines), _CHUNK):
            started_s = time.perf_counter()
            try:
                pipe = self._client.pipeline(transaction=False)
                for line in lines[start : start + _CHUNK]:
                    pipe.xadd(cfg.stream, {FIELD: line.rstrip(b"\n")}, maxlen=cfg.maxlen, approximate=True)
                pipe.execute()
            except Exception as exc:
                self.errors_total += 1
                if self.errors_total == 1 or self.errors_total % 100 == 0:
                    log.warning("usage stream %s: XADD failed (%d failures): %s", cfg.stream, self.errors_total, exc)
                return False
            finally:
                self.round_trips_total += 1
                self.round_trip_seconds_total += time.perf_counter() - started_s
        self.exported_total += len(lines)
        return True
