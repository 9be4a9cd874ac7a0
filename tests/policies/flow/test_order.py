"""The dispatch order as a pure function: bands, virtual counters, arrival, shortest job first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from policies.flow.order import BANDS, Waiting, band_rank, pick
from policies.schema import PRIORITY_VALUES

NORMAL, LOW, CRITICAL = band_rank(0), band_rank(-1), band_rank(2)


def w(seq: int, tenant: str, band: int = NORMAL, cost: float = 100.0) -> Waiting:
    return Waiting(seq, tenant, band, cost)


def rooms(*items: Waiting) -> list[tuple[int, Mapping[str, Sequence[Waiting]]]]:
    by_band: dict[int, dict[str, list[Waiting]]] = {}
    for item in sorted(items, key=lambda i: i.seq):
        by_band.setdefault(item.band, {}).setdefault(item.tenant, []).append(item)
    return list(by_band.items())


def counters(values: dict[str, float]) -> object:
    return lambda band, tenant: values.get(tenant, 0.0)


def test_bands_follow_priority_names() -> None:
    assert [band_rank(PRIORITY_VALUES[name]) for name in BANDS] == [0, 1, 2, 3, 4]
    assert band_rank(99) == 0 and band_rank(-99) == 4


@pytest.mark.parametrize(
    ("items", "values", "expected"),
    [
        pytest.param(
            [w(1, "a"), w(2, "b", CRITICAL)], {"b": 1e9}, 2, id="a-higher-band-goes-first-whatever-its-counter"
        ),
        pytest.param([w(1, "a", LOW), w(2, "b")], {}, 2, id="normal-before-low"),
        pytest.param([w(1, "a"), w(2, "b")], {"a": 500.0, "b": 100.0}, 2, id="smallest-counter-first"),
        pytest.param([w(1, "a"), w(2, "b")], {"a": 100.0, "b": 100.0}, 1, id="equal-counters-earliest-first"),
        pytest.param(
            [w(1, "a"), w(2, "a"), w(3, "b")], {"a": 100.0, "b": 100.0}, 3, id="equal-counters-fewer-waiting-first"
        ),
        pytest.param([w(1, "a"), w(2, "a"), w(3, "b")], {"a": 0.0, "b": 1.0}, 1, id="fifo-inside-a-tenant"),
    ],
)
def test_pick(items: list[Waiting], values: dict[str, float], expected: int) -> None:
    chosen = pick(rooms(*items), counters(values))  # type: ignore[arg-type]
    assert chosen is not None and chosen.seq == expected


def test_counters_are_read_per_band() -> None:
    values = {(NORMAL, "a"): 10.0, (NORMAL, "b"): 5.0, (LOW, "a"): 0.0}
    chosen = pick(rooms(w(1, "a"), w(2, "b")), lambda band, tenant: values.get((band, tenant), 0.0))
    assert chosen is not None and chosen.tenant == "b"


def test_shortest_job_first_inside_one_tenant_only() -> None:
    items = [w(1, "a", cost=900.0), w(2, "a", cost=10.0), w(3, "a", cost=10.0), w(4, "b", cost=5000.0)]
    values = {"a": 0.0, "b": 1.0}
    chosen = pick(rooms(*items), counters(values), sjf=True)  # type: ignore[arg-type]
    assert chosen is not None and chosen.seq == 2  # a's cheapest (the earlier of two equal ones)
    fifo = pick(rooms(*items), counters(values), sjf=False)  # type: ignore[arg-type]
    assert fifo is not None and fifo.seq == 1
    other = pick(rooms(*items), counters({"a": 2.0, "b": 1.0}), sjf=True)  # type: ignore[arg-type]
    assert other is not None and other.seq == 4  # SJF never overrides the counters between tenants


def test_skipped_requests_keep_their_place_and_the_next_in_order_is_offered() -> None:
    items = [w(1, "a"), w(2, "a"), w(3, "b")]
    values = {"a": 0.0, "b": 50.0}
    first = pick(rooms(*items), counters(values), skip={1})  # type: ignore[arg-type]
    assert first is not None and first.seq == 2  # a's next request, a still has the smaller counter
    then = pick(rooms(*items), counters(values), skip={1, 2})  # type: ignore[arg-type]
    assert then is not None and then.seq == 3
    assert pick(rooms(*items), counters(values), skip={1, 2, 3}) is None  # type: ignore[arg-type]
    assert pick([], counters(values)) is None  # type: ignore[arg-type]


def test_arrival_order_inside_a_band_when_fairness_is_off() -> None:
    items = [w(1, "flood"), w(2, "flood"), w(3, "light"), w(4, "low", LOW)]
    chosen = pick(rooms(*items), counters({"flood": 1e9}), fair=False)  # type: ignore[arg-type]
    assert chosen is not None and chosen.seq == 1  # priority only: bands, then arrival
