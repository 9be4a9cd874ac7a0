"""Which EndpointSlice addresses a pool uses: ready and not terminating, on the configured port."""

from __future__ import annotations

from typing import Any

import pytest

from backends.discovery.slices import (
    MAX_SLICE_ENDPOINTS,
    InvalidSlice,
    KubernetesDiscoveryConfig,
    addresses_of,
    decode_slice,
    desired_addresses,
)
from tests.support.fake_kube import endpoint_slice


def _cfg(**extra: Any) -> KubernetesDiscoveryConfig:
    return KubernetesDiscoveryConfig.model_validate({"service": "s", **extra})


@pytest.mark.parametrize(
    ("conditions", "used"),
    [
        ({"ready": True}, True),
        ({}, True),  # unset means ready
        ({"ready": False}, False),
        ({"ready": False, "serving": True, "terminating": True}, False),  # finishing: drained, not fed
        ({"ready": True, "terminating": True}, False),
    ],
    ids=["ready", "unset", "not-ready", "terminating-serving", "terminating-ready"],
)
def test_conditions(conditions: dict[str, bool], used: bool) -> None:
    obj = endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000)
    obj["endpoints"][0]["conditions"] = conditions
    assert bool(addresses_of(obj, _cfg(port="http"))) is used


@pytest.mark.parametrize(
    ("port", "expected"),
    [("http", 8000), ("metrics", None), (9000, 9000), (None, 8000)],
    ids=["by-name", "unknown-name", "by-number", "only-port"],
)
def test_port(port: int | str | None, expected: int | None) -> None:
    obj = endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000)
    found = addresses_of(obj, _cfg(port=port))
    assert [a.url for a in found] == ([f"http://10.0.0.1:{expected}"] if expected else [])


def test_two_ports_and_no_choice_uses_none() -> None:
    obj = endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000)
    obj["ports"].append({"name": "kv", "port": 5557})
    assert addresses_of(obj, _cfg()) == []
    assert [a.url for a in addresses_of(obj, _cfg(port="http"))] == ["http://10.0.0.1:8000"]


def test_ipv6_fqdn_names_and_scheme() -> None:
    v6 = endpoint_slice("s-1", "s", [("fd00::5", None)], port=8000)
    v6["addressType"] = "IPv6"
    [address] = addresses_of(v6, _cfg(port="http", scheme="https"))
    assert address.url == "https://[fd00::5]:8000" and address.name == "fd00::5:8000"
    fqdn = endpoint_slice("s-2", "s", [("engine.example", None)], port=8000)
    fqdn["addressType"] = "FQDN"
    assert addresses_of(fqdn, _cfg(port="http")) == []
    named = addresses_of(endpoint_slice("s-3", "s", [("10.0.0.2", "vllm-0")], port=8000), _cfg(port="http"))
    assert named[0].name == "vllm-0" and named[0].host == "10.0.0.2"


def test_desired_dedupes_and_bounds_in_a_stable_order() -> None:
    slices = [
        endpoint_slice(f"s-{i}", "s", [(f"10.0.0.{i}", f"p{i}"), ("10.0.0.1", "p1")], port=80) for i in range(1, 6)
    ]
    wanted = desired_addresses(slices, _cfg(port="http"))
    assert sorted(wanted) == [f"http://10.0.0.{i}:80" for i in range(1, 6)]
    bounded = desired_addresses(reversed(slices), _cfg(port="http", max_endpoints=2))
    assert sorted(bounded) == ["http://10.0.0.1:80", "http://10.0.0.2:80"]


def test_selector_and_validation() -> None:
    assert _cfg().selector == "kubernetes.io/service-name=s"
    both = KubernetesDiscoveryConfig.model_validate({"service": "s", "label_selector": "tier=gpu"})
    assert both.selector == "kubernetes.io/service-name=s,tier=gpu"
    with pytest.raises(ValueError, match="service"):
        KubernetesDiscoveryConfig.model_validate({"namespace": "x"})


# What the API server sends is input (bench/chaos/control_fuzz.py): each hostile shape below once
# reached the pool (an address that is not one, a string read as ready) or raised in the task that
# applies the watch's events, which then applied nothing more.


def _one(**endpoint: Any) -> dict[str, Any]:
    obj = endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000)
    obj["endpoints"][0].update(endpoint)
    return obj


@pytest.mark.parametrize(
    "address",
    ["127.0.1.1:80", "not-an-ip", "10.0.0.1/24", "0.0.0.0", "224.0.0.1", "10.0.0.1\r\nHost: x", "fd00::1", 7, None],
)
def test_an_address_that_is_not_an_ip_of_the_slices_family_is_not_used(address: object) -> None:
    assert addresses_of(_one(addresses=[address]), _cfg(port="http")) == []


@pytest.mark.parametrize("conditions", [{"ready": "false"}, {"ready": 0}, {"terminating": "true"}, ["ready"], "x"])
def test_conditions_of_another_type_are_not_read_as_ready(conditions: object) -> None:
    assert addresses_of(_one(conditions=conditions), _cfg(port="http")) == []


@pytest.mark.parametrize("port", [0, -1, 65536, 10**12, True, "8000", None, 1.5])
def test_a_port_out_of_range_or_not_a_number_is_no_port(port: object) -> None:
    obj = endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000)
    obj["ports"][0]["port"] = port
    assert addresses_of(obj, _cfg(port="http")) == [] and addresses_of(obj, _cfg()) == []


@pytest.mark.parametrize(
    "change",
    [
        {"ports": 5},
        {"ports": "http"},
        {"endpoints": 5},
        {"endpoints": {"a": 1}},
        {"metadata": []},
        {"metadata": {"name": ["s"]}},
        {"metadata": {"name": "x" * 300}},
        {"endpoints": [{"addresses": ["10.0.0.1"]}] * (MAX_SLICE_ENDPOINTS + 1)},
    ],
    ids=["ports-int", "ports-str", "endpoints-int", "endpoints-map", "metadata-list", "name-list", "name-long", "1001"],
)
def test_an_object_that_is_not_a_slice_is_refused_whole(change: dict[str, Any]) -> None:
    obj = {**endpoint_slice("s-1", "s", [("10.0.0.1", "pod")], port=8000), **change}
    with pytest.raises(InvalidSlice):
        decode_slice(obj, _cfg(port="http"))
    assert addresses_of(obj, _cfg(port="http")) == []  # and the lenient reader says nothing usable


def test_odd_fields_of_an_endpoint_leave_it_without_them() -> None:
    [address] = addresses_of(
        _one(targetRef={"kind": "Pod", "name": "bad/name"}, nodeName=["n"], zone="z" * 100), _cfg(port="http")
    )
    assert address.name == "10.0.0.1:8000" and address.node is None and address.zone is None
    [address] = addresses_of(_one(addresses=["fd00:0::5"]) | {"addressType": "IPv6"}, _cfg(port="http"))
    assert address.host == "fd00::5"  # the canonical spelling: one address, one URL


def test_a_slice_holds_at_most_max_endpoints_addresses_the_lowest() -> None:
    obj = endpoint_slice("s-1", "s", [(f"10.0.{i // 256}.{i % 256}", f"p{i}") for i in range(900)], port=80)
    found = decode_slice(obj, _cfg(port="http", max_endpoints=3))
    every = sorted(a.url for a in addresses_of(obj, _cfg(port="http", max_endpoints=900)))
    assert len(every) == 900 and [a.url for a in found.addresses] == every[:3]  # all the bound could pick


def test_one_pod_name_at_two_addresses_is_one_endpoint_at_the_lowest_url() -> None:
    """Endpoint ids are pod names: two addresses of one name made the reconciler replace one endpoint
    by the other on every event, so neither stayed long enough to pass a health check."""
    slices = [
        endpoint_slice("s-1", "s", [("10.0.0.9", "vllm-0")], port=80),
        endpoint_slice("s-2", "s", [("10.0.0.2", "vllm-0")], port=80),
    ]
    assert list(desired_addresses(slices, _cfg(port="http"))) == ["http://10.0.0.2:80"]


async def test_the_pool_holds_at_most_four_times_max_endpoints_addresses() -> None:
    """Slices are held between events to be reconciled; 10^5 valid addresses spread over many slices
    were all held. A slice that would take the pool past the bound is left out (its last version stays)."""
    from backends.config import PoolConfig
    from backends.discovery.service import HELD_PER_ENDPOINT, PoolDiscovery
    from backends.discovery.slices import Reset, Upsert
    from backends.fleet import Pool

    config = _cfg(port="http", max_endpoints=2)
    pool = Pool(PoolConfig.model_validate({"name": "p", "model": "m", "engine": "vllm",
                                           "discovery": {"kubernetes": config.model_dump()}}))  # fmt: skip
    discovery = PoolDiscovery(pool, config, lambda _: None)
    many = [
        decode_slice(endpoint_slice(f"s-{i}", "s", [(f"10.0.{i}.{j}", f"p{i}-{j}") for j in range(2)], port=80), config)
        for i in range(10)
    ]
    assert discovery._fold([Reset(tuple(many), "1")])
    assert sum(len(s.addresses) for s in discovery.slices.values()) == HELD_PER_ENDPOINT * 2
    assert discovery.refused_slices == 6 and sorted(discovery.slices) == ["s-0", "s-1", "s-2", "s-3"]
    assert not discovery._fold([Upsert(many[9])])  # refused: full
    assert discovery._fold([Upsert(decode_slice(endpoint_slice("s-0", "s", [], port=80), config))])  # emptied: dropped
    assert "s-0" not in discovery.slices and discovery._fold([Upsert(many[9])])
