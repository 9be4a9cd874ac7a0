"""Who is active in a pool: counts per tenant, the claim that outlasts the last request, the bound."""

from __future__ import annotations

from gateway.flow.activity import Activity

NORMAL = 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_stays_active_for_active_s_after_its_last_request() -> None:
    clock = Clock()
    activity = Activity(active_s=60.0, now=clock)
    activity.waiting("p", "b", NORMAL, 2.0, 1)
    activity.waiting("p", "b", NORMAL, 2.0, -1)
    activity.inflight("p", "b", NORMAL, 2.0, 1)
    assert activity.active("p")["b"].inflight == 1
    clock.now += 600.0
    assert "b" in activity.active("p")  # in flight: active however long it runs
    activity.inflight("p", "b", NORMAL, 2.0, -1)
    clock.now += 59.0
    assert activity.active("p")["b"].inflight == 0
    clock.now += 2.0
    assert activity.active("p") == {} and activity.active("other") == {}


def test_tenants_per_pool_are_bounded_idle_ones_first() -> None:
    clock = Clock()
    activity = Activity(active_s=60.0, max_tenants=3, now=clock)
    activity.inflight("p", "busy", NORMAL, 1.0, 1)
    for name in ("idle1", "idle2", "idle3"):
        clock.now += 1.0
        activity.waiting("p", name, NORMAL, 1.0, 1)
        activity.waiting("p", name, NORMAL, 1.0, -1)
    assert set(activity.active("p")) == {"busy", "idle2", "idle3"}
    activity.inflight("p", "x", NORMAL, 1.0, -1)  # a decrement of an unknown tenant never goes below 0
    assert activity.active("p")["x"].inflight == 0
