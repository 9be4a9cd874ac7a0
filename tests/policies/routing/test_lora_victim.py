"""Victim-aware adapter loads: the residency's demand estimate and LRU victim, and the `lora-affinity`
scorer sending a load where the adapter it evicts is the least likely to be asked for again soon."""

from __future__ import annotations

import dataclasses

import pytest

from backends.fleet import LoraAdapter
from backends.types import Endpoint
from policies.routing.lora import AdapterResidency, LoraAffinityScorer
from policies.routing.pipeline import build_router
from tests.policies.routing.factories import candidate, context, endpoint, pool, request, token_ids

NEW = LoraAdapter("new", "base", "s3://a/new", 64 * 1024 * 1024)


def _ep(name: str, running: frozenset[str] = frozenset(), max_loras: int = 2) -> Endpoint:
    e = endpoint(name)
    e.stats = dataclasses.replace(e.stats, running_loras=running, max_loras=max_loras)
    return e


def _hold(residency: AdapterResidency, e: Endpoint, *dispatches: tuple[str, float]) -> None:
    for adapter, at in dispatches:
        residency.record(e, adapter, now_s=at)


def test_demand_counts_dispatches_and_halves_every_half_life() -> None:
    residency = AdapterResidency(demand_half_life_s=60.0)
    e = _ep("a")
    _hold(residency, e, ("sql", 0.0), ("sql", 0.0))
    assert residency.demand("sql", 0.0) == pytest.approx(2.0)
    assert residency.demand("sql", 60.0) == pytest.approx(1.0)
    assert residency.demand("never", 60.0) == 0.0
    residency.record(e, "sql")  # no time: placed, not counted
    assert residency.demand("sql", 60.0) == pytest.approx(1.0)


def test_victim_is_the_least_recently_dispatched_idle_adapter_once_slots_are_full() -> None:
    residency = AdapterResidency()
    roomy = _ep("roomy")
    _hold(residency, roomy, ("x", 0.0))
    assert residency.victim(roomy) is None  # a slot is free: the load evicts nobody
    full = _ep("full")
    _hold(residency, full, ("x", 0.0), ("y", 1.0))
    assert residency.victim(full) == "x"
    running = _ep("running", running=frozenset({"x"}))
    _hold(residency, running, ("x", 0.0), ("y", 1.0))
    assert residency.victim(running) == "y"  # the engine never evicts an adapter in the batch


def test_scorer_prefers_the_load_that_evicts_a_cold_adapter() -> None:
    residency = AdapterResidency()
    cold_victim, hot_victim = _ep("cold-victim"), _ep("hot-victim")
    _hold(residency, cold_victim, ("tail", 0.0), ("hot-a", 99.0))
    _hold(residency, hot_victim, *[("hot-b", 90.0 + i / 10) for i in range(50)], ("tail2", 99.5))
    ctx = context()
    ctx.adapter, ctx.residency, ctx.now_s = NEW, residency, 100.0
    cands = [candidate(hot_victim), candidate(cold_victim)]
    scores = LoraAffinityScorer().score(ctx, cands)
    assert scores[1] > scores[0] > 0.0
    assert scores[1] <= LoraAffinityScorer(victim_horizon_s=0.0).score(ctx, cands)[1]
    off = LoraAffinityScorer(victim_horizon_s=0.0).score(ctx, cands)
    assert off[0] == off[1]  # off: every evicting replica alike (the load time alone)


def test_negative_horizon_is_refused() -> None:
    with pytest.raises(ValueError, match="victim_horizon_s"):
        LoraAffinityScorer(victim_horizon_s=-1.0)


def test_router_loads_a_new_adapter_where_it_evicts_the_coldest() -> None:
    router = build_router(
        {
            "prefix_index": {"mode": "off"},
            "default": {
                "filters": [{"type": "lora-slots"}],
                "scorers": [{"type": "lora-affinity", "weight": 1.0}],
                "picker": {"type": "max-score"},
            },
        }
    )
    hot_victim, cold_victim = _ep("e0"), _ep("e1")
    p = pool([hot_victim, cold_victim])
    sent: list[str] = []
    # e0 serves a popular adapter (then one more); e1 once served a one-off adapter, long ago
    plan = [(hot_victim, "popular", 90.0 + i / 10) for i in range(30)]
    plan += [(hot_victim, "other", 95.0), (cold_victim, "once", 10.0), (cold_victim, "recent", 96.0)]
    for e, name, at in sorted(plan, key=lambda step: step[2]):
        router.residency.record(e, name, now_s=at)
    for start in range(3):
        req = request(token_ids(64, start=start))
        req.use_adapter(NEW)
        decision = router.route(req, p, 100.0)
        assert decision is not None
        sent.append(decision.endpoint.id)
    assert sent == ["e1", "e1", "e1"]
