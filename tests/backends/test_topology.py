"""Endpoint topology labels: the link class between two endpoints, and where the labels come from."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.discovery.service import endpoint_for
from backends.discovery.slices import KubernetesDiscoveryConfig, addresses_of
from backends.fleet import Fleet
from backends.types import UNKNOWN, Topology, link_class
from tests.support.fake_kube import endpoint_slice


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param(Topology("n1", "r1", "z1"), Topology("n1", "r1", "z1"), "same_node", id="same-node"),
        pytest.param(Topology("n1", "r1", "z1"), Topology("n2", "r1", "z1"), "same_rack", id="same-rack"),
        pytest.param(Topology("n1", "r1", "z1"), Topology("n2", "r2", "z1"), "cross_rack", id="cross-rack"),
        pytest.param(Topology("n1", "r1", "z1"), Topology("n2", "r1", "z2"), "cross_zone", id="zones-differ"),
        pytest.param(Topology(node="n1"), Topology(node="n2"), "cross_rack", id="racks-unknown"),
        pytest.param(Topology(rack="r1"), Topology(rack="r1"), "same_rack", id="nodes-unknown"),
        pytest.param(Topology("n1"), UNKNOWN, None, id="one-unlabelled"),
        pytest.param(UNKNOWN, UNKNOWN, None, id="both-unlabelled"),
    ],
)
def test_link_class(a: Topology, b: Topology, expected: str | None) -> None:
    assert link_class(a, b) == expected
    assert link_class(b, a) == expected


def test_static_endpoints_carry_their_labels_and_others_none() -> None:
    config = PoolConfig.model_validate(
        {
            "name": "pd",
            "model": "m",
            "endpoints": [
                {"url": "http://10.0.0.1:8000", "role": "prefill", "topology": {"node": "a", "rack": "r1"}},
                {"url": "http://10.0.0.2:8000", "role": "decode"},
            ],
        }
    )
    labelled, bare = Fleet.from_configs([config]).pools["pd"].endpoints
    assert labelled.topology == Topology(node="a", rack="r1")
    assert bare.topology == UNKNOWN


def test_a_pool_labels_its_launched_replicas() -> None:
    config = PoolConfig.model_validate(
        {"name": "pd", "model": "m", "roles": {"prefill": 1, "decode": 1}, "topology": {"node": "gw", "zone": "z"}}
    )
    assert config.topology is not None and config.topology.labels() == Topology(node="gw", zone="z")


def test_unknown_topology_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="row"):
        PoolConfig.model_validate(
            {"name": "p", "model": "m", "endpoints": [{"url": "http://e", "topology": {"row": "7"}}]}
        )


def test_discovered_endpoints_take_node_and_zone_from_the_slice() -> None:
    obj = endpoint_slice("s-1", "s", [("10.0.0.7", "vllm-0")], port=8000)
    obj["endpoints"][0].update({"nodeName": "gpu-node-3", "zone": "eu-west-1a"})
    discovery = KubernetesDiscoveryConfig.model_validate({"service": "s", "port": "http"})
    [address] = addresses_of(obj, discovery)
    pool = PoolConfig.model_validate({"name": "p", "model": "m", "engine": "vllm", "endpoints": [{"url": "http://x"}]})
    assert endpoint_for(pool, address, discovery).topology == Topology(node="gpu-node-3", zone="eu-west-1a")
    bare = addresses_of(endpoint_slice("s-2", "s", [("10.0.0.8", "vllm-1")], port=8000), discovery)
    assert endpoint_for(pool, bare[0], discovery).topology == UNKNOWN
