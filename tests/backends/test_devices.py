"""Device allocation: explicit lists, auto from the inventory, no overlaps, errors naming the pool."""

from __future__ import annotations

import re

import pytest

from backends.plan import DeviceRequest, allocate_devices, detect_devices, parse_npu_smi, parse_nvidia_smi
from backends.types import PlanError


def req(pool: str, replicas: int, per_replica: int, devices: tuple[int, ...] | None = None) -> DeviceRequest:
    return DeviceRequest(pool, replicas, per_replica, devices, f"TP {per_replica} x PP 1")


@pytest.mark.parametrize(
    ("requests", "inventory", "expected"),
    [
        ([req("a", 4, 1)], (0, 1, 2, 3), {"a": [(0,), (1,), (2,), (3,)]}),
        ([req("a", 2, 4)], tuple(range(8)), {"a": [(0, 1, 2, 3), (4, 5, 6, 7)]}),
        ([req("a", 1, 2), req("b", 1, 2, (0, 1))], (0, 1, 2, 3), {"a": [(2, 3)], "b": [(0, 1)]}),
        ([req("a", 2, 1, (3, 1)), req("b", 1, 1)], (0, 1, 2, 3), {"a": [(3,), (1,)], "b": [(0,)]}),
        ([req("a", 1, 2, (6, 7))], None, {"a": [(6, 7)]}),
        ([], None, {}),
    ],
    ids=["four-replicas", "two-tp4", "explicit-claimed-first", "explicit-order-kept", "unknown-inventory-ok",
         "nothing"],
)  # fmt: skip
def test_allocation(
    requests: list[DeviceRequest], inventory: tuple[int, ...] | None, expected: dict[str, list[tuple[int, ...]]]
) -> None:
    result = allocate_devices(requests, inventory)
    assert result == expected
    given = [d for chunks in result.values() for chunk in chunks for d in chunk]
    assert len(given) == len(set(given))  # never one device to two replicas


@pytest.mark.parametrize(
    ("requests", "inventory", "message"),
    [
        ([req("big", 3, 4)], tuple(range(8)), "pool 'big': needs 12 devices (3 replicas x 4 per replica, "
                                              "TP 4 x PP 1) but only 8 of the host's 8 are free"),
        ([req("a", 1, 2, (0, 1)), req("b", 1, 4)], (0, 1, 2, 3), "pool 'b': needs 4 devices"),
        ([req("a", 1, 1, (0,)), req("b", 1, 1, (0,))], (0, 1), "pool 'b': device 0 is already given to pool 'a'"),
        ([req("a", 2, 1, (0,))], (0, 1), "pool 'a': lists 1 devices [0] but needs 2"),
        ([req("a", 1, 2, (0, 0))], (0, 1), "pool 'a': `devices` lists a device twice"),
        ([req("a", 1, 1, (9,))], (0, 1), "pool 'a': devices [9] do not exist"),
        ([req("a", 1, 1)], None, "pool 'a': `devices: auto` but this host's devices are unknown"),
    ],
    ids=["more-than-exist", "more-than-free", "overlap", "wrong-count", "duplicate", "missing", "unknown"],
)  # fmt: skip
def test_errors_name_the_pool(requests: list[DeviceRequest], inventory: tuple[int, ...] | None, message: str) -> None:
    with pytest.raises(PlanError, match=re.escape(message)):
        allocate_devices(requests, inventory)


def test_parse_nvidia_smi() -> None:
    assert parse_nvidia_smi("0\n1\n2\n3\n") == (0, 1, 2, 3)
    assert parse_nvidia_smi("No devices were found\n") == ()


def test_parse_npu_smi() -> None:
    text = """
        Total Count                    : 2

        NPU ID                         : 0
        Product Name                   : IT21HMDB02-B2
        Serial Number                  : 033VNY10M9000001

        NPU ID                         : 1
        Product Name                   : IT21HMDB02-B2
    """
    assert parse_npu_smi(text) == (0, 1)


def test_detect_devices_uses_the_tool_and_handles_absence() -> None:
    calls: list[list[str]] = []

    def fake(argv: list[str]) -> str | None:
        calls.append(argv)
        return "0\n1\n"

    assert detect_devices("nvidia-smi", fake) == (0, 1)
    assert calls == [["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]]
    assert detect_devices("nvidia-smi", lambda argv: None) is None
    assert detect_devices("unknown-tool", fake) is None
