"""The waiting room's bounds: shedding lowest bands first, retry-after from the drain rate."""

from __future__ import annotations

import pytest

from policies.flow.room import DrainRate, Held, retry_after_s, shed_for

NORMAL, LOW, SHEDDABLE = 2, 3, 4


def held(*rows: tuple[int, int, str, int]) -> list[Held]:
    return [Held(*row) for row in rows]


def no_counters(band: int, tenant: str) -> float:
    return 0.0


def test_fits_without_shedding() -> None:
    assert shed_for(held((1, NORMAL, "a", 10)), no_counters, band=NORMAL, body_bytes=10, max_queued=2,
                    max_queued_bytes=100) == []  # fmt: skip


def test_lowest_band_is_shed_first_and_newest_first_inside_it() -> None:
    room = held((1, LOW, "a", 10), (2, SHEDDABLE, "b", 10), (3, SHEDDABLE, "b", 10), (4, NORMAL, "c", 10))
    assert shed_for(room, no_counters, band=NORMAL, body_bytes=10, max_queued=4, max_queued_bytes=10**6) == [3]


def test_inside_the_victim_band_the_most_served_tenant_loses_first() -> None:
    room = held((1, LOW, "light", 10), (2, LOW, "heavy", 10))
    counters = {"light": 10.0, "heavy": 900.0}
    shed = shed_for(room, lambda b, t: counters[t], band=NORMAL, body_bytes=10, max_queued=2, max_queued_bytes=10**6)
    assert shed == [2]


@pytest.mark.parametrize("band", [LOW, SHEDDABLE], ids=["same-band", "lower-band"])
def test_a_newcomer_never_displaces_its_own_band_or_a_higher_one(band: int) -> None:
    room = held((1, LOW, "a", 10), (2, NORMAL, "b", 10))
    assert shed_for(room, no_counters, band=band, body_bytes=10, max_queued=2, max_queued_bytes=10**6) is None


def test_bytes_bound_sheds_as_many_as_needed() -> None:
    room = held((1, SHEDDABLE, "a", 400), (2, SHEDDABLE, "a", 400), (3, NORMAL, "b", 100))
    assert shed_for(room, no_counters, band=NORMAL, body_bytes=700, max_queued=10, max_queued_bytes=1000) == [2, 1]
    assert shed_for(room, no_counters, band=NORMAL, body_bytes=2000, max_queued=10, max_queued_bytes=1000) is None


def test_retry_after_from_the_drain_rate() -> None:
    assert retry_after_s(9, 2.0, unknown_s=30) == 5  # (9 ahead + itself) / 2 per s
    assert retry_after_s(0, 100.0, unknown_s=30) == 1  # at least one second
    assert retry_after_s(10_000, 1.0, unknown_s=30) == 60  # at most a minute
    assert retry_after_s(3, 0.0, unknown_s=7.2) == 8  # nothing drained lately


def test_drain_rate_counts_recent_dispatches_and_decays() -> None:
    rate = DrainRate(time_constant_s=10.0)
    for i in range(200):
        rate.record(i * 0.1)  # 10 per second for 20 s
    assert rate.per_s(20.0) == pytest.approx(10.0, rel=0.15)
    assert rate.per_s(80.0) < 0.1  # a minute later hardly anything
