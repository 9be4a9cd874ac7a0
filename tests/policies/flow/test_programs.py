"""Program-fair queueing's pure parts: decayed attained service, its bounds, and the order it gives
a tenant's waiting requests."""

from __future__ import annotations

import pytest

from policies.flow.order import NO_PROGRAM, MemoryPrograms, Waiting, decayed, pick
from policies.loader import PolicyFileError, parse_config
from policies.policy import Policy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_attained_service_halves_every_half_life() -> None:
    clock = Clock()
    store = MemoryPrograms(now=clock)
    store.charge("t", "p", 800.0, 60.0)
    assert store.value("t", "p", 60.0) == 800.0
    clock.now += 60.0
    assert store.value("t", "p", 60.0) == 400.0
    store.charge("t", "p", 100.0, 60.0)  # decayed first, then added
    clock.now += 120.0
    assert store.value("t", "p", 60.0) == 125.0
    assert store.value("t", "p", 120.0) == 250.0  # the half-life is the tenant's, as read now
    assert decayed(10.0, -5.0, 60.0) == 10.0  # a clock that went back decays nothing


def test_corrections_never_take_service_below_zero_and_tenants_are_apart() -> None:
    store = MemoryPrograms(now=Clock())
    store.charge("t", "p", 100.0, 60.0)
    store.charge("t", "p", -300.0, 60.0)  # served less than predicted
    assert store.value("t", "p", 60.0) == 0.0
    store.charge("u", "p", 50.0, 60.0)
    assert store.value("t", "p", 60.0) == 0.0 and store.value("u", "p", 60.0) == 50.0
    assert store.value("v", "p", 60.0) == 0.0  # a tenant never charged


def test_programs_are_bounded_per_tenant_least_recently_charged_first() -> None:
    store = MemoryPrograms(max_programs=3, now=Clock())
    for name in ("a", "b", "c"):
        store.charge("t", name, 10.0, 60.0)
    store.charge("t", "a", 10.0, 60.0)  # a is recent again
    store.charge("t", "d", 10.0, 60.0)  # b, least recently charged, is forgotten
    assert store.programs("t") == 3
    assert store.value("t", "b", 60.0) == 0.0
    assert store.value("t", "a", 60.0) == 20.0 and store.value("t", "d", 60.0) == 10.0
    for i in range(100):
        store.charge("other", f"p{i}", 1.0, 60.0)
    assert store.programs("other") == 3 and store.status()["programs"] == 6


def waiting(seq: int, program: str, cost: float = 100.0, tenant: str = "t") -> tuple[Waiting, str]:
    return Waiting(seq, tenant, 2, cost), program


def test_inside_a_tenant_the_program_of_least_attained_service_goes_first() -> None:
    store = MemoryPrograms(now=Clock())
    # a 40-way program queued first, then a one-call program
    queued = [waiting(i, "wide") for i in range(1, 41)] + [waiting(41, "single")]
    program_of = {item.seq: program for item, program in queued}
    order: list[str] = []
    items = [item for item, _ in queued]
    for _ in range(4):  # four grants, each charged to its program as the queue does at dispatch

        def rank(item: Waiting) -> float:
            return store.value("t", program_of[item.seq], 60.0)

        chosen = pick([(2, {"t": items})], lambda band, tenant: 0.0, programs=lambda tenant: rank)
        assert chosen is not None
        items.remove(chosen)
        order.append(program_of[chosen.seq])
        store.charge("t", program_of[chosen.seq], chosen.cost_tokens, 60.0)
    # the wide one's first call goes (all at zero: arrival), then the single program's, before the rest
    assert order == ["wide", "single", "wide", "wide"]
    # without program fairness the single call waits behind all forty
    items = [item for item, _ in queued]
    plain = pick([(2, {"t": items})], lambda band, tenant: 0.0)
    assert plain is not None and plain.seq == 1


def test_ties_and_the_rest_of_the_order_stay_as_they_were() -> None:
    values = {"p": 10.0, "q": 10.0, NO_PROGRAM: 0.0}
    items = [Waiting(5, "t", 2, 300.0), Waiting(6, "t", 2, 100.0), Waiting(7, "t", 2, 50.0)]
    program_of = {5: "p", 6: "q", 7: "p"}

    def rank(item: Waiting) -> float:
        return values[program_of[item.seq]]

    bands = [(2, {"t": items})]
    same = lambda band, tenant: 0.0  # noqa: E731
    chosen = pick(bands, same, programs=lambda tenant: rank)
    assert chosen is not None and chosen.seq == 5  # equal service: arrival
    chosen = pick(bands, same, sjf=True, programs=lambda tenant: rank)
    assert chosen is not None and chosen.seq == 7  # equal service: least cost with shortest job first
    resumed = Waiting(-3, "t", 2, 100.0)  # a preempted stream, waiting to continue: still first
    program_of[-3] = "p"
    values["p"] = 1e9
    chosen = pick([(2, {"t": [resumed, *items]})], same, programs=lambda tenant: rank)
    assert chosen is not None and chosen.seq == -3
    # another tenant without program fairness keeps arrival order; tenants still go by counter
    other = [Waiting(1, "u", 2, 100.0), Waiting(2, "u", 2, 1.0)]
    counters = {"t": 5.0, "u": 1.0}
    chosen = pick(
        [(2, {"t": items, "u": other})],
        lambda band, tenant: counters[tenant],
        programs=lambda tenant: rank if tenant == "t" else None,
    )
    assert chosen is not None and chosen.seq == 1


def test_program_fairness_is_set_per_tenant_in_policies_yaml() -> None:
    config = parse_config("tenants:\n  agents: {program_fairness: {half_life_s: 30}}\n  plain: {}\n")
    policy = Policy(config)
    assert policy.program_half_life("agents") == 30.0
    assert policy.program_half_life("plain") is None and policy.program_half_life("unknown") is None
    assert parse_config("tenants:\n  a: {program_fairness: {}}\n").tenants["a"].program_fairness is not None
    with pytest.raises(PolicyFileError, match="half_life_s"):
        parse_config("tenants:\n  a: {program_fairness: {half_life_s: 0}}\n")
