"""With `state: redis` the ledger's records meet on the state's own Redis by default (issue 45: the
console's usage and tenant spend count every replica with no more setup): which stream, its cap, how
to turn it off, that a configured `ledger.redis_stream` still wins, and the audit copy's key beside it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.app.settings import GatewaySettings
from gateway.audit.api import _redis_sink
from gateway.ledger.sinks import RedisStreamExporter

REDIS = {"backend": "redis", "redis_url": "redis://10.0.0.2:6379/3", "key_prefix": "acme"}


def settings(state: dict[str, Any] | None = None, **ledger: Any) -> GatewaySettings:
    return GatewaySettings.model_validate({"state": state or {}, "ledger": ledger})


def test_memory_state_keeps_the_records_in_the_replicas_files() -> None:
    found = settings()
    assert found.ledger.stream(found.state) is None


def test_redis_state_copies_every_record_to_its_own_redis_under_its_prefix_capped() -> None:
    found = settings(REDIS)
    stream = found.ledger.stream(found.state)
    assert stream is not None
    assert (stream.url, stream.stream, stream.maxlen) == ("redis://10.0.0.2:6379/3", "acme:usage", 100_000)
    capped = settings(REDIS, shared_stream_maxlen=5_000)
    assert (capped_stream := capped.ledger.stream(capped.state)) is not None and capped_stream.maxlen == 5_000


def test_the_default_stream_can_be_turned_off_and_a_configured_one_wins() -> None:
    off = settings(REDIS, shared_stream=False)
    assert off.ledger.stream(off.state) is None
    own = settings(REDIS, redis_stream={"url": "redis://other:6379/0", "stream": "usage", "maxlen": 10})
    stream = own.ledger.stream(own.state)
    assert stream is not None and (stream.url, stream.stream, stream.maxlen) == ("redis://other:6379/0", "usage", 10)
    elsewhere = settings(None, redis_stream={"url": "redis://other:6379/0"})  # no shared state, a stream all the same
    assert elsewhere.ledger.stream(elsewhere.state) is not None


def audit_stream(found: GatewaySettings) -> str | None:
    app = web.Application()
    app[appkeys.SETTINGS] = found
    sink = _redis_sink(app)
    if sink is None:
        return None
    assert isinstance(sink, RedisStreamExporter)
    sink.close_sync()  # nothing was sent: no connection was made
    return sink.config.stream


def test_the_audit_copy_goes_beside_it_under_the_same_prefix() -> None:
    assert audit_stream(settings()) is None
    assert audit_stream(settings(REDIS)) == "acme:audit"
    assert audit_stream(settings(REDIS, audit={"redis_stream": "audit-log"})) == "audit-log"
    configured = settings(REDIS, redis_stream={"url": "redis://other:6379/0"})
    assert audit_stream(configured) == "tokenway:audit"  # a configured stream keeps the key it always had
