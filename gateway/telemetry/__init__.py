"""Telemetry of the gateway: Prometheus metrics (`GatewayMetrics`) and OpenTelemetry traces and
OTLP metrics (`Tracing`). Both are built in the app factory from the `telemetry:` section."""

from gateway.app.settings import MetricLabelsConfig, MetricsConfig, OtlpConfig, TelemetryConfig
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace, Tracing

__all__ = [
    "NOOP_TRACE",
    "GatewayMetrics",
    "MetricLabelsConfig",
    "MetricsConfig",
    "OtlpConfig",
    "RequestTrace",
    "TelemetryConfig",
    "Tracing",
]
