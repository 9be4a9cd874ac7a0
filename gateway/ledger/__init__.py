"""The usage ledger: one JSON line per finished request, group-committed to rotating files, optionally
copied to a Redis stream and a PostgreSQL table, and read back by `tokenway usage report` and `usage sql`."""

from __future__ import annotations

from gateway.app.settings import LedgerConfig, RedisStreamConfig
from gateway.ledger.writer import BatchSink, LedgerWriter


def open_ledger(config: LedgerConfig) -> LedgerWriter | None:
    """The writer `ledger:` asks for (with its Redis stream and PostgreSQL sinks), or None when disabled."""
    if not config.enabled:
        return None
    sinks: list[BatchSink] = []
    if config.redis_stream is not None:
        from gateway.ledger.sinks import RedisStreamExporter

        sinks.append(RedisStreamExporter(config.redis_stream))
    if config.postgres is not None:
        try:
            from gateway.ledger.postgres import PostgresSink
        except ImportError as exc:
            raise RuntimeError(f"ledger.postgres needs psycopg: pip install 'tokenway[postgres]' ({exc})") from exc
        sinks.append(PostgresSink(config.postgres))
    if len(sinks) > 1:
        from gateway.ledger.sinks import SinkGroup

        return LedgerWriter(config, sink=SinkGroup(sinks))
    return LedgerWriter(config, sink=sinks[0] if sinks else None)


__all__ = ["LedgerConfig", "LedgerWriter", "RedisStreamConfig", "open_ledger"]
