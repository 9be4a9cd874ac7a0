"""The usage ledger: one JSON line per finished request, group-committed to rotating files, optionally
copied to a Redis stream, and read back by `tokenway usage report`."""

from __future__ import annotations

from gateway.app.schema import LedgerConfig, RedisStreamConfig
from gateway.ledger.writer import LedgerWriter


def open_ledger(config: LedgerConfig) -> LedgerWriter | None:
    """The writer `ledger:` asks for (with its Redis stream exporter), or None when disabled."""
    if not config.enabled:
        return None
    sink = None
    if config.redis_stream is not None:
        from gateway.ledger.redis_stream import RedisStreamExporter

        sink = RedisStreamExporter(config.redis_stream)
    return LedgerWriter(config, sink=sink)


__all__ = ["LedgerConfig", "LedgerWriter", "RedisStreamConfig", "open_ledger"]
