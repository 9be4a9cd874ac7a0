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

Pure functions, no client: `decode_slice` is the one validating read of what the API server sent
(the watch thread calls it where the object arrives). An address is used when its slice's endpoint
is `ready` (the pod passes its readiness probe; `ready` unset counts, anything but a boolean does
not) and not `terminating`; a `serving` but terminating endpoint finishes what it has but takes
nothing new (the gateway drains it). A slice without the configured port contributes nothing.

What is an address: the endpoint's first address parsed as an IP of the slice's `addressType`
(IPv4 or IPv6; FQDN slices carry none), not unspecified or multicast, written canonically, on a
port 1-65535. Pod and node names must be DNS subdomains, zones label values; a field that is not
reads as absent. A slice with more than 1,000 endpoints or 100 ports (the API's own bounds), or
whose `ports`, `endpoints` or name are of the wrong type, is refused whole. Each slice keeps at most
`max_endpoints` addresses (the lowest URLs: all that the pool's bound could pick from it), and a pod
name seen at two addresses keeps the lowest (endpoint ids are pod names).
"""

from __future__ import annotations

import ipaddress
import re
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


# What the API server sends is input: every field below is read through these checks, which never
# raise on a shape the API would not send (they answer "nothing usable" instead), so a hostile or
# broken answer costs a warning, never the watch or the task that applies it.
MAX_SLICE_ENDPOINTS = 1000  # the API's own bound on one EndpointSlice (`endpoints` maxItems)
MAX_SLICE_PORTS = 100  # likewise for `ports`
MAX_VERSION_CHARS = 128  # resourceVersions are opaque strings; etcd's are decimal integers
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # object, pod and node names
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")  # a label's value (zone, rack)
_VERSION = re.compile(r"[\x21-\x7e]{1," + str(MAX_VERSION_CHARS) + "}")


class InvalidSlice(ValueError):
    """An object the API server sent as an EndpointSlice that is not one (a field of the wrong type,
    more endpoints or ports than the API allows): refused whole, with why."""


@dataclass(frozen=True, slots=True)
class Slice:
    """One EndpointSlice as the pool uses it, decoded once where it arrives: its name and its usable
    addresses (validated, at most `max_endpoints` of them: the lowest URLs, which are all that
    `desired_addresses` could ever pick from it)."""

    name: str
    addresses: tuple[Address, ...] = ()

    @property
    def nodes(self) -> set[str]:
        return {a.node for a in self.addresses if a.node is not None}


def _name(value: object) -> str | None:
    return value if isinstance(value, str) and _DNS_SUBDOMAIN.fullmatch(value) else None


def label_value(value: object) -> str | None:
    """`value` when it is a valid label value (a zone, a rack), else None."""
    return value if isinstance(value, str) and _LABEL_VALUE.fullmatch(value) else None


def slice_name(obj: object) -> str:
    """The object's name when it has a valid one, else ""."""
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    found = _name(metadata.get("name")) if isinstance(metadata, Mapping) else None
    return found or ""


def resource_version(obj: object) -> str | None:
    """The object's resourceVersion when it is a plausible one (1-128 visible ASCII characters)."""
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    value = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return value if isinstance(value, str) and _VERSION.fullmatch(value) else None


def _valid_port(value: object) -> int | None:
    return value if type(value) is int and 0 < value < 65536 else None


def _port(obj: Mapping[str, Any], wanted: int | str | None) -> int | None:
    ports = obj.get("ports")
    if ports is None:
        ports = []
    if not isinstance(ports, list) or len(ports) > MAX_SLICE_PORTS:
        raise InvalidSlice("`ports` is not a list of at most 100")
    ports = [p for p in ports if isinstance(p, Mapping)]
    if isinstance(wanted, str):
        for p in ports:
            if p.get("name") == wanted:
                return _valid_port(p.get("port"))
        return None
    if isinstance(wanted, int):
        return wanted  # a number is the target port, listed or not
    numbered = [port for p in ports if (port := _valid_port(p.get("port"))) is not None]
    return numbered[0] if len(numbered) == 1 else None


def _address(endpoint: Mapping[str, Any], family: int, port: int, config: KubernetesDiscoveryConfig) -> Address | None:
    """The endpoint's address when it is ready, not terminating, and an IP of the slice's family."""
    conditions = endpoint.get("conditions")
    conditions = {} if conditions is None else conditions
    if not isinstance(conditions, Mapping):
        return None
    # `ready` unset means ready (the API's own reading); anything but a boolean is not read as ready;
    # terminating endpoints take nothing new
    if conditions.get("ready") not in (True, None) or conditions.get("terminating") not in (False, None):
        return None
    addresses = endpoint.get("addresses")
    if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
        return None
    try:  # all addresses of one endpoint are the same pod: the first is canonical
        ip = ipaddress.ip_address(addresses[0])
    except ValueError:
        return None
    if ip.version != family or ip.is_unspecified or ip.is_multicast:
        return None
    host = str(ip)  # the canonical spelling: one address, one URL
    netloc = f"[{host}]:{port}" if ip.version == 6 else f"{host}:{port}"
    ref = endpoint.get("targetRef")
    name = _name(ref.get("name")) if isinstance(ref, Mapping) and ref.get("kind") == "Pod" else None
    return Address(
        url=f"{config.scheme}://{netloc}",
        name=name or f"{host}:{port}",
        host=host,
        zone=label_value(endpoint.get("zone")),
        node=_name(endpoint.get("nodeName")),
    )


def decode_slice(obj: object, config: KubernetesDiscoveryConfig) -> Slice:
    """The one validating read of an EndpointSlice: its name and its ready, non-terminating
    addresses on the configured port. Raises InvalidSlice for an object no API server would send
    (no valid name, `ports` or `endpoints` not lists or beyond the API's bounds); an endpoint whose
    own fields are of the wrong type, or whose address is not an IP of the slice's family, is left
    out (so is every endpoint of an FQDN slice: deprecated, and no pod addresses)."""
    if not isinstance(obj, Mapping):
        raise InvalidSlice(f"an EndpointSlice that is a {type(obj).__name__}")
    name = slice_name(obj)
    if not name:
        raise InvalidSlice("an EndpointSlice without a valid metadata.name")
    endpoints = obj.get("endpoints")
    endpoints = [] if endpoints is None else endpoints
    if not isinstance(endpoints, list) or len(endpoints) > MAX_SLICE_ENDPOINTS:
        raise InvalidSlice(f"{name}: `endpoints` is not a list of at most {MAX_SLICE_ENDPOINTS}")
    port = _port(obj, config.port)
    family = {"IPv4": 4, "IPv6": 6}.get(obj.get("addressType"))  # type: ignore[arg-type]
    if port is None or family is None:
        return Slice(name)
    found: dict[str, Address] = {}
    for endpoint in endpoints:
        address = _address(endpoint, family, port, config) if isinstance(endpoint, Mapping) else None
        if address is not None:
            found.setdefault(address.url, address)
    kept = sorted(found)[: config.max_endpoints]
    return Slice(name, tuple(found[url] for url in kept))


def addresses_of(obj: Mapping[str, Any], config: KubernetesDiscoveryConfig) -> list[Address]:
    """The ready, non-terminating addresses of one EndpointSlice on the configured port (none for an
    object that is not a valid slice)."""
    try:
        return list(decode_slice(obj, config).addresses)
    except InvalidSlice:
        return []


def node_names(obj: Mapping[str, Any] | Slice) -> set[str]:
    """The nodes an EndpointSlice's usable endpoints run on (`nodeName`)."""
    if isinstance(obj, Slice):
        return obj.nodes
    names = set()
    for endpoint in obj.get("endpoints") or [] if isinstance(obj.get("endpoints"), list) else []:
        node = _name(endpoint.get("nodeName")) if isinstance(endpoint, Mapping) else None
        if node is not None:
            names.add(node)
    return names


def desired_addresses(
    slices: Iterable[Slice | Mapping[str, Any]], config: KubernetesDiscoveryConfig
) -> dict[str, Address]:
    """Every usable address across the slices, by URL (a pod listed in two slices counts once; a
    pod name listed at two addresses keeps the lowest URL, as endpoint ids are pod names), at most
    `config.max_endpoints` of them (in a stable order, so every gateway replica keeps the same ones)."""
    by_url: dict[str, Address] = {}
    for obj in slices:
        for address in obj.addresses if isinstance(obj, Slice) else addresses_of(obj, config):
            by_url.setdefault(address.url, address)
    by_name: dict[str, Address] = {}
    for url in sorted(by_url):
        by_name.setdefault(by_url[url].name, by_url[url])
    kept = sorted(a.url for a in by_name.values())[: config.max_endpoints]
    return {url: by_url[url] for url in kept}


# What a watch tells the pool's discovery (plain values: no client types cross the thread).


@dataclass(frozen=True, slots=True)
class Reset:
    """A fresh list: these slices are all there is (decoded; the invalid ones left out)."""

    slices: tuple[Slice, ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class Upsert:
    slice: Slice


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
