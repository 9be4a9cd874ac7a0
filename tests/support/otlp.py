"""A small OTLP/HTTP receiver (the collector's protobuf protocol) for tests: traces and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

# aiohttp and the OTLP messages are imported by the fixture: tests/conftest.py registers it in every
# pytest process (pytest-xdist's controller too), and most never start a receiver.
if TYPE_CHECKING:
    from aiohttp import web
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class Receiver:
    url: str
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.traces
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def metrics_by_name(self) -> dict[str, Any]:
        """The last export of each metric (cumulative, so the last one holds the totals)."""
        return {
            metric.name: metric
            for request in self.metrics
            for resource_metrics in request.resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
        }


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    from aiohttp import web
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    found = Receiver(url="")

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        found.traces.append(message)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def metrics(request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest()
        message.ParseFromString(await request.read())
        found.metrics.append(message)
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    found.url = f"http://127.0.0.1:{port}"
    yield found
    await runner.cleanup()
