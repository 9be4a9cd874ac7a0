"""The warm reserve's target on literal inputs (`policies.autoscale.budget.reserve_target`), and the
budget setting it beside each role's desired replicas."""

from __future__ import annotations

import pytest

from policies.autoscale.budget import Claim, reserve_target, share_budget
from policies.autoscale.forecast import Forecast
from policies.autoscale.types import PoolPlan, PoolSignals, RolePlan


@pytest.mark.parametrize(
    ("reserve", "high", "desired", "expected"),
    [
        pytest.param(None, 6, 2, None, id="no reserve: no bound"),
        pytest.param(1, 6, 2, 1, id="room for it"),
        pytest.param(2, 6, 5, 1, id="only one slot left under max_replicas"),
        pytest.param(1, 6, 6, 0, id="all awake: none asleep"),
        pytest.param(0, 6, 1, 0, id="a reserve of none: every scaled-down replica stops"),
        pytest.param(3, None, 9, 3, id="no max_replicas known: the reserve as asked"),
    ],
)
def test_the_reserve_fits_under_max_replicas(
    reserve: int | None, high: int | None, desired: int, expected: int | None
) -> None:
    assert reserve_target(reserve, high, desired) == expected


def test_the_budget_fits_the_reserve_beside_what_it_grants() -> None:
    signals = PoolSignals("w", 100.0, Forecast(), Forecast(), (), device_group="auto")
    plan = PoolPlan("w", (RolePlan("both", 1, 3.0, 3, 3, reserve=2),), "test")
    [granted] = share_budget([Claim(plan, signals, max_by_role={"both": 4})], {"auto": 2})
    role = granted.role("both")
    assert role is not None
    assert role.desired == 2  # two devices
    assert role.reserve == 2  # asleep beside them: max_replicas 4 leaves room for both
    [granted] = share_budget([Claim(plan, signals, max_by_role={"both": 4})], {"auto": 8})
    role = granted.role("both")
    assert role is not None
    assert (role.desired, role.reserve) == (3, 1)  # one slot left under max_replicas
