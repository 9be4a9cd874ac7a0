from __future__ import annotations

import orjson
import pytest

from gateway.ledger.writer import SCHEMA_VERSION, decode, encode
from tests.gateway.ledger.records import make_record

V1_FIELDS = {
    "v", "ts", "started", "request_id", "api", "tenant", "key_id", "requested_model", "model", "served_model",
    "fallback_from", "fallback_reason", "pool", "endpoint", "prefill_endpoint", "engine", "stream", "status",
    "http_status", "error_code", "reject_reason", "input_tokens", "cached_input_tokens", "output_tokens",
    "usage_source", "cost_usd", "ttft_s", "tpot_s", "duration_s", "gateway_overhead_s", "upstream_attempts",
    "route_reason", "pd_reason", "kv_transfer_failed",
}  # fmt: skip


def test_one_line_with_the_stable_v1_fields() -> None:
    record = make_record(3)
    line = encode(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    entry = decode(line)
    assert set(entry) == V1_FIELDS  # stable names: changing them breaks every stored file
    assert entry["v"] == SCHEMA_VERSION == 1
    assert entry["request_id"] == record.request_id
    assert entry["input_tokens"] == record.prompt_tokens
    assert entry["cached_input_tokens"] == record.cached_tokens
    assert entry["output_tokens"] == record.completion_tokens
    assert entry["ts"] == pytest.approx(record.started_at_unix_s + record.duration_s)


def test_extra_is_kept_and_unknown_types_become_strings() -> None:
    record = make_record(1)
    record.engine_metrics = {"queue_s": 0.01, "odd": object()}
    record.slo_class = "interactive"
    record.queue_ms = 812.5  # it waited in flow control
    entry = decode(encode(record))
    assert entry["extra"]["engine"]["queue_s"] == 0.01 and entry["extra"]["slo_class"] == "interactive"
    assert entry["extra"]["queue_ms"] == 812.5
    assert isinstance(entry["extra"]["engine"]["odd"], str)


def test_a_batch_lines_record_names_its_batch() -> None:
    record = make_record(2)
    record.batch_id = "batch_abc"
    assert decode(encode(record))["batch_id"] == "batch_abc"


@pytest.mark.parametrize("line", [b"[1,2]\n", b'"text"\n', b"{not json}\n"], ids=["list", "string", "garbage"])
def test_decode_rejects_what_is_not_an_object(line: bytes) -> None:
    with pytest.raises((ValueError, orjson.JSONDecodeError)):
        decode(line)
