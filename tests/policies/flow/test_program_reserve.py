"""The program slot reserve's decision: which program is over its share of its tenant, when the
reserve is kept for someone, and whether an endpoint keeps it."""

from __future__ import annotations

from policies.flow.saturation import FlowSettings, Standing, held, keeps_reserve, over_share


def test_a_wide_program_beside_small_ones_is_over_its_share_and_a_small_one_is_not() -> None:
    # one tenant: a 40-way program holding 14 of the 16 calls in flight, five smaller programs active
    wide = Standing(inflight=14, tenant_inflight=16, active=6, light_others=5)
    small = Standing(inflight=0, tenant_inflight=16, active=6, light_others=4)
    assert over_share(wide) and held(wide)
    assert not over_share(small) and not held(small)


def test_a_program_alone_in_its_tenant_or_beside_backlogged_ones_is_not_held() -> None:
    assert not held(Standing(inflight=16, tenant_inflight=16, active=1, light_others=0))
    # two wide programs, both with calls waiting: the room's order shares the slots, nothing is kept
    assert not held(Standing(inflight=8, tenant_inflight=16, active=2, light_others=0))


def test_an_equal_share_is_not_over_it() -> None:
    assert not over_share(Standing(inflight=1, tenant_inflight=3, active=2, light_others=1))  # 2 of 4
    assert over_share(Standing(inflight=2, tenant_inflight=3, active=2, light_others=1))  # 3 of 4


def test_an_endpoint_keeps_the_reserve_only_with_that_many_slots_left_after_the_request() -> None:
    assert keeps_reserve(free_slots=4, reserve_slots=3)
    assert not keeps_reserve(free_slots=3, reserve_slots=3)
    assert keeps_reserve(free_slots=1, reserve_slots=0)


def test_the_setting_is_off_by_default_and_reaches_the_pool_limits() -> None:
    assert FlowSettings().limits("p", 8).program_reserve_slots == 0
    settings = FlowSettings.model_validate(
        {"saturation": {"program_reserve_slots": 2}, "pools": {"q": {"saturation": {"program_reserve_slots": 0}}}}
    )
    assert settings.limits("p", 8).program_reserve_slots == 2
    assert settings.limits("q", 8).program_reserve_slots == 0
    assert FlowSettings.model_validate({"enabled": False}).limits("p", 8).program_reserve_slots == 0


def test_the_reserve_is_on_where_a_pool_or_the_default_keeps_slots() -> None:
    """Program counts are shared between replicas only where some pool's reserve reads them."""
    assert not FlowSettings().program_reserve_on()
    assert FlowSettings.model_validate({"saturation": {"program_reserve_slots": 2}}).program_reserve_on()
    one_pool = {"pools": {"p": {"saturation": {"program_reserve_slots": 1}}}}
    assert FlowSettings.model_validate(one_pool).program_reserve_on()
    assert not FlowSettings.model_validate({**one_pool, "enabled": False}).program_reserve_on()
