"""`discovery:` of a pool in gateway.yaml: where a pool's endpoints come from when nobody lists them.

    pools:
      - name: llama
        model: llama-3.1-8b
        engine: vllm
        discovery:
          kubernetes: {namespace: inference, service: vllm-llama, port: http}

The pool's endpoints are then the ready addresses of the EndpointSlices that match: `service` is
the shorthand for the label every slice of a Service carries (`kubernetes.io/service-name`), and
`label_selector` selects slices by the Service's own labels (the EndpointSlice controller copies
them onto its slices); give one or both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KubernetesDiscoveryConfig(_Strict):
    namespace: str | None = Field(
        default=None, description="where the slices live; default: the gateway pod's own namespace, else 'default'"
    )
    service: str | None = Field(default=None, description="the Service whose EndpointSlices to follow")
    label_selector: str | None = Field(default=None, description="a label selector over the EndpointSlices")
    port: int | str | None = Field(
        default=None,
        description="the slice port to use, by name or number; a number no slice lists is used as is; "
        "default: the slice's only port",
    )
    scheme: Literal["http", "https"] = Field(default="http", description="scheme of the discovered endpoints' URLs")
    api_server: str | None = Field(
        default=None, description="API server URL; default: in-cluster config, else the kubeconfig"
    )
    kubeconfig: str | None = Field(default=None, description="kubeconfig file outside a cluster")
    token_file: str | None = Field(default=None, description="bearer token file with `api_server`")
    watch_timeout_s: int = Field(default=300, ge=1, description="the API server ends each watch after this")
    retry_backoff_s: float = Field(default=1.0, gt=0, description="first wait after a failed list or watch")
    retry_backoff_max_s: float = Field(default=30.0, gt=0, description="the wait after failures stops doubling here")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="a vanished endpoint finishes its in-flight requests within"
    )
    max_endpoints: int = Field(default=512, ge=1, description="more addresses than this are ignored (logged)")
    kv_events_port: int | None = Field(
        default=None, ge=1, le=65535, description="ZMQ port each engine publishes KV events on (precise index)"
    )
    rack_label: str | None = Field(
        default=None,
        max_length=317,
        description="a node label naming each node's rack or NVLink domain: read once per node an endpoint runs "
        "on (needs `get` on nodes) for PD pairing's link classes; node and zone come from the slices",
    )

    @model_validator(mode="after")
    def _selects(self) -> KubernetesDiscoveryConfig:
        if not self.service and not self.label_selector:
            raise ValueError("give `service` or `label_selector` (or both)")
        return self

    @property
    def selector(self) -> str:
        """The label selector sent to the API server."""
        parts = [f"{SERVICE_NAME_LABEL}={self.service}"] if self.service else []
        if self.label_selector:
            parts.append(self.label_selector)
        return ",".join(parts)


class DiscoveryConfig(_Strict):
    kubernetes: KubernetesDiscoveryConfig = Field(description="follow a Service's EndpointSlices")
