"""Which EndpointSlice addresses a pool uses: ready and not terminating, on the configured port."""

from __future__ import annotations

from typing import Any

import pytest

from backends.discovery.slices import KubernetesDiscoveryConfig, addresses_of, desired_addresses
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
