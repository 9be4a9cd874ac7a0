"""The slot reserve: free slots counted per pool, who may take the last ones."""

from __future__ import annotations

from backends.types import Endpoint, EndpointState, EndpointStats
from policies.flow.saturation import (
    Active,
    ReserveSize,
    clear_lane,
    clear_of_prefill,
    describe,
    free_slots,
    heavier_than_another,
    may_take,
    reserve_for,
    within_share,
)

NOW = 1000.0
NORMAL, LOW = 2, 3


def endpoint(
    name: str, *, inflight: int = 0, running: int = 0, waiting: int = 0, age_s: float | None = 0.1
) -> Endpoint:
    stats = EndpointStats(running=running, waiting=waiting, scraped_at_s=NOW - age_s if age_s else 0.0)
    e = Endpoint(
        id=f"p/{name}", pool="p", base_url="http://x", engine="sim", served_model="m", state=EndpointState.READY
    )
    e.stats = stats
    e.inflight.requests = inflight
    return e


def test_free_slots_take_the_larger_of_own_inflight_and_fresh_engine_counts() -> None:
    own = endpoint("a", inflight=6, running=2)  # the scrape lags what this gateway just sent
    others = endpoint("b", inflight=1, running=5, waiting=1)  # requests from elsewhere
    stale = endpoint("c", inflight=2, running=8, age_s=30.0)  # old metrics are not read
    assert free_slots([own, others, stale], 8, NOW, 2.0) == 2 + 2 + 6
    full = endpoint("d", inflight=9)
    draining = endpoint("e")
    draining.state = EndpointState.DRAINING
    assert free_slots([full, draining], 8, NOW, 2.0) == 0


def test_a_slot_freed_since_the_last_scrape_is_free_at_once() -> None:
    """The scrape still counts a request the gateway has seen end; one that began after the scrape
    and ended before the next is not subtracted twice."""
    e = endpoint("a")
    tickets = [e.inflight.begin(100) for _ in range(4)]
    e.inflight.scraped()  # the engine reported the four running
    e.stats = EndpointStats(running=4, waiting=1, scraped_at_s=NOW - 0.1)  # and one from elsewhere waiting
    assert free_slots([e], 4, NOW, 2.0) == 0
    tickets[0].end()
    tickets[0].end()  # idempotent: counted once
    assert free_slots([e], 4, NOW, 2.0) == 0  # the one waiting took its place
    tickets[1].end()
    assert free_slots([e], 4, NOW, 2.0) == 1 and e.engine_waiting() == 0
    late = e.inflight.begin(100)  # after the scrape: the scrape never counted it
    late.end()
    assert e.inflight.ended_since_scrape == 2 and free_slots([e], 4, NOW, 2.0) == 1
    e.inflight.scraped()  # the next scrape counts what runs now
    assert e.inflight.ended_since_scrape == 0


def test_a_flood_over_its_share_is_held_off_the_reserve_a_light_tenant_is_not() -> None:
    active = {"A": Active(NORMAL, 1.0, 14), "B": Active(NORMAL, 2.0, 0)}
    assert not within_share("A", NORMAL, 1.0, active)
    assert within_share("B", NORMAL, 2.0, active)
    # B up to its weighted share of the band's in-flight requests (2/3 of 15 after it), not beyond
    assert within_share("B", NORMAL, 2.0, {"A": Active(NORMAL, 1.0, 5), "B": Active(NORMAL, 2.0, 9)})
    assert not within_share("B", NORMAL, 2.0, {"A": Active(NORMAL, 1.0, 4), "B": Active(NORMAL, 2.0, 11)})


def test_a_tenant_alone_is_never_over_its_share() -> None:
    assert within_share("A", NORMAL, 1.0, {"A": Active(NORMAL, 1.0, 15)})
    assert within_share("A", NORMAL, 1.0, {})
    # a lower band's activity does not count against it
    assert within_share("A", NORMAL, 1.0, {"A": Active(NORMAL, 1.0, 15), "C": Active(LOW, 1.0, 0)})


def test_a_lower_band_never_takes_the_reserve_while_a_higher_band_is_active() -> None:
    active = {"B": Active(NORMAL, 2.0, 0), "C": Active(LOW, 1.0, 0)}
    assert not within_share("C", LOW, 1.0, active)


def test_may_take_outside_the_reserve_always() -> None:
    active = {"A": Active(NORMAL, 1.0, 14), "B": Active(NORMAL, 2.0, 0)}
    assert may_take("A", NORMAL, 1.0, active, free=3, reserve_slots=2)  # one of the unreserved slots
    assert not may_take("A", NORMAL, 1.0, active, free=2, reserve_slots=2)
    assert may_take("B", NORMAL, 2.0, active, free=1, reserve_slots=2)
    assert may_take("A", NORMAL, 1.0, active, free=1, reserve_slots=0)  # no reserve: work-conserving


def test_with_everyone_backlogged_nobody_is_left_to_keep_the_reserve_for() -> None:
    at_share = {"A": Active(NORMAL, 1.0, 4, waiting=3), "B": Active(NORMAL, 2.0, 8, waiting=5)}
    assert within_share("A", NORMAL, 1.0, at_share) and within_share("B", NORMAL, 2.0, at_share)
    # backlogged past its share: flow order decides between backlogged tenants
    b_over = {"A": Active(NORMAL, 1.0, 2, waiting=3), "B": Active(NORMAL, 2.0, 10, waiting=4)}
    assert within_share("A", NORMAL, 1.0, b_over)


def test_a_light_tenants_requests_waiting_within_its_share_keep_the_reserve() -> None:
    # B's request just arrived and waits for the room's next round (the flood waits too): the reserve
    # is kept for it, so the flood's request does not take the slot an instant before B takes the next
    b_arrived = {"A": Active(NORMAL, 1.0, 10, waiting=3), "B": Active(NORMAL, 2.0, 2, waiting=1)}
    assert not within_share("A", NORMAL, 1.0, b_arrived)
    assert within_share("B", NORMAL, 2.0, b_arrived)
    # a burst of a few, still within B's share of what is in flight (3 + 4 of 12 + 4, weight 2 of 3)
    b_burst = {"A": Active(NORMAL, 1.0, 9, waiting=3), "B": Active(NORMAL, 2.0, 3, waiting=4)}
    assert not within_share("A", NORMAL, 1.0, b_burst)
    assert not may_take("A", NORMAL, 1.0, b_burst, free=4, reserve_slots=4)


def test_a_lower_band_uses_the_reserve_only_once_the_band_above_is_all_backlogged() -> None:
    at_share = {"A": Active(NORMAL, 1.0, 4, waiting=3), "B": Active(NORMAL, 2.0, 8, waiting=5)}
    # a lower band may use it once the band above is all backlogged, not before
    assert within_share("C", LOW, 1.0, {**at_share, "C": Active(LOW, 1.0, 0, waiting=2)})
    resting = {"A": Active(NORMAL, 1.0, 12, waiting=0), "C": Active(LOW, 1.0, 0, waiting=2)}
    assert not within_share("C", LOW, 1.0, resting)  # kept for A's next request


def test_a_fixed_reserve_keeps_its_slots_whatever_the_demand() -> None:
    active = {"A": Active(NORMAL, 1.0, 10, waiting=30, peak=40), "B": Active(NORMAL, 2.0, 1, peak=9)}
    assert reserve_for("A", NORMAL, active, ReserveSize(4)) == 4
    assert reserve_for("A", NORMAL, active, ReserveSize(4, max_slots=4)) == 4  # max not above min: fixed
    assert not ReserveSize(0).enabled and ReserveSize(0, max_slots=6).enabled


def test_a_sized_reserve_keeps_the_recent_headroom_of_those_it_is_kept_for_plus_the_margin() -> None:
    size = ReserveSize(2, max_slots=10, margin=1)
    # B held 9 at once lately and holds 3: six more may come, plus one
    active = {"A": Active(NORMAL, 1.0, 10, waiting=30, peak=40), "B": Active(NORMAL, 2.0, 3, peak=9)}
    assert reserve_for("A", NORMAL, active, size) == 7
    # at its peak only the margin is kept, never less than reserve_slots
    assert reserve_for("A", NORMAL, {**active, "B": Active(NORMAL, 2.0, 9, peak=9)}, size) == 2
    # a burst beyond anything recent is bounded by reserve_max_slots
    assert reserve_for("A", NORMAL, {**active, "B": Active(NORMAL, 2.0, 0, peak=30)}, size) == 10
    # light tenants add up; the requester's own headroom and a waiting tenant's do not count
    three = {**active, "D": Active(NORMAL, 1.0, 0, peak=2), "E": Active(NORMAL, 1.0, 0, waiting=1, peak=5)}
    assert reserve_for("A", NORMAL, three, size) == 9
    assert reserve_for("B", NORMAL, three, size) == 2 + 1  # A is waiting: only D's headroom is kept from B
    # a lower band's tenant is not kept for against a higher band; a higher band's is
    low = {"A": Active(NORMAL, 1.0, 10, waiting=3, peak=13), "C": Active(LOW, 1.0, 0, peak=6)}
    assert reserve_for("A", NORMAL, low, size) == 2
    assert reserve_for("C", LOW, {**low, "A": Active(NORMAL, 1.0, 2, peak=8)}, size) == 7


def test_with_a_sized_reserve_a_light_tenants_burst_finds_free_slots_the_flood_does_not() -> None:
    size = ReserveSize(1, max_slots=12, margin=1)
    active = {"A": Active(NORMAL, 1.0, 9, waiting=20, peak=29), "B": Active(NORMAL, 2.0, 2, peak=7)}
    kept = reserve_for("A", NORMAL, active, size)  # 5 + 1
    assert kept == 6
    assert not may_take("A", NORMAL, 1.0, active, free=6, reserve_slots=kept)  # a fixed 1 would have let it
    assert may_take("A", NORMAL, 1.0, active, free=7, reserve_slots=kept)
    assert may_take("B", NORMAL, 2.0, active, free=1, reserve_slots=reserve_for("B", NORMAL, active, size))


def test_endpoints_clear_of_prefill_are_those_whose_requests_all_have_their_first_token() -> None:
    prefilling = endpoint("a", inflight=3)
    prefilling.inflight.prefill_tokens = 300  # dispatched, no first token yet
    decoding = endpoint("b", inflight=5)
    assert clear_of_prefill([prefilling, decoding]) == [decoding]
    remote = endpoint("c", inflight=1)
    remote.inflight.set_remote(1, 300, 0)  # another replica's pending prefill counts too
    assert clear_of_prefill([remote]) == []


def test_the_status_of_a_sized_reserve_says_what_it_keeps_and_from_what() -> None:
    size = ReserveSize(2, max_slots=10, margin=1)
    active = {"A": Active(NORMAL, 1.0, 10, waiting=30, peak=40), "B": Active(NORMAL, 2.0, 3, peak=9)}
    shown = describe(active, size, free=5)
    assert shown["min_slots"] == 2 and shown["max_slots"] == 10 and shown["margin"] == 1 and shown["sized"]
    assert shown["free_slots"] == 5
    assert shown["kept"] == 6 + 1  # against a newcomer: B's headroom (A waits: it adds none) + margin
    a, b = shown["tenants"]["A"], shown["tenants"]["B"]
    assert (a["band"], a["inflight"], a["waiting"], a["peak"], a["headroom"]) == ("normal", 10, 30, 40, 0)
    assert a["kept_against"] == 7 and not a["within_share"]  # what the flood's next request finds kept
    assert (b["headroom"], b["kept_against"], b["within_share"]) == (6, 2, True)  # nothing kept from B


def test_the_status_of_a_fixed_reserve_keeps_its_slots_with_nobody_active() -> None:
    shown = describe({}, ReserveSize(4), free=16)
    assert shown["kept"] == 4 and not shown["sized"] and shown["tenants"] == {}


def test_a_request_over_its_share_starts_only_where_no_prefill_is_pending_and_another_lane_stays_clear() -> None:
    a, b = endpoint("a", inflight=3), endpoint("b", inflight=3)
    assert clear_lane([a, b], [a, b], 8, NOW, 2.0) == [a, b]  # either leaves the other clear
    a.inflight.prefill_tokens = 300  # a light tenant's prompt waits for its step on a
    assert clear_lane([a, b], [a, b], 8, NOW, 2.0) == []  # b would leave no endpoint clear
    a.inflight.prefill_tokens = 0
    b.inflight.requests = 8  # b clear but full: a light request could not start there
    assert clear_lane([a], [a, b], 8, NOW, 2.0) == []
    b.inflight.requests = 7
    assert clear_lane([a], [a, b], 8, NOW, 2.0) == [a]
    b.inflight.set_remote(1, 300, 0)  # another replica's pending prefill on b
    assert clear_lane([a], [a, b], 8, NOW, 2.0) == []


def test_in_a_pool_of_one_endpoint_the_lane_only_keeps_prefills_apart() -> None:
    alone = endpoint("a", inflight=2)
    assert clear_lane([alone], [alone], 8, NOW, 2.0) == [alone]
    alone.inflight.prefill_tokens = 120
    assert clear_lane([alone], [alone], 8, NOW, 2.0) == []
    draining = endpoint("b")
    draining.state = EndpointState.DRAINING  # not ready: no lane
    alone.inflight.prefill_tokens = 0
    assert clear_lane([alone], [alone, draining], 8, NOW, 2.0) == [alone]


def test_the_heavier_tenant_is_the_one_over_its_token_share_beside_one_under_it() -> None:
    assert heavier_than_another("A", {"A": 1.8, "B": 0.4})
    assert not heavier_than_another("B", {"A": 1.8, "B": 0.4})
    assert not heavier_than_another("A", {"A": 1.0})  # alone: nobody to keep the lane for
    assert not heavier_than_another("A", {})  # nothing served yet
