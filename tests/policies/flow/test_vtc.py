"""Virtual token counters: weights, the idle-return rule and cost correction, as pure functions, and
the dispatch sequence they produce when replayed."""

from __future__ import annotations

import pytest

from policies.flow import order
from policies.flow.order import MemoryCounters, Waiting, pick


def test_charge_divides_by_weight_and_correction_is_real_minus_predicted() -> None:
    assert order.charge(600, 2.0) == 300
    assert order.charge(-5, 1.0) == 0
    assert order.correction(600, 900, 3.0) == 100
    assert order.correction(600, 300, 1.0) == -300
    assert order.request_cost(prompt_tokens=1000, cached_tokens=800, output_tokens=50) == 250
    assert order.request_cost(prompt_tokens=100, cached_tokens=400, output_tokens=0) == 0


@pytest.mark.parametrize(
    ("counters", "waiting", "last_served", "floor"),
    [
        pytest.param({"a": 50.0, "b": 20.0}, ["a", "b"], 99.0, 20.0, id="least-among-the-waiting"),
        pytest.param({"a": 50.0}, [], 70.0, 70.0, id="nobody-waiting-last-served"),
        pytest.param({}, ["new"], 70.0, 0.0, id="a-waiting-tenant-without-counter-is-at-zero"),
    ],
)
def test_band_floor(counters: dict[str, float], waiting: list[str], last_served: float, floor: float) -> None:
    assert order.band_floor(counters, waiting, last_served) == floor


def test_lift_raises_to_the_floor_and_never_lowers() -> None:
    assert order.lifted(5.0, 20.0) == 20.0  # idle time earns no credit
    assert order.lifted(35.0, 20.0) == 35.0  # service received while others waited is remembered


def replay(arrivals: list[tuple[str, float]], weights: dict[str, float], slots: int) -> dict[str, float]:
    """Dispatch `slots` requests out of a backlog holding every arrival: service per tenant."""
    counters = MemoryCounters()
    waiting = [Waiting(i, tenant, 2, cost) for i, (tenant, cost) in enumerate(arrivals)]
    served: dict[str, float] = {}
    for _ in range(slots):
        by_tenant: dict[str, list[Waiting]] = {}
        for item in waiting:
            by_tenant.setdefault(item.tenant, []).append(item)
        chosen = pick([(2, by_tenant)], lambda band, tenant: counters.value("p", band, tenant))
        assert chosen is not None
        waiting.remove(chosen)
        counters.charge("p", 2, chosen.tenant, order.charge(chosen.cost_tokens, weights[chosen.tenant]), dispatch=True)
        served[chosen.tenant] = served.get(chosen.tenant, 0.0) + chosen.cost_tokens
    return served


def test_backlogged_tenants_are_served_in_the_ratio_of_their_weights() -> None:
    arrivals = [("a", 100.0)] * 300 + [("b", 100.0)] * 300
    served = replay(arrivals, {"a": 1.0, "b": 3.0}, slots=200)
    assert served["b"] / served["a"] == pytest.approx(3.0, rel=0.05)


def test_token_costs_not_request_counts_are_shared() -> None:
    """A tenant of big requests gets fewer of them: equal weights share tokens, not requests."""
    arrivals = [("big", 1000.0)] * 100 + [("small", 100.0)] * 1000
    served = replay(arrivals, {"big": 1.0, "small": 1.0}, slots=330)
    assert served["big"] == pytest.approx(served["small"], rel=0.05)


def test_a_returning_tenant_starts_at_the_band_minimum() -> None:
    counters = MemoryCounters()
    counters.charge("p", 2, "busy", 5000.0, dispatch=True)
    counters.charge("p", 2, "busy", 1000.0, dispatch=True)
    # "idle" never asked while "busy" was served 6000 tokens; it comes back while "busy" waits
    floor = order.band_floor({"busy": counters.value("p", 2, "busy")}, ["busy"], counters.last_served("p", 2))
    counters.lift("p", 2, "idle", floor)
    assert counters.value("p", 2, "idle") == counters.value("p", 2, "busy") == 6000.0
    # with nobody waiting the floor is the counter of the tenant served last (before its charge)
    assert counters.last_served("p", 2) == 5000.0


def test_cost_correction_moves_a_tenant_back_in_line() -> None:
    counters = MemoryCounters()
    counters.charge("p", 2, "a", order.charge(200, 1.0), dispatch=True)
    counters.charge("p", 2, "b", order.charge(200, 1.0), dispatch=True)
    counters.charge("p", 2, "a", order.correction(200, 2000, 1.0), dispatch=False)  # a's output ran 10x longer
    waiting = {"a": [Waiting(1, "a", 2, 200)], "b": [Waiting(2, "b", 2, 200)]}
    chosen = pick([(2, waiting)], lambda band, tenant: counters.value("p", band, tenant))
    assert chosen is not None and chosen.tenant == "b"
    assert counters.last_served("p", 2) == 0.0  # a correction is no dispatch


def test_a_held_back_refund_is_credited_but_never_below_a_returning_tenants_floor() -> None:
    assert order.credited(1000.0, -300.0, None) == 700.0  # waiting all along: the whole refund
    assert order.credited(1000.0, -300.0, 800.0) == 800.0  # coming back: not below the floor
    assert order.credited(100.0, -300.0, 800.0) == 800.0  # lifted first, the refund cannot undo the lift
    assert order.credited(2000.0, -300.0, 800.0) == 1700.0
    counters = MemoryCounters()
    counters.charge("p", 2, "a", 1000.0, dispatch=True)
    counters.charge("p", 2, "a", 500.0, dispatch=True, credit=-400.0, floor=800.0)
    assert counters.last_served("p", 2) == 800.0 and counters.value("p", 2, "a") == 1300.0
