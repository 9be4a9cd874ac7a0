"""The warm reserve's decisions on literal inputs (`backends.autoscale.reserve`)."""

from __future__ import annotations

import pytest

from backends.autoscale.reserve import keeps_asleep, reserve_step, reserve_target


@pytest.mark.parametrize(
    ("reserve", "high", "desired", "active", "expected"),
    [
        pytest.param(None, 6, 2, 2, None, id="no reserve: no bound"),
        pytest.param(1, 6, 2, 2, 1, id="room for it"),
        pytest.param(2, 6, 5, 5, 1, id="only one slot left under max_replicas"),
        pytest.param(1, 6, 6, 6, 0, id="all awake: none asleep"),
        pytest.param(1, 6, 3, 6, 0, id="replicas still starting count as active"),
        pytest.param(0, 6, 1, 1, 0, id="a reserve of none: every scaled-down replica stops"),
    ],
)
def test_the_reserve_fits_under_max_replicas(
    reserve: int | None, high: int, desired: int, active: int, expected: int | None
) -> None:
    assert reserve_target(reserve, high, desired, active) == expected


def test_short_starts_one_surplus_stops_the_rest() -> None:
    assert reserve_step(0, 2, spare_slots=1) == 1  # one at a time
    assert reserve_step(0, 2, spare_slots=0) == 0  # no spare device: the planners' replicas come first
    assert reserve_step(3, 1, spare_slots=4) == -2
    assert reserve_step(1, 1, spare_slots=4) == 0
    assert reserve_step(5, None, spare_slots=4) == 0  # unbounded: sleepers stay


def test_a_drained_replica_sleeps_only_into_the_reserve() -> None:
    assert keeps_asleep(0, 1)
    assert not keeps_asleep(1, 1)
    assert not keeps_asleep(0, 0)
    assert keeps_asleep(7, None)
