"""Several ledger sinks behind the writer's one (`ledger.redis_stream` and `ledger.postgres` together).

Each sink keeps its own queue and thread; the group only hands every committed batch to each in turn
(`submit` never blocks, so neither can delay the other) and merges their counters, whose names are
already distinct (`redis_*`, `postgres_*`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.ledger.writer import BatchSink


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
