"""Bring a pool's discovered endpoints in line with the addresses Kubernetes lists now.

An address that appears becomes an endpoint in STARTING: the active health check probes it and
only a passing probe makes it READY (nothing is routed to an endpoint that has not answered). An
address that goes away, or whose pod stops being ready, becomes DRAINING: routing skips it, the
requests already on it finish, and it leaves the pool once none is left (or after
`drain_timeout_s`). An address that comes back while draining starts over from STARTING.

Endpoint ids are `<pool>/<pod name>`, the same on every gateway replica (shared routing state is
keyed by them). A pod name seen again at a new address (a StatefulSet pod rescheduled) replaces
the draining old one in the pool at once; requests in flight on the old object still finish.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from backends.config import PoolConfig
from backends.discovery.config import KubernetesDiscoveryConfig
from backends.discovery.slices import Address
from backends.fleet import Pool
from backends.topology import Topology
from backends.types import Endpoint, EndpointState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Changes:
    added: list[Endpoint] = field(default_factory=list)
    draining: list[Endpoint] = field(default_factory=list)
    removed: list[Endpoint] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.draining or self.removed)


def topology_of(address: Address, racks: Mapping[str, str | None]) -> Topology:
    """The endpoint's labels: node and zone from its slice, the rack from its node's label."""
    rack = racks.get(address.node) if address.node is not None else None
    return Topology(node=address.node, rack=rack, zone=address.zone)


def endpoint_for(
    pool: PoolConfig, address: Address, config: KubernetesDiscoveryConfig, racks: Mapping[str, str | None] = {}
) -> Endpoint:
    kv_events = None
    if config.kv_events_port is not None:
        host = f"[{address.host}]" if ":" in address.host else address.host
        kv_events = f"tcp://{host}:{config.kv_events_port}"
    return Endpoint(
        id=f"{pool.name}/{address.name}",
        pool=pool.name,
        base_url=address.url,
        engine=pool.engine,
        served_model=pool.upstream_model,
        state=EndpointState.STARTING,
        api_key=pool.api_key,
        max_model_len=pool.max_model_len,
        kv_events_endpoint=kv_events,
        state_reason="discovered: waiting for its first health check",
        topology=topology_of(address, racks),
    )


def reconcile(
    pool: Pool,
    discovered: dict[str, Endpoint],
    wanted: dict[str, Address],
    config: KubernetesDiscoveryConfig,
    racks: Mapping[str, str | None] = {},
) -> Changes:
    """Apply `wanted` (by URL) to the pool. `discovered` (URL -> endpoint) is the reconciler's own
    record of what it added, updated in place; static and launched endpoints are never touched."""
    changes = Changes()
    for url, endpoint in discovered.items():
        if url not in wanted and endpoint.state is not EndpointState.DRAINING:
            endpoint.state = EndpointState.DRAINING
            endpoint.state_reason = "draining: no longer a ready address of its EndpointSlices"
            changes.draining.append(endpoint)
            log.info("discovery: %s (%s) left; draining", endpoint.id, url)
    for url, address in wanted.items():
        current = discovered.get(url)
        if current is not None:
            current.topology = topology_of(address, racks)  # a node's rack may be learnt after its pod
            if current.state is EndpointState.DRAINING:  # back before its drain ended
                current.state = EndpointState.STARTING
                current.state_reason = "discovered again: waiting for a health check"
                changes.added.append(current)
            continue
        endpoint = endpoint_for(pool.config, address, config, racks)
        for other_url, other in list(discovered.items()):
            if other.id == endpoint.id:  # same pod, new address: the old one is gone for good
                remove(pool, discovered, other_url)
                changes.removed.append(other)
        discovered[url] = endpoint
        pool.endpoints.append(endpoint)
        changes.added.append(endpoint)
        log.info("discovery: %s appeared at %s; health-checking before use", endpoint.id, url)
    return changes


def remove(pool: Pool, discovered: dict[str, Endpoint], url: str) -> Endpoint | None:
    endpoint = discovered.pop(url, None)
    if endpoint is not None:
        endpoint.state = EndpointState.DEAD
        endpoint.state_reason = "removed: left its EndpointSlices"
        pool.endpoints[:] = [e for e in pool.endpoints if e is not endpoint]
    return endpoint
