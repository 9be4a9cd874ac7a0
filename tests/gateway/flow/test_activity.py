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


def test_the_peak_is_the_most_in_flight_and_waiting_at_once_over_active_s() -> None:
    clock = Clock()
    activity = Activity(active_s=60.0, now=clock)
    for _ in range(3):
        activity.waiting("p", "b", NORMAL, 2.0, 1)
    for _ in range(3):  # the three go: waiting -> in flight, the demand stays 3
        activity.waiting("p", "b", NORMAL, 2.0, -1)
        activity.inflight("p", "b", NORMAL, 2.0, 1)
    activity.waiting("p", "b", NORMAL, 2.0, 1)  # a fourth at once: 4
    activity.waiting("p", "b", NORMAL, 2.0, -1)
    for _ in range(3):
        activity.inflight("p", "b", NORMAL, 2.0, -1)
    clock.now += 30.0
    activity.inflight("p", "b", NORMAL, 2.0, 1)
    seen = activity.active("p")["b"]
    assert (seen.inflight, seen.waiting, seen.peak) == (1, 0, 4)
    clock.now += 40.0  # the burst of four is older than active_s: the peak is what came since
    assert activity.active("p")["b"].peak == 1
    activity.inflight("p", "b", NORMAL, 2.0, -1)
    clock.now += 61.0
    assert activity.active("p") == {}


def test_the_other_replicas_tenants_add_to_this_ones() -> None:
    clock = Clock()
    activity = Activity(active_s=60.0, now=clock)
    activity.inflight("p", "b", NORMAL, 2.0, 1)
    activity.waiting("p", "a", NORMAL, 1.0, 1)
    assert activity.report() == [("p", "a", NORMAL, 1.0, 0, 1, 1, 0), ("p", "b", NORMAL, 2.0, 1, 0, 1, 0)]
    activity.set_remote(
        "gw1",
        [("p", "b", NORMAL, 2.0, 2, 1, 4, 0), ("p", "c", 3, 1.0, 0, 0, 2, 0), ("q", "b", 2, 2.0, 5, 0, 5, 0)],
    )
    merged = activity.active("p")
    assert (merged["b"].inflight, merged["b"].waiting, merged["b"].peak) == (3, 1, 5)
    assert merged["c"].band == 3 and merged["a"].waiting == 1
    assert activity.report()[0][0] == "p" and len(activity.report()) == 2  # only its own go out again
    activity.set_remote("gw1", [])  # a report replaces the last one
    assert set(activity.active("p")) == {"a", "b"} and activity.active("q") == {}
    activity.set_remote("gw1", [("p", "c", 3, 1.0, 1, 0, 1, 0)])
    activity.set_remote("gw2", [("p", "c", 3, 1.0, 2, 0, 2, 0)])
    assert activity.active("p")["c"].inflight == 3
    activity.drop_remote("gw1")
    assert activity.active("p")["c"].inflight == 2
    activity.drop_remote()
    assert "c" not in activity.active("p")


def test_the_report_is_rebuilt_on_a_change_or_after_a_peak_bucket_not_every_publish() -> None:
    now = [100.0]
    activity = Activity(active_s=60.0, now=lambda: now[0])
    activity.inflight("p", "A", 2, 1.0, +1)
    first = activity.report()
    assert activity.report() is first  # nothing changed: the bus's next tick reuses it
    activity.inflight("p", "A", 2, 1.0, +1)
    second = activity.report()
    assert second is not first and second[0][4] == 2
    now[0] += 60.0 / 12  # a peak bucket later: rebuilt (peaks age and idle tenants expire with time)
    assert activity.report() is not second


def test_a_slot_cut_for_a_tenant_is_kept_for_it_until_taken_or_lapsed_on_every_replica() -> None:
    clock = Clock()
    activity = Activity(active_s=60.0, claim_s=1.0, now=clock)
    assert not activity.claimed_by_other("p", "a")
    activity.claim("p", "b", NORMAL, 2.0)
    activity.claim("p", "b", NORMAL, 2.0)
    assert activity.claimed_by_other("p", "a") and not activity.claimed_by_other("p", "b")
    assert not activity.claimed_by_other("q", "a")  # another pool's slots are not held
    assert activity.report() == [("p", "b", NORMAL, 2.0, 0, 0, 0, 2)]  # the peers learn of it
    activity.take_claim("p", "b")
    assert activity.active("p")["b"].claimed == 1 and activity.claimed_by_other("p", "a")
    activity.take_claim("p", "b")
    assert not activity.claimed_by_other("p", "a")
    activity.claim("p", "b", NORMAL, 2.0)
    clock.now += 1.5  # the engine freed the slot late, or the request left: the claim lapses
    assert not activity.claimed_by_other("p", "a") and activity.report()[0][7] == 0
    # a peer's claim holds this replica's other tenants back until the peer's next report drops it
    activity.set_remote("gw1", [("p", "c", NORMAL, 1.0, 1, 0, 1, 1)])
    assert activity.claimed_by_other("p", "a") and not activity.claimed_by_other("p", "c")
    assert activity.active("p")["c"].claimed == 1
    activity.set_remote("gw1", [("p", "c", NORMAL, 1.0, 2, 0, 2, 0)])
    assert not activity.claimed_by_other("p", "a")
    activity.set_remote("gw1", [("p", "c", NORMAL, 1.0, 1, 0, 1, 1)])
    activity.drop_remote("gw1")
    assert not activity.claimed_by_other("p", "a")
