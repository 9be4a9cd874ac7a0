"""How the executor carries a warm reserve out, on literal inputs (`backends.autoscale.executor`): the
target itself is the planner's (tests/policies/autoscale/test_reserve.py)."""

from __future__ import annotations

from backends.autoscale.executor import keeps_asleep, reserve_left, reserve_step


def test_replicas_still_active_above_desired_hold_the_reserves_room() -> None:
    assert reserve_left(None, 2, 2) is None
    assert reserve_left(1, 3, 3) == 1
    assert reserve_left(1, 3, 6) == 0  # replicas still starting (or draining too slowly) count as active
    assert reserve_left(2, 3, 4) == 1
    assert reserve_left(2, 3, 1) == 2  # a scale-up blocked on devices takes nothing from it


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
