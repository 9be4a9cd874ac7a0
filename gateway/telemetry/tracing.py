"""OpenTelemetry traces (and OTLP metrics) of requests, or nothing at all when no endpoint is set.

One trace per request: a SERVER root span with children for the stages the lifecycle walks through
("auth", "admission", "routing", "upstream", "accounting"), a "first_token" event on "upstream", and
GenAI semconv attributes set from the finished `RequestRecord`. An incoming W3C `traceparent` is
continued (its sampled flag decides, else `sample_ratio`), and `traceparent()` gives the header to
forward to the engine so engine spans join the same trace.

Without an OTLP endpoint no SDK object exists: `start_request` returns a shared no-op trace (or,
when the client sent a `traceparent`, a tiny pass-through that forwards it unchanged), so the cost
is one header lookup per request.

Export runs in background threads (the SDK's batch span processor; the OTLP metrics pusher, which
reads the `GatewayMetrics` families so metrics cost nothing per request); a slow or absent collector
drops spans past `max_queue_spans` and never blocks the event loop.

OTLP metrics
------------

The gateway's metrics are pushed over OTLP, read from the same families `GET /metrics` renders.

Recording each request into the OpenTelemetry SDK's instruments as well would cost about 100 µs per
request (attribute cleaning and hashing for every measurement); the lean families already hold every
count and histogram, so a thread turns them into OTLP data points every `metrics_interval_s` and
hands them to the OTLP/HTTP exporter. Per-request cost: zero.

Names follow the GenAI semconv where one exists (`gen_ai.client.token.usage`, ...; labels such as
`gen_ai_token_type` become `gen_ai.token.type`, `error_type` becomes `error.type`), otherwise
`tokenway.*`. Temporality
is cumulative from the creation of the `GatewayMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from gateway.app.settings import OtlpConfig
from gateway.request.record import RequestRecord
from gateway.telemetry import genai
from gateway.telemetry.families import CounterFamily, Family, HistogramFamily

if TYPE_CHECKING:
    from gateway.telemetry.metrics import GatewayMetrics


# ---- Traces

log = logging.getLogger("tokenway.telemetry")

AttrValue = str | bool | int | float
Headers = Mapping[str, str]

STAGES = ("auth", "admission", "routing", "upstream", "accounting")
_TRACEPARENT_RE = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class SpanScope(Protocol):
    def __enter__(self) -> SpanScope: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
    def set(self, **attrs: AttrValue | None) -> None: ...
    def event(
        self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None
    ) -> None: ...


class RequestTrace(Protocol):
    """What the lifecycle holds for one request; every method is safe to call when tracing is off."""

    def span(self, name: str, **attrs: AttrValue | None) -> SpanScope: ...
    def event(
        self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None
    ) -> None: ...
    def set(self, **attrs: AttrValue | None) -> None: ...
    def traceparent(self) -> str | None: ...
    def tracestate(self) -> str | None: ...
    def end(self, record: RequestRecord) -> None: ...


# -- disabled -------------------------------------------------------------------------------------


class _NoopScope:
    __slots__ = ()

    def __enter__(self) -> _NoopScope:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None

    def set(self, **attrs: AttrValue | None) -> None:
        return None

    def event(self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None) -> None:
        return None


_NOOP_SCOPE = _NoopScope()


class _NoopTrace:
    __slots__ = ()

    def span(self, name: str, **attrs: AttrValue | None) -> SpanScope:
        return _NOOP_SCOPE

    def event(self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None) -> None:
        return None

    def set(self, **attrs: AttrValue | None) -> None:
        return None

    def traceparent(self) -> str | None:
        return None

    def tracestate(self) -> str | None:
        return None

    def end(self, record: RequestRecord) -> None:
        return None


class _PassthroughTrace(_NoopTrace):
    """Not recorded (tracing off, or not sampled), but a trace context still reaches the engine: the
    client's unchanged, or for an unsampled new trace a fresh one with the sampled flag clear, so an
    engine that traces makes the same head-sampling decision."""

    __slots__ = ("_traceparent", "_tracestate")

    def __init__(self, traceparent: str, tracestate: str | None) -> None:
        self._traceparent = traceparent
        self._tracestate = tracestate

    def traceparent(self) -> str | None:
        return self._traceparent

    def tracestate(self) -> str | None:
        return self._tracestate


NOOP_TRACE: RequestTrace = _NoopTrace()


# -- enabled --------------------------------------------------------------------------------------


class _Scope:
    __slots__ = ("_attrs", "_name", "_span", "_trace")

    def __init__(self, trace: _RecordingTrace, name: str, attrs: dict[str, AttrValue | None]) -> None:
        self._trace = trace
        self._name = name
        self._attrs = attrs
        self._span: Any = None

    def __enter__(self) -> _Scope:
        self._span = self._trace._start_child(self._name, self._attrs)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        span = self._span
        if exc is not None and span.is_recording():
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__ if exc_type else 'error'}: {exc}"))
        self._trace._finish_child(span)

    def set(self, **attrs: AttrValue | None) -> None:
        if self._span is not None:
            self._span.set_attributes(_clean(attrs))

    def event(self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None) -> None:
        if self._span is not None:
            timestamp_ns = int(at_unix_s * 1e9) if at_unix_s is not None else None
            self._span.add_event(name, dict(attrs) if attrs else None, timestamp=timestamp_ns)


class _RecordingTrace:
    __slots__ = ("_ended", "_open", "_root", "_root_context", "_tracing")

    def __init__(self, tracing: Tracing, root: Any) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracing = tracing
        self._root = root
        self._root_context = set_span_in_context(root)
        self._open: list[Any] = []  # stage spans not yet ended, innermost last
        self._ended = False

    def span(self, name: str, **attrs: AttrValue | None) -> SpanScope:
        return _Scope(self, name, attrs)

    def _start_child(self, name: str, attrs: dict[str, AttrValue | None]) -> Any:
        from opentelemetry.trace import SpanKind, set_span_in_context

        context = set_span_in_context(self._open[-1]) if self._open else self._root_context
        kind = SpanKind.CLIENT if name == "upstream" else SpanKind.INTERNAL
        span = self._tracing._tracer.start_span(name, context=context, kind=kind, attributes=_clean(attrs))
        self._open.append(span)
        return span

    def _finish_child(self, span: Any) -> None:
        span.end()
        with contextlib.suppress(ValueError):  # already ended by end()
            self._open.remove(span)

    def _current(self) -> Any:
        return self._open[-1] if self._open else self._root

    def event(self, name: str, attrs: Mapping[str, AttrValue] | None = None, *, at_unix_s: float | None = None) -> None:
        """An event on the innermost open stage span (e.g. "first_token" during "upstream"), stamped
        now or at `at_unix_s` (wall clock) when it happened earlier."""
        timestamp_ns = int(at_unix_s * 1e9) if at_unix_s is not None else None
        self._current().add_event(name, dict(attrs) if attrs else None, timestamp=timestamp_ns)

    def set(self, **attrs: AttrValue | None) -> None:
        """Attributes on the request's root span."""
        self._root.set_attributes(_clean(attrs))

    def traceparent(self) -> str | None:
        ctx = self._current().get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def tracestate(self) -> str | None:
        state = self._current().get_span_context().trace_state
        return state.to_header() if state else None

    def end(self, record: RequestRecord) -> None:
        """Close the trace with the record's GenAI attributes. Idempotent."""
        if self._ended:
            return
        self._ended = True
        for span in reversed(self._open):
            span.end()  # a stage left open by an exception path
        self._open.clear()
        root = self._root
        if root.is_recording():
            root.set_attributes(_record_attributes(record))
            if record.status == "error":
                from opentelemetry.trace import Status, StatusCode

                root.set_status(Status(StatusCode.ERROR, record.error_code or "error"))
        root.end()


class Tracing:
    """Tracer provider and OTLP metrics pusher of one gateway, built from `telemetry.otlp`.

    `metrics`: the gateway's `GatewayMetrics`, whose families are pushed over OTLP when
    `otlp.metrics` is on. `span_exporter`/`metric_exporter` replace the OTLP/HTTP exporters (tests,
    other transports); passing a span exporter enables tracing without an endpoint.
    """

    def __init__(
        self,
        config: OtlpConfig | None = None,
        *,
        metrics: GatewayMetrics | None = None,
        span_exporter: Any = None,
        metric_exporter: Any = None,
        version: str = "dev",
    ) -> None:
        self.config = config or OtlpConfig()
        self.enabled = self.config.endpoint is not None or span_exporter is not None
        self._tracer_provider: Any = None
        self._metrics_pusher: OtlpMetricsPusher | None = None
        if self.enabled:
            self._build(span_exporter, version)
            if self.config.metrics and metrics is not None and (metric_exporter or self.config.endpoint):
                self._build_metrics(metrics, metric_exporter, version)

    def _build(self, span_exporter: Any, version: str) -> None:
        # Imported here so a gateway without OTLP never loads the SDK.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        cfg = self.config
        self._resource = Resource.create(
            {
                "service.name": cfg.service_name,
                "service.version": version,
                "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
            }
        )
        if span_exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(
                endpoint=f"{cfg.endpoint}/v1/traces", headers=dict(cfg.headers), timeout=cfg.timeout_s
            )
        self._tracer_provider = TracerProvider(
            # start_request has made the head-sampling decision; the SDK only sees sampled requests
            resource=self._resource,
            sampler=ParentBased(ALWAYS_ON),
        )
        self._tracer_provider.add_span_processor(
            BatchSpanProcessor(
                span_exporter,
                max_queue_size=cfg.max_queue_spans,
                max_export_batch_size=min(512, cfg.max_queue_spans),
                schedule_delay_millis=1000,
            )
        )
        self._tracer = self._tracer_provider.get_tracer("tokenway.gateway", version)
        self._propagator = TraceContextTextMapPropagator()

    def _build_metrics(self, metrics: GatewayMetrics, metric_exporter: Any, version: str) -> None:

        cfg = self.config
        if metric_exporter is None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            metric_exporter = OTLPMetricExporter(
                endpoint=f"{cfg.endpoint}/v1/metrics", headers=dict(cfg.headers), timeout=cfg.timeout_s
            )
        self._metrics_pusher = OtlpMetricsPusher(
            metrics.families,
            metric_exporter,
            resource=self._resource,
            start_unix_ns=metrics.created_unix_ns,
            interval_s=cfg.metrics_interval_s,
            timeout_s=cfg.timeout_s,
            scope_version=version,
        )

    # -- per request -------------------------------------------------------------------------

    def start_request(
        self,
        request_id: str,
        headers: Headers,
        attributes: Mapping[str, AttrValue | None] | None = None,
        *,
        name: str = "tokenway.request",
    ) -> RequestTrace:
        """The trace of one arriving request; `headers` may be aiohttp's case-insensitive headers.

        Head sampling happens here, before any SDK object exists: a client's traceparent decides by
        its sampled flag, a new trace by `sample_ratio`; unsampled requests cost a header lookup.
        """
        traceparent = headers.get("traceparent")
        if traceparent is not None and not _valid_traceparent(traceparent):
            traceparent = None  # W3C: an invalid header is ignored and a new trace starts
        if traceparent is not None:
            if not self.enabled or not int(traceparent[53:55], 16) & 1:
                return _PassthroughTrace(traceparent, headers.get("tracestate"))
        elif not self.enabled:
            return NOOP_TRACE
        elif self.config.sample_ratio < 1.0 and random.random() >= self.config.sample_ratio:
            fresh = f"00-{random.getrandbits(128) or 1:032x}-{random.getrandbits(64) or 1:016x}-00"
            return _PassthroughTrace(fresh, None)
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers) if traceparent is not None else None
        attrs = _clean(attributes) if attributes else {}
        attrs["tokenway.request_id"] = request_id
        root = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs)
        return _RecordingTrace(self, root)

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown_sync(self, timeout_s: float = 10.0) -> None:
        """Flush queued spans and push the metrics a last time, then stop the exporters (blocking)."""
        if self._tracer_provider is not None:
            try:
                self._tracer_provider.force_flush(int(timeout_s * 1000))
                self._tracer_provider.shutdown()
            except Exception:
                log.exception("trace export shutdown failed")
            self._tracer_provider = None
        if self._metrics_pusher is not None:
            self._metrics_pusher.shutdown(timeout_s)
            self._metrics_pusher = None
        self.enabled = False

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """`shutdown_sync` in a worker thread: the exporters' HTTP calls must not block the loop."""
        if self._tracer_provider is None and self._metrics_pusher is None:
            return
        await asyncio.to_thread(self.shutdown_sync, timeout_s)


def _valid_traceparent(value: str) -> bool:
    return (
        _TRACEPARENT_RE.fullmatch(value) is not None
        and not value.startswith("ff")
        and value[3:35] != "0" * 32
        and value[36:52] != "0" * 16
    )


def _clean(attrs: Mapping[str, AttrValue | None]) -> dict[str, AttrValue]:
    """OTel attributes without the None values the lifecycle passes for "not known yet"."""
    return {k: v if isinstance(v, str | bool | int | float) else str(v) for k, v in attrs.items() if v is not None}


def _record_attributes(r: RequestRecord) -> dict[str, AttrValue]:
    attrs: dict[str, AttrValue | None] = {
        genai.OPERATION_NAME: genai.operation_name(r.api),
        genai.PROVIDER_NAME: r.engine or None,
        genai.SYSTEM: r.engine or None,
        genai.REQUEST_MODEL: r.requested_model or None,
        genai.RESPONSE_MODEL: r.model or None,
        genai.REQUEST_STREAM: r.stream,
        genai.USAGE_INPUT_TOKENS: r.prompt_tokens,
        genai.USAGE_OUTPUT_TOKENS: r.completion_tokens,
        genai.USAGE_CACHE_READ_INPUT_TOKENS: r.cached_tokens,
        "http.response.status_code": r.http_status,
        genai.ERROR_TYPE: None if r.status == "ok" else (r.error_code or r.status),
        "tokenway.status": r.status,
        "tokenway.tenant": r.tenant or None,
        "tokenway.key_id": r.key_id or None,
        "tokenway.program": r.program,  # the agent run (bounded at intake: gateway/request/intake.py)
        "tokenway.user": r.user,  # the end user (bounded: gateway/request/intake.py)
        "tokenway.tags": ",".join(r.tags) or None,
        "tokenway.served_model": r.served_model or None,
        "tokenway.pool": r.pool or None,
        "tokenway.endpoint": r.endpoint or None,
        "tokenway.prefill_endpoint": r.prefill_endpoint or None,
        "tokenway.fallback_from": r.fallback_from,
        "tokenway.fallback_reason": r.fallback_reason,
        "tokenway.reject_reason": r.reject_reason,
        "tokenway.route_reason": r.route_reason or None,
        "tokenway.usage_source": r.usage_source,
        "tokenway.cost_usd": r.cost_usd,
        "tokenway.ttft_s": r.ttft_s,
        "tokenway.tpot_s": r.tpot_s,
        "tokenway.gateway_overhead_s": r.gateway_overhead_s,
        "tokenway.upstream_attempts": r.upstream_attempts,
    }
    return _clean(attrs)


# ---- OTLP metrics


_ATTRIBUTE_NAMES = {
    "gen_ai_operation_name": genai.OPERATION_NAME,
    "gen_ai_provider_name": genai.PROVIDER_NAME,
    "gen_ai_request_model": genai.REQUEST_MODEL,
    "gen_ai_response_model": genai.RESPONSE_MODEL,
    "gen_ai_token_type": genai.TOKEN_TYPE,
    "error_type": genai.ERROR_TYPE,
}


def attribute_name(label: str) -> str:
    """The OTel attribute name of a Prometheus label (semconv names for the GenAI ones)."""
    return _ATTRIBUTE_NAMES.get(label, label)


def build_metrics_data(
    families: Sequence[Family], resource: Any, start_unix_ns: int, now_unix_ns: int, scope_version: str = ""
) -> Any:
    """An SDK `MetricsData` (what OTLP exporters take) from lean families; empty families are left out."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Histogram,
        HistogramDataPoint,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    cumulative = AggregationTemporality.CUMULATIVE
    metrics = []
    for family in families:
        names = [attribute_name(label) for label in family.labelnames]
        data: Any
        if isinstance(family, CounterFamily):
            counter_points = [
                NumberDataPoint(dict(zip(names, labels, strict=True)), start_unix_ns, now_unix_ns, value)
                for labels, value in family.points()
            ]
            if not counter_points:
                continue
            data = Sum(counter_points, cumulative, is_monotonic=True)
        elif isinstance(family, HistogramFamily):
            histogram_points = [
                HistogramDataPoint(
                    attributes=dict(zip(names, labels, strict=True)),
                    start_time_unix_nano=start_unix_ns,
                    time_unix_nano=now_unix_ns,
                    count=sum(counts),
                    sum=total,
                    bucket_counts=counts,
                    explicit_bounds=list(family.bounds),
                    min=None,  # type: ignore[arg-type]  # not tracked; optional in OTLP
                    max=None,  # type: ignore[arg-type]
                )
                for labels, counts, total in family.points()
            ]
            if not histogram_points:
                continue
            data = Histogram(histogram_points, cumulative)
        else:  # pragma: no cover - Family is a closed union
            continue
        metrics.append(Metric(family.otel_name, family.documentation, family.unit, data))
    scope = InstrumentationScope("tokenway.gateway", scope_version)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


class OtlpMetricsPusher:
    """Exports `families` every `interval_s` from a daemon thread; `shutdown` sends a last batch."""

    def __init__(
        self,
        families: Sequence[Family],
        exporter: Any,
        *,
        resource: Any,
        start_unix_ns: int,
        interval_s: float,
        timeout_s: float,
        scope_version: str = "",
    ) -> None:
        self._families = tuple(families)
        self._exporter = exporter
        self._resource = resource
        self._start_unix_ns = start_unix_ns
        self._interval_s = interval_s
        self._timeout_ms = timeout_s * 1000.0
        self._scope_version = scope_version
        self._stop = threading.Event()
        self.exports_total = 0
        self.failures_total = 0
        self._thread = threading.Thread(target=self._run, name="otlp-metrics", daemon=True)
        self._thread.start()

    def export_now(self) -> bool:
        data = build_metrics_data(
            self._families, self._resource, self._start_unix_ns, time.time_ns(), self._scope_version
        )
        try:
            result = self._exporter.export(data, timeout_millis=self._timeout_ms)
        except Exception:
            log.exception("OTLP metrics export failed")
            result = None
        ok = getattr(result, "name", "") == "SUCCESS"
        self.exports_total += 1
        if not ok:
            self.failures_total += 1
        return ok

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.export_now()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self.export_now()
        try:
            self._exporter.shutdown()
        except Exception:
            log.exception("OTLP metrics exporter shutdown failed")
