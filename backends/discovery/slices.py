"""What a pool's discovery asks for (`discovery:` of gateway.yaml) and what the EndpointSlices it
watches mean: the addresses the pool should use, and the watch's events. Pure: no client, no fleet.

Configuration
-------------
`discovery:` of a pool in gateway.yaml: where a pool's endpoints come from when nobody lists them.

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

Slices to addresses
-------------------
EndpointSlices as the API server sends them (plain JSON dicts) -> the addresses a pool should use.

Pure functions, no client: the watch hands over raw objects and these decide. An address is used
when its slice's endpoint is `ready` (the pod passes its readiness probe) and not `terminating`;
a `serving` but terminating endpoint finishes what it has but takes nothing new (the gateway
drains it). A slice without the configured port contributes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


@dataclass(frozen=True, slots=True)
class Address:
    """One usable engine address of a pool, as discovered."""

    url: str  # "http://10.0.3.7:8000"
    name: str  # stable name for the endpoint id: the pod's name, else the address
    host: str  # the IP (for a KV-event socket on the same pod)
    zone: str | None = None  # the endpoint's `zone`: its node's topology.kubernetes.io/zone label
    node: str | None = None  # the endpoint's `nodeName`


def slice_name(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("name") or "")


def resource_version(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata") or {}
    value = metadata.get("resourceVersion")
    return str(value) if value else None


def _port(obj: Mapping[str, Any], wanted: int | str | None) -> int | None:
    ports = [p for p in obj.get("ports") or [] if isinstance(p, Mapping)]
    if isinstance(wanted, str):
        for p in ports:
            if p.get("name") == wanted and isinstance(p.get("port"), int):
                return int(p["port"])
        return None
    if isinstance(wanted, int):
        return wanted  # a number is the target port, listed or not
    numbered = [p for p in ports if isinstance(p.get("port"), int)]
    return int(numbered[0]["port"]) if len(numbered) == 1 else None


def addresses_of(obj: Mapping[str, Any], config: KubernetesDiscoveryConfig) -> list[Address]:
    """The ready, non-terminating addresses of one EndpointSlice on the configured port."""
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return []  # FQDN slices are deprecated and carry no pod addresses
    port = _port(obj, config.port)
    if port is None:
        return []
    found = []
    for endpoint in obj.get("endpoints") or []:
        if not isinstance(endpoint, Mapping):
            continue
        conditions = endpoint.get("conditions") or {}
        # `ready` unset means ready (the API's own reading); terminating endpoints take nothing new
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = [a for a in endpoint.get("addresses") or [] if isinstance(a, str) and a]
        if not addresses:
            continue
        host = addresses[0]  # all addresses of one endpoint are the same pod: the first is canonical
        ref = endpoint.get("targetRef") or {}
        name = ref.get("name") if isinstance(ref, Mapping) and ref.get("kind") == "Pod" else None
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        zone = endpoint.get("zone")
        node = endpoint.get("nodeName")
        found.append(
            Address(
                url=f"{config.scheme}://{netloc}",
                name=str(name) if name else netloc.replace("[", "").replace("]", ""),
                host=host,
                zone=str(zone) if isinstance(zone, str) else None,
                node=str(node) if isinstance(node, str) and node else None,
            )
        )
    return found


def node_names(obj: Mapping[str, Any]) -> set[str]:
    """The nodes an EndpointSlice's endpoints run on (`nodeName`)."""
    names = set()
    for endpoint in obj.get("endpoints") or []:
        if isinstance(endpoint, Mapping):
            node = endpoint.get("nodeName")
            if isinstance(node, str) and node:
                names.add(node)
    return names


def desired_addresses(slices: Iterable[Mapping[str, Any]], config: KubernetesDiscoveryConfig) -> dict[str, Address]:
    """Every usable address across the slices, by URL (a pod listed in two slices counts once),
    at most `config.max_endpoints` of them (in a stable order, so every gateway replica keeps the
    same ones)."""
    by_url: dict[str, Address] = {}
    for obj in slices:
        for address in addresses_of(obj, config):
            by_url.setdefault(address.url, address)
    if len(by_url) <= config.max_endpoints:
        return by_url
    kept = sorted(by_url)[: config.max_endpoints]
    return {url: by_url[url] for url in kept}


# What a watch tells the pool's discovery (plain values: no client types cross the thread).


@dataclass(frozen=True, slots=True)
class Reset:
    """A fresh list: these slices are all there is."""

    slices: tuple[dict[str, Any], ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class Upsert:
    slice: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Delete:
    name: str


@dataclass(frozen=True, slots=True)
class NodeRacks:
    """The rack label (`rack_label`) of nodes the slices name, read from the API server; None: unlabelled."""

    racks: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """The list or watch failed; the watch retries by itself."""

    reason: str


WatchEvent = Reset | Upsert | Delete | NodeRacks | Failure
