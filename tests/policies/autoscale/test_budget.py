"""Sharing device slots between pools: priority, minimums, cold starts taking the LRU's place."""

from __future__ import annotations

from policies.autoscale.budget import Claim, share_budget
from policies.autoscale.forecast import Forecast
from policies.autoscale.types import NEVER, PoolPlan, PoolSignals, RolePlan


def claim(
    pool: str,
    current: int,
    wanted: int,
    *,
    priority: int = 0,
    group: str = "auto",
    held: int = 0,
    last_request: float = NEVER,
    inflight: int = 0,
    awake_since: float = NEVER,
    minimum: int = 0,
    min_awake_s: float = 0.0,
    per_replica: int = 1,
    maximum: int | None = None,
) -> Claim:
    plan = PoolPlan(pool, (RolePlan("both", current, float(wanted), wanted, wanted),), "why")
    signals = PoolSignals(
        pool,
        100.0,
        Forecast(),
        Forecast(),
        (),
        held=held,
        inflight=inflight,
        last_request_s=last_request,
        device_group=group,
        awake_since_s=awake_since,
        devices_per_replica=per_replica,
    )
    maximums = None if maximum is None else {"both": maximum}
    return Claim(plan, signals, priority, {"both": minimum}, min_awake_s, maximums)


def desired(plans: list[PoolPlan]) -> dict[str, int]:
    return {p.pool: p.desired for p in plans}


def test_everyone_fits() -> None:
    plans = share_budget([claim("a", 1, 3), claim("b", 2, 2)], {"auto": 8})
    assert desired(plans) == {"a": 3, "b": 2}
    assert "device budget" not in plans[0].reason


def test_higher_priority_grows_into_a_lower_ones_devices() -> None:
    plans = share_budget([claim("low", 4, 4), claim("high", 2, 5, priority=1)], {"auto": 6})
    assert desired(plans) == {"low": 1, "high": 5}
    assert "device budget" in plans[0].reason


def test_minimums_come_first() -> None:
    plans = share_budget([claim("low", 1, 1, minimum=1), claim("high", 2, 9, priority=1)], {"auto": 6})
    assert desired(plans) == {"low": 1, "high": 5}


def test_equal_priority_keeps_incumbents_and_shares_growth() -> None:
    plans = share_budget([claim("a", 2, 6), claim("b", 2, 6)], {"auto": 6})
    assert desired(plans) == {"a": 3, "b": 3}


def test_a_held_request_takes_the_least_recently_used_place() -> None:
    shared = "devices:0"
    plans = share_budget(
        [
            claim("a", 1, 1, group=shared, last_request=50.0),
            claim("b", 1, 1, group=shared, last_request=90.0),
            claim("c", 0, 1, group=shared, held=2, last_request=100.0),
        ],
        {shared: 2},
    )
    assert desired(plans) == {"a": 0, "b": 1, "c": 1}


def test_a_just_woken_pool_keeps_its_place_while_it_serves() -> None:
    shared = "devices:0"
    busy = claim("a", 1, 1, group=shared, last_request=99.0, inflight=3, awake_since=99.5, min_awake_s=2.0)
    plans = share_budget([busy, claim("b", 0, 1, group=shared, held=1, last_request=100.0)], {shared: 1})
    assert desired(plans) == {"a": 1, "b": 0}
    later = claim("a", 1, 1, group=shared, last_request=99.0, inflight=3, awake_since=90.0, min_awake_s=2.0)
    plans = share_budget([later, claim("b", 0, 1, group=shared, held=1, last_request=100.0)], {shared: 1})
    assert desired(plans) == {"a": 0, "b": 1}


def test_replicas_of_several_devices_and_unmanaged_pools() -> None:
    plans = share_budget(
        [claim("tp2", 1, 4, per_replica=2), claim("free", 3, 7, group="")],
        {"auto": 5},
    )
    assert desired(plans) == {"tp2": 2, "free": 7}


def test_a_surge_takes_only_devices_no_other_pool_wants() -> None:
    # chat (priority 1, max 6) wants 8 in a burst; code wants 2 of the 8 devices: the surge above
    # chat's max_replicas gets what code leaves, although chat ranks higher
    plans = share_budget(
        [claim("chat", 6, 8, priority=1, maximum=6), claim("code", 1, 2)],
        {"auto": 8},
    )
    assert desired(plans) == {"chat": 6, "code": 2}
    plans = share_budget([claim("chat", 6, 8, priority=1, maximum=6), claim("code", 1, 1)], {"auto": 8})
    assert desired(plans) == {"chat": 7, "code": 1}


def test_a_running_surge_replica_yields_to_another_pools_growth() -> None:
    # chat runs 8 (2 above its max) on the 8 devices; code now wants 1: chat's incumbents count only
    # up to its max, so code's growth comes before chat's surge and one surge replica drains
    plans = share_budget([claim("chat", 8, 8, priority=1, maximum=6), claim("code", 0, 1)], {"auto": 8})
    assert desired(plans) == {"chat": 7, "code": 1}


def test_without_a_cap_growth_is_as_before() -> None:
    plans = share_budget([claim("low", 4, 4), claim("high", 2, 5, priority=1)], {"auto": 6})
    assert desired(plans) == {"low": 1, "high": 5}
