"""A pool's LoRA memory budget in routing: an adapter that would take a replica over it is `evict`
(like a replica whose slots are all held), one that the running adapters leave no room for is `full`
(filtered out), and the router sends the adapter where it fits."""

from __future__ import annotations

import dataclasses

from backends.config import PoolConfig
from backends.fleet import MB, LoraAdapter, Pool
from backends.types import Endpoint
from policies.routing.lora import AdapterResidency, LoraAffinityScorer, LoraSlotsFilter, adapter_state
from policies.routing.pipeline import build_router
from tests.policies.routing.factories import candidate, context, endpoint, request, token_ids

BIG = LoraAdapter("big", "base", "s3://a/big", 300 * MB)
SMALL = LoraAdapter("small", "base", "s3://a/small", 100 * MB)


def _ep(name: str, running: frozenset[str] = frozenset(), max_loras: int = 8) -> Endpoint:
    e = endpoint(name)
    e.stats = dataclasses.replace(e.stats, running_loras=running, max_loras=max_loras)
    return e


def _residency(*dispatched: tuple[Endpoint, LoraAdapter]) -> AdapterResidency:
    residency = AdapterResidency()
    for e, adapter in dispatched:
        residency.record(e, adapter.name, adapter.size_bytes)
    return residency


def test_over_the_budget_is_evict_and_pinned_over_it_is_full() -> None:
    roomy = _ep("roomy")
    crowded = _ep("crowded")
    residency = _residency((crowded, BIG))  # 300 MB held there by an idle adapter
    budget = 512 * MB
    assert adapter_state(roomy, "big", residency, budget_bytes=budget, size_bytes=BIG.size_bytes) == "free"
    assert adapter_state(crowded, "small", residency, budget_bytes=budget, size_bytes=SMALL.size_bytes) == "free"
    other = LoraAdapter("other", "base", "s3://a/other", 300 * MB)
    # 300 + 300 > 512: slots are free (1 of 8) but the budget is not: it loads after an eviction
    assert adapter_state(crowded, "other", residency, budget_bytes=budget, size_bytes=other.size_bytes) == "evict"
    # without a budget, slots alone decide
    assert adapter_state(crowded, "other", residency, size_bytes=other.size_bytes) == "free"
    # the 300 MB adapter runs there now: it cannot be evicted, so there is no room at all
    running = _ep("running", running=frozenset({"big"}))
    assert adapter_state(running, "other", residency, budget_bytes=budget, size_bytes=other.size_bytes) == "full"
    # registrations the engine lists count too (they hold memory until unloaded)
    listed = _ep("listed")
    listed.loras = frozenset({"big"})
    assert adapter_state(listed, "other", residency, budget_bytes=budget, size_bytes=other.size_bytes) == "evict"


def test_scorer_and_filter_read_the_budget_from_the_context() -> None:
    free, over, pinned = _ep("free"), _ep("over"), _ep("pinned", running=frozenset({"big"}))
    residency = _residency((over, BIG), (pinned, BIG))
    other = LoraAdapter("other", "base", "s3://a/other", 300 * MB)
    ctx = context()
    ctx.adapter, ctx.residency, ctx.lora_budget_bytes = other, residency, 512 * MB
    cands = [candidate(e) for e in (free, over, pinned)]
    scores = LoraAffinityScorer().score(ctx, cands)
    assert scores[0] == 0.8 and 0.0 < scores[1] < 0.6 and scores[2] == 0.0
    assert [c.id for c in LoraSlotsFilter().filter(ctx, cands)] == ["free", "over"]
    ctx.lora_budget_bytes = None  # no budget: every replica has room in its slots
    assert LoraAffinityScorer().score(ctx, cands)[:2] == [0.8, 0.8]


def test_router_sends_an_adapter_where_the_pool_budget_has_room() -> None:
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
    eps = [_ep("e0"), _ep("e1")]
    config = PoolConfig.model_validate(
        {
            "name": "p",
            "model": "base",
            "engine": "vllm",
            "endpoints": [{"url": "http://x"}],
            "lora_memory_budget_mb": 512,
        }
    )
    p = Pool(config)
    p.endpoints.extend(eps)
    first = request(token_ids(64, start=1))
    first.use_adapter(BIG)
    decision = router.route(first, p, 1000.0)
    assert decision is not None
    router.on_dispatch(first, decision)
    other = LoraAdapter("other", "base", "s3://a/other", 300 * MB)
    second = request(token_ids(64, start=2))
    second.use_adapter(other)
    placed = router.route(second, p, 1000.0)
    assert placed is not None and placed.endpoint.id != decision.endpoint.id  # the other replica has room
