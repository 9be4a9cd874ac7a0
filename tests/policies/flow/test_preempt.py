"""Which running stream gives its slot to a waiting request (policies/flow/saturation.py)."""

from __future__ import annotations

from policies.flow.saturation import Active, Running, victim

NORMAL, LOW, HIGH = 2, 3, 1


def test_the_most_recent_stream_of_the_tenant_furthest_over_its_share_is_cut() -> None:
    active = {"a": Active(NORMAL, 1.0, 6), "b": Active(NORMAL, 2.0, 1), "c": Active(NORMAL, 1.0, 3)}
    running = [Running(1, "a", NORMAL, 1.0), Running(2, "a", NORMAL, 5.0), Running(3, "c", NORMAL, 9.0)]
    chosen = victim("b", NORMAL, 2.0, running, active)
    assert chosen is not None and chosen.key == 2  # a holds 6 per weight, c 3: a's newest


def test_a_tenant_at_or_under_the_waiters_share_after_the_swap_is_not_cut() -> None:
    # b (weight 2) would hold 3 slots, 1.5 per weight; a holds 1 per weight: cutting a would invite
    # a to cut b back, so nobody is cut
    active = {"a": Active(NORMAL, 1.0, 1), "b": Active(NORMAL, 2.0, 2)}
    assert victim("b", NORMAL, 2.0, [Running(1, "a", NORMAL, 1.0)], active) is None
    # two equal tenants holding as much: a swap changes nothing
    active = {"a": Active(NORMAL, 1.0, 2), "b": Active(NORMAL, 1.0, 1)}
    assert victim("b", NORMAL, 1.0, [Running(1, "a", NORMAL, 1.0)], active) is None
    active = {"a": Active(NORMAL, 1.0, 3), "b": Active(NORMAL, 1.0, 1)}
    assert victim("b", NORMAL, 1.0, [Running(1, "a", NORMAL, 1.0)], active) is not None


def test_no_swap_invites_the_swap_back() -> None:
    for a_in in range(0, 8):
        for b_in in range(0, 8):
            active = {"a": Active(NORMAL, 1.0, a_in), "b": Active(NORMAL, 2.0, b_in)}
            if victim("b", NORMAL, 2.0, [Running(1, "a", NORMAL, 0.0)], active) is None:
                continue
            after = {"a": Active(NORMAL, 1.0, a_in - 1), "b": Active(NORMAL, 2.0, b_in + 1)}
            assert victim("a", NORMAL, 1.0, [Running(2, "b", NORMAL, 0.0)], after) is None, (a_in, b_in)


def test_a_lower_band_is_cut_first_and_a_higher_band_never() -> None:
    active = {"a": Active(NORMAL, 1.0, 8), "bulk": Active(LOW, 1.0, 1), "vip": Active(HIGH, 1.0, 4)}
    running = [Running(1, "a", NORMAL, 1.0), Running(2, "bulk", LOW, 0.5), Running(3, "vip", HIGH, 2.0)]
    chosen = victim("b", NORMAL, 1.0, running, active)
    assert chosen is not None and chosen.key == 2  # low goes first, whatever its share
    assert victim("b", NORMAL, 1.0, [Running(3, "vip", HIGH, 2.0)], active) is None


def test_the_waiters_own_streams_and_unknown_tenants_are_never_cut() -> None:
    active = {"b": Active(NORMAL, 1.0, 9)}
    running = [Running(1, "b", NORMAL, 1.0), Running(2, "ghost", NORMAL, 1.0)]
    assert victim("b", NORMAL, 1.0, running, active) is None


def test_a_light_tenant_under_its_token_share_cuts_a_backlogged_one_beyond_the_slot_rule() -> None:
    # b (weight 2) bursts to 11 of 16 slots: over its share of slots, so slots alone cut nobody; but
    # it received far less than its share of tokens lately and a is backlogged over its share
    active = {"a": Active(NORMAL, 1.0, 5, waiting=30), "b": Active(NORMAL, 2.0, 11)}
    running = [Running(1, "a", NORMAL, 1.0)]
    assert victim("b", NORMAL, 2.0, running, active) is None
    chosen = victim("b", NORMAL, 2.0, running, active, {"a": 2.1, "b": 0.45})
    assert chosen is not None and chosen.key == 1


def test_the_token_rule_needs_the_waiter_under_and_the_victim_backlogged_and_over() -> None:
    running = [Running(1, "a", NORMAL, 1.0)]
    backlogged = {"a": Active(NORMAL, 1.0, 5, waiting=3), "b": Active(NORMAL, 2.0, 11)}
    idle = {"a": Active(NORMAL, 1.0, 5), "b": Active(NORMAL, 2.0, 11)}
    assert victim("b", NORMAL, 2.0, running, backlogged, {"a": 0.9, "b": 1.1}) is None  # b had its share
    assert victim("b", NORMAL, 2.0, running, backlogged, {"a": 0.95, "b": 0.5}) is None  # a is not over
    assert victim("b", NORMAL, 2.0, running, idle, {"a": 2.0, "b": 0.5}) is None  # a waits for nothing
    assert victim("b", NORMAL, 2.0, running, backlogged, {"a": 2.0}) is not None  # b unserved lately
