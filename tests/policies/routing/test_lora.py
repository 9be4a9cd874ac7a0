"""LoRA adapter affinity: the four states of a replica, the scorer's order, the slots filter, the
router's residency and the prefix keys per adapter."""

from __future__ import annotations

import dataclasses

from backends.block_hash import hash_blocks, lora_salt
from backends.fleet import LoraAdapter
from backends.types import Endpoint
from policies.routing.lora import AdapterResidency, LoraAffinityScorer, LoraSlotsFilter, adapter_state
from policies.routing.pipeline import build_router
from policies.routing.prefix_blocks import ENGINE_HASHERS
from policies.routing.prefix_precise import PrecisePrefixIndex
from tests.policies.routing.factories import candidate, context, endpoint, pool, request, token_ids

SQL = LoraAdapter("sql", "base", "s3://a/sql", 64 * 1024 * 1024)


def _ep(
    name: str, running: frozenset[str] = frozenset(), waiting: frozenset[str] = frozenset(), max_loras: int = 2
) -> Endpoint:
    e = endpoint(name)
    e.stats = dataclasses.replace(e.stats, running_loras=running, waiting_loras=waiting, max_loras=max_loras)
    return e


def test_states_from_metrics_and_residency() -> None:
    residency = AdapterResidency()
    assert adapter_state(_ep("a", running=frozenset({"sql"})), "sql", residency) == "active"
    assert adapter_state(_ep("b", waiting=frozenset({"sql"})), "sql", residency) == "active"
    assert adapter_state(_ep("c", running=frozenset({"x"})), "sql", residency) == "free"
    assert adapter_state(_ep("d", running=frozenset({"x", "y"})), "sql", residency) == "full"
    idle = _ep("e", running=frozenset({"x"}))
    residency.record(idle, "y")  # the router sent y there: both slots held, one by an idle adapter
    assert adapter_state(idle, "sql", residency) == "evict"
    residency.record(idle, "sql")
    assert adapter_state(idle, "sql", residency) == "active"


def test_residency_keeps_as_many_adapters_as_slots() -> None:
    residency = AdapterResidency()
    e = _ep("a", max_loras=2)
    for name in ("a1", "a2", "a3"):
        residency.record(e, name)
    assert residency.held(e) == ("a2", "a3")
    residency.forget("a")
    assert residency.held(e) == ()


def test_scorer_orders_active_free_evict_full() -> None:
    residency = AdapterResidency()
    evicting = _ep("evict", running=frozenset({"x"}))
    residency.record(evicting, "y")
    eps = [_ep("active", running=frozenset({"sql"})), _ep("free"), evicting, _ep("full", running=frozenset({"x", "y"}))]
    ctx = context()
    ctx.adapter, ctx.residency = SQL, residency
    scores = LoraAffinityScorer().score(ctx, [candidate(e) for e in eps])
    assert scores[0] == 1.0 and scores[1] == 0.8 and scores[3] == 0.0
    assert 0.0 < scores[2] < 0.6  # discounted by the predicted load time
    llm_d = LoraAffinityScorer(load_cost_s=0.0, track_dispatches=False).score(ctx, [candidate(e) for e in eps])
    assert llm_d[2] == 0.8  # without the router's own record, the idle adapter is invisible: "has room"


def test_base_model_requests_score_alike_and_pass_the_filter() -> None:
    eps = [_ep("a", running=frozenset({"x", "y"})), _ep("b")]
    ctx = context()
    assert LoraAffinityScorer().score(ctx, [candidate(e) for e in eps]) == [1.0, 1.0]
    assert len(LoraSlotsFilter().filter(ctx, [candidate(e) for e in eps])) == 2


def test_filter_drops_replicas_whose_slots_are_pinned() -> None:
    ctx = context()
    ctx.adapter = SQL
    kept = LoraSlotsFilter().filter(ctx, [candidate(_ep("full", running=frozenset({"x", "y"}))), candidate(_ep("ok"))])
    assert [c.id for c in kept] == ["ok"]


def test_router_returns_an_adapter_to_the_replica_it_sent_it_to() -> None:
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
    eps = [_ep(f"e{i}", max_loras=4) for i in range(3)]
    p = pool(eps)
    first = request(token_ids(64, start=1))
    first.use_adapter(SQL)
    decision = router.route(first, p, 1000.0)
    assert decision is not None
    router.on_dispatch(first, decision)
    for start in range(2, 6):
        again = request(token_ids(64, start=start))
        again.use_adapter(SQL)
        later = router.route(again, p, 1000.0)
        assert later is not None and later.endpoint.id == decision.endpoint.id


def test_prefix_hashes_differ_per_adapter() -> None:
    ids = token_ids(64)
    plain, adapted = request(ids), request(ids)
    adapted.use_adapter(SQL)
    assert adapted.prompt.lora == "sql" and plain.prompt.lora is None
    index = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
    e = endpoint("e")  # a simulated engine: the index hashes as it does
    a, b = index.blocks(plain.prompt, e), index.blocks(adapted.prompt, e)
    assert a is not None and b is not None and a.keys and set(a.keys).isdisjoint(b.keys)
    assert b.keys == hash_blocks(ids, 16, lora_salt(None, "sql"))  # the engine's own salted hashes


def test_an_adapter_the_engine_lists_needs_no_load() -> None:
    """Discovery (`Endpoint.loras`, from /v1/models) puts a replica between active and free; a listed
    adapter behind slots pinned by other adapters' running requests still waits (full)."""
    listed = _ep("listed")
    listed.loras = frozenset({"sql"})
    assert adapter_state(listed, "sql", AdapterResidency()) == "registered"
    assert adapter_state(listed, "other", AdapterResidency()) == "free"
    pinned = _ep("pinned", running=frozenset({"x", "y"}))
    pinned.loras = frozenset({"sql"})
    assert adapter_state(pinned, "sql", AdapterResidency()) == "full"
    ctx = context()
    ctx.adapter, ctx.residency = SQL, AdapterResidency()
    scores = LoraAffinityScorer().score(ctx, [candidate(e) for e in (_ep("free"), listed, pinned)])
    assert scores[1] > scores[0] > scores[2]
    assert [c.endpoint.id for c in LoraSlotsFilter().filter(ctx, [candidate(listed), candidate(pinned)])] == [listed.id]
