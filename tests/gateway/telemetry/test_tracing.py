"""Traces and OTLP metrics reach a real OTLP/HTTP receiver (a small aiohttp server speaking the
collector's protobuf protocol), and tracing off costs nothing but still forwards a client's
traceparent."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest

from gateway.app.settings import OtlpConfig
from gateway.request.record import RequestRecord
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import NOOP_TRACE, STAGES, Tracing
from tests.support.otlp import Receiver

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"
FIRST_TOKEN_AT_S = 1_750_000_000.25


def finished_record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        api="chat",
        started_at_unix_s=time.time(),
        tenant="acme",
        key_id="acme-k1",
        program="run-7",
        tags=("feature-x", "team:a"),
        requested_model="llama",
        model="llama-3.1-8b",
        served_model="meta-llama/Llama-3.1-8B",
        pool="llama-8b",
        endpoint="llama-8b/both-0",
        engine="vllm",
        prompt_tokens=1200,
        cached_tokens=800,
        completion_tokens=300,
        usage_source="engine",
        cost_usd=0.0012,
        ttft_s=0.12,
        tpot_s=0.011,
        duration_s=3.4,
    )


def walk(
    tracing: Tracing, request_id: str, headers: dict[str, str], metrics: GatewayMetrics | None = None
) -> str | None:
    """What the lifecycle does for one request; returns the traceparent forwarded upstream."""
    trace = tracing.start_request(request_id, headers, {"http.request.method": "POST", "url.path": "/v1/x"})
    with trace.span("auth") as auth:
        auth.set(key_id="acme-k1")  # stands in for authentication: its span and what it found
    with trace.span("admission", model="llama-3.1-8b") as admission:
        admission.set(decision="admitted")
    with trace.span("routing", model="llama-3.1-8b") as routing:
        routing.set(endpoint="llama-8b/both-0", reason="prefix-affinity", ignored=None)
    with trace.span("upstream", endpoint="llama-8b/both-0") as upstream:
        forwarded = trace.traceparent()
        upstream.event("first_token", {"ttft_s": 0.12}, at_unix_s=FIRST_TOKEN_AT_S)
    record = finished_record(request_id)
    with trace.span("accounting"):
        if metrics is not None:
            metrics.observe(record)  # the record sinks run inside "accounting"
    trace.end(record)
    return forwarded


def attrs(item: Any) -> dict[str, Any]:
    out = {}
    for kv in item.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


async def test_spans_and_metrics_reach_the_otlp_receiver(receiver: Receiver) -> None:
    metrics = GatewayMetrics()
    config = OtlpConfig(endpoint=receiver.url, service_name="tokenway-test", metrics_interval_s=60)
    tracing = Tracing(config, metrics=metrics)
    forwarded = walk(tracing, "req-1", {"traceparent": CLIENT_PARENT}, metrics)
    walk(tracing, "req-2", {}, metrics)
    await tracing.shutdown()  # flushes spans and pushes the metrics a last time

    spans = receiver.spans()
    by_trace: dict[bytes, list[Any]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert len(by_trace) == 2, "one trace per request"

    continued = by_trace[bytes.fromhex(CLIENT_TRACE_ID)]
    names = {s.name: s for s in continued}
    assert set(STAGES) <= set(names) and "tokenway.request" in names
    root = names["tokenway.request"]
    assert root.parent_span_id == bytes.fromhex("00f067aa0ba902b7"), "the client's span is the parent"
    for stage in STAGES:
        assert names[stage].parent_span_id == root.span_id

    root_attrs = attrs(root)
    assert root_attrs["gen_ai.request.model"] == "llama"
    assert root_attrs["gen_ai.response.model"] == "llama-3.1-8b"
    assert root_attrs["gen_ai.usage.input_tokens"] == 1200
    assert root_attrs["gen_ai.usage.output_tokens"] == 300
    assert root_attrs["gen_ai.usage.cache_read.input_tokens"] == 800
    assert root_attrs["gen_ai.provider.name"] == "vllm"
    assert root_attrs["gen_ai.operation.name"] == "chat"
    assert root_attrs["tokenway.request_id"] == "req-1"
    assert root_attrs["tokenway.tenant"] == "acme"
    assert (root_attrs["tokenway.program"], root_attrs["tokenway.tags"]) == ("run-7", "feature-x,team:a")
    assert "tokenway.user" not in root_attrs  # none named: no attribute
    assert attrs(names["routing"])["reason"] == "prefix-affinity"
    assert attrs(names["auth"])["key_id"] == "acme-k1"
    assert attrs(names["admission"]) == {"model": "llama-3.1-8b", "decision": "admitted"}
    assert "ignored" not in attrs(names["routing"])
    assert [e.name for e in names["upstream"].events] == ["first_token"]
    assert names["upstream"].events[0].time_unix_nano == int(FIRST_TOKEN_AT_S * 1e9)

    # the engine gets the same trace with the upstream span as parent
    assert forwarded == f"00-{CLIENT_TRACE_ID}-{names['upstream'].span_id.hex()}-01"

    exported = receiver.metrics_by_name()
    assert {
        "gen_ai.client.token.usage",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.server.request.duration",
        "tokenway.requests",
        "tokenway.tokens",
        "tokenway.cost",
    } <= set(exported)
    usage = {attrs(p)["gen_ai.token.type"]: p for p in exported["gen_ai.client.token.usage"].histogram.data_points}
    assert usage["output"].count == 2 and usage["output"].sum == 600
    assert attrs(usage["input"])["gen_ai.request.model"] == "llama"
    assert attrs(usage["input"])["gen_ai.provider.name"] == "vllm"
    ttft = exported["gen_ai.server.time_to_first_token"]
    assert ttft.unit == "s" and ttft.histogram.data_points[0].count == 2
    assert exported["tokenway.cost"].sum.is_monotonic
    assert exported["tokenway.cost"].sum.data_points[0].as_double == pytest.approx(0.0024)


async def test_an_exception_in_a_stage_marks_its_span(receiver: Receiver) -> None:
    tracing = Tracing(OtlpConfig(endpoint=receiver.url, metrics=False), metrics=GatewayMetrics())
    trace = tracing.start_request("req-x", {})
    with pytest.raises(ConnectionError), trace.span("upstream"):
        raise ConnectionError("refused")
    record = finished_record("req-x")
    record.status, record.error_code = "error", "upstream_error"
    trace.end(record)
    trace.end(record)  # idempotent
    await tracing.shutdown()
    spans = {s.name: s for s in receiver.spans()}
    assert spans["upstream"].status.code == 2  # STATUS_CODE_ERROR
    assert spans["tokenway.request"].status.code == 2
    assert [e.name for e in spans["upstream"].events] == ["exception"]
    assert receiver.metrics == []


async def test_unsampled_client_traces_are_not_exported_but_still_forwarded(receiver: Receiver) -> None:
    tracing = Tracing(OtlpConfig(endpoint=receiver.url, metrics=False))
    unsampled = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-00"
    forwarded = walk(tracing, "req-u", {"traceparent": unsampled})
    await tracing.shutdown()
    assert receiver.spans() == []
    assert forwarded is not None and forwarded.startswith(f"00-{CLIENT_TRACE_ID}-") and forwarded.endswith("-00")


async def test_sample_ratio_zero_exports_nothing_and_forwards_an_unsampled_context(receiver: Receiver) -> None:
    tracing = Tracing(OtlpConfig(endpoint=receiver.url, metrics=False, sample_ratio=0.0))
    forwarded = {walk(tracing, f"r{i}", {}) for i in range(20)}
    await tracing.shutdown()
    assert receiver.spans() == []
    assert len(forwarded) == 20, "a fresh trace per request"
    assert all(f is not None and re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", f) for f in forwarded)


async def test_unreachable_collector_does_not_fail_requests_or_shutdown() -> None:
    tracing = Tracing(OtlpConfig(endpoint="http://127.0.0.1:9", timeout_s=0.5, metrics=False))
    for i in range(200):
        walk(tracing, f"r{i}", {})  # export happens in the SDK's thread; nothing raises here
    await asyncio.wait_for(tracing.shutdown(timeout_s=1.0), 30)
    assert not tracing.enabled


async def test_disabled_tracing_is_a_shared_noop() -> None:
    before = set(threading.enumerate())
    tracing = Tracing(OtlpConfig(endpoint=None))
    assert not tracing.enabled
    trace = tracing.start_request("r", {"content-type": "application/json"})
    assert trace is NOOP_TRACE
    with trace.span("upstream", endpoint="e") as span:
        span.event("first_token")
    assert trace.traceparent() is None
    trace.end(finished_record("r"))
    assert not set(threading.enumerate()) - before  # no exporter, no processor, no pusher thread
    await asyncio.wait_for(tracing.shutdown(timeout_s=1.0), 5)  # nothing to flush or stop


@pytest.mark.parametrize(
    ("header", "forwarded"),
    [
        pytest.param(CLIENT_PARENT, CLIENT_PARENT, id="valid"),
        pytest.param("garbage", None, id="invalid-dropped"),
        pytest.param(f"00-{'0' * 32}-00f067aa0ba902b7-01", None, id="zero-trace-id-dropped"),
        pytest.param(f"ff-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01", None, id="version-ff-dropped"),
    ],
)
def test_disabled_tracing_passes_the_client_traceparent_through(header: str, forwarded: str | None) -> None:
    trace = Tracing().start_request("r", {"traceparent": header, "tracestate": "vendor=1"})
    assert trace.traceparent() == forwarded
    if forwarded:
        assert trace.tracestate() == "vendor=1"


def test_otlp_endpoint_is_normalised() -> None:
    assert OtlpConfig(endpoint="http://c:4318/v1/traces/").endpoint == "http://c:4318"
    assert OtlpConfig(endpoint="").endpoint is None
    with pytest.raises(ValueError, match="http"):
        OtlpConfig(endpoint="c:4318")
