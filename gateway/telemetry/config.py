"""The `telemetry:` section of gateway.yaml (pydantic: config only, read once at startup).

```yaml
telemetry:
  metrics:
    enabled: true            # GET /metrics
    token: ${METRICS_TOKEN}  # optional: /metrics then needs `Authorization: Bearer <token>`
    labels:
      key_id: false          # add a key_id label to token/cost counters (one series per key)
      max_values: 200        # distinct values per label before new ones fold into "other"
  otlp:
    endpoint: http://otel-collector:4318   # OTLP/HTTP base URL; null = export nothing
    service_name: tokenway
    sample_ratio: 1.0        # head sampling of new traces; a client's sampled flag is honoured
    metrics: true            # also push the GenAI metrics over OTLP
    metrics_interval_s: 15
```
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MetricLabelsConfig(_Strict):
    """Label options. Every label is bounded: values come from config (tenants, models, pools,
    endpoints) and the guard folds anything past `max_values` into "other"."""

    key_id: bool = Field(default=False, description="per-key token and cost series (bounded by the key list)")
    max_values: int = Field(default=200, ge=1, le=100_000, description="distinct values per label")


class MetricsConfig(_Strict):
    enabled: bool = True
    labels: MetricLabelsConfig = Field(default_factory=MetricLabelsConfig)
    token: str | None = Field(
        default=None, description="bearer token GET /metrics requires (it names tenants and models); use ${ENV}"
    )


class OtlpConfig(_Strict):
    endpoint: str | None = Field(default=None, description="OTLP/HTTP base URL, e.g. http://collector:4318")
    service_name: str = "tokenway"
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export (${ENV} ok)")
    timeout_s: float = Field(default=5.0, gt=0)
    metrics: bool = Field(default=True, description="export the GenAI metrics over OTLP as well")
    metrics_interval_s: float = Field(default=15.0, gt=0)
    max_queue_spans: int = Field(default=8192, ge=16, description="spans beyond this are dropped, not waited on")

    @field_validator("endpoint")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        value = value.rstrip("/")
        for suffix in ("/v1/traces", "/v1/metrics"):
            if value.endswith(suffix):
                value = value[: -len(suffix)]
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL of an OTLP/HTTP receiver, e.g. http://collector:4318")
        return value


class TelemetryConfig(_Strict):
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    otlp: OtlpConfig = Field(default_factory=OtlpConfig)
