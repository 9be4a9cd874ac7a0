"""A pool's shared KV store (`kv_store`): its blocks are a `remote` hit on every replica of the pool."""

from __future__ import annotations

import pytest

from backends.config import KvStoreConfig, PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.kv_events import BlockStored
from backends.types import Endpoint
from policies.routing import build_router
from policies.routing.kv_tiers import TierLink, TierTokens
from policies.routing.pipeline import tier_pricing
from policies.routing.prefix_blocks import ENGINE_HASHERS
from policies.routing.prefix_index import ApproximatePrefixIndex
from policies.routing.prefix_precise import PrecisePrefixIndex
from tests.policies.routing.factories import NOW_S, endpoint, prompt, request, token_ids
from tests.policies.routing.prefix.events import batch, cleared, engine_hashes, removed, stored

PROMPT = token_ids(160)  # 10 blocks of 16
STORE = KvStoreConfig(capacity_tokens=1_000_000, bandwidth_gbps=40.0, latency_ms=0.5)


def in_store(ids: list[int], blocks: list[int]) -> BlockStored:
    """The store's own event for blocks it now holds: hashes only, as an offload tier publishes them."""
    hashes = engine_hashes(ids)
    return BlockStored([hashes[i] for i in blocks], None, [], 16, "STORE")


def store_pool(eps: list[Endpoint], store: KvStoreConfig | None = STORE) -> Pool:
    config = PoolConfig(
        name="p",
        model="m",
        preset="llama-3.1-8b@h100",
        endpoints=[StaticEndpointConfig(url=f"http://{e.id}") for e in eps],
        kv_store=store,
    )
    return Pool(config, endpoints=list(eps))


@pytest.mark.parametrize("engine", ["sim", "vllm"], ids=["engine-hash-keys", "token-keys"])
def test_store_blocks_count_on_every_replica_of_the_pool(engine: str) -> None:
    idx = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
    a, b = endpoint("a", engine=engine), endpoint("b", engine=engine)
    other_pool = endpoint("c", engine=engine, pool="q")
    idx.lookup_tiers(prompt(PROMPT), [a, b, other_pool], NOW_S)  # the index learns the endpoints' pools
    idx.apply("a", batch(stored(PROMPT)))
    idx.apply("b", batch(stored(token_ids(32, start=7))))
    idx.apply("c", batch(stored(token_ids(32, start=8))))
    # `a` evicts the tail from HBM; the store holds every block (hashes only: keys found through `a`)
    idx.apply("a", batch(removed(PROMPT, [4, 5, 6, 7, 8, 9])))
    idx.apply_store("p", batch(in_store(PROMPT, list(range(10)))))
    got = idx.lookup_tiers(prompt(PROMPT), [a, b, other_pool], NOW_S)
    assert got == [TierTokens(gpu=64, remote=95), TierTokens(remote=159), TierTokens()]
    # the store evicts block 6: every replica's match ends there
    idx.apply_store("p", batch(removed(PROMPT, [6], medium="STORE")))
    got = idx.lookup_tiers(prompt(PROMPT), [a, b], NOW_S)
    assert got == [TierTokens(gpu=64, remote=32), TierTokens(remote=96)]
    idx.apply_store("p", batch(cleared()))
    assert idx.lookup_tiers(prompt(PROMPT), [a, b], NOW_S) == [TierTokens(gpu=64), TierTokens()]


def test_a_replicas_own_dram_copy_beats_the_store() -> None:
    idx = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
    a = endpoint("a")
    idx.lookup_tiers(prompt(PROMPT), [a], NOW_S)
    hashes = engine_hashes(PROMPT)
    everything = list(range(10))
    idx.apply("a", batch(stored(PROMPT), removed(PROMPT, everything), BlockStored(hashes[:5], None, [], 16, "CPU")))
    idx.apply_store("p", batch(in_store(PROMPT, everything)))
    assert idx.lookup_tiers(prompt(PROMPT), [a], NOW_S) == [TierTokens(cpu=80, remote=79)]


def test_a_store_reset_after_a_gap_is_distrusted_for_a_while() -> None:
    idx = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS, resync_s=30.0)
    b = endpoint("b")
    idx.lookup_tiers(prompt(PROMPT), [b], NOW_S)
    idx.apply("b", batch(stored(token_ids(32, start=7))))
    idx.reset_store("p", "gap", NOW_S)
    idx.apply_store("p", batch(in_store(PROMPT, list(range(10)))))
    assert idx.lookup_tiers(prompt(PROMPT), [b], NOW_S) == [TierTokens()]
    assert idx.lookup_tiers(prompt(PROMPT), [b], NOW_S + 31) == [TierTokens(remote=159)]


def test_engines_events_of_a_store_medium_tell_the_store_of_a_pool_with_kv_store() -> None:
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    a, b = endpoint("a"), endpoint("b")
    eps = store_pool([a, b])
    router.route(request(token_ids(32, start=9)), eps, NOW_S)  # registers the pool's store
    router.on_kv_batch("b", batch(stored(token_ids(32, start=7))))
    # `a` computed the prompt and wrote it to the store (LMCache-style event of medium STORE)
    router.on_kv_batch("a", batch(stored(PROMPT), stored(PROMPT, medium="STORE")))
    decision = router.route(request(PROMPT, debug=True), store_pool([b]), NOW_S)
    assert decision is not None and decision.cached_tiers == TierTokens(remote=159)
    assert decision.scores["b"]["credited"] > 0  # 40 GB/s: loading beats recomputing 159 tokens
    router.on_kv_batch("a", batch(removed(PROMPT, [0], medium="STORE")))
    decision = router.route(request(PROMPT), store_pool([b]), NOW_S)
    assert decision is not None and decision.cached_tiers == TierTokens()


def test_without_kv_store_a_remote_medium_stays_the_replicas_own() -> None:
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    a, b = endpoint("a"), endpoint("b")
    router.route(request(token_ids(32, start=9)), store_pool([a, b], store=None), NOW_S)
    router.on_kv_batch("b", batch(stored(token_ids(32, start=7))))
    router.on_kv_batch("a", batch(stored(PROMPT), removed(PROMPT, list(range(10))), stored(PROMPT, medium="STORE")))
    decision = router.route(request(PROMPT, debug=True), store_pool([a, b], store=None), NOW_S)
    assert decision is not None and decision.endpoint.id == "a"
    assert decision.cached_tiers == TierTokens(remote=159)
    assert decision.scores["b"]["cached"] == 0.0


def test_the_store_prices_the_remote_tier_of_its_pool() -> None:
    config = build_router({}).config.kv_tiers
    with_store = tier_pricing(store_pool([endpoint("a")]), config)
    without = tier_pricing(store_pool([endpoint("a")], store=None), config)
    assert with_store.links is not None and without.links is not None
    assert with_store.links[2] == TierLink(40e9, 0.5e-3)
    assert without.links[2] == TierLink(10e9, 1e-3)  # routing.kv_tiers.remote's default


def test_the_approximate_index_counts_what_was_sent_to_the_pool_as_in_its_store() -> None:
    """No events (approximate mode, or an engine whose events stopped): every prompt dispatched to a
    replica of a pool with `kv_store` is in the pool's store too, a `remote` hit on every replica after
    that replica's own run; other pools see nothing of it."""
    idx = ApproximatePrefixIndex(block_tokens=16)
    a, b, other = endpoint("a"), endpoint("b"), endpoint("c", pool="q")
    idx.add_store("p", 1_000_000)
    idx.record(prompt(PROMPT), a)
    idx.record(prompt(PROMPT[:64]), b)  # b holds the first 4 blocks itself
    got = idx.lookup_tiers(prompt(PROMPT), [a, b, other])
    assert got == [TierTokens(gpu=159), TierTokens(gpu=64, remote=95), TierTokens()]
    assert idx.entries() == 10 + 4 + 10  # a's, b's and the store's blocks


def test_the_approximate_store_is_an_lru_of_its_capacity() -> None:
    idx = ApproximatePrefixIndex(block_tokens=16)
    a, b = endpoint("a"), endpoint("b")
    idx.add_store("p", 160)  # 10 blocks
    first, second = token_ids(160, start=1), token_ids(96, start=2)
    idx.record(prompt(first), a)
    idx.record(prompt(second), a)  # 6 blocks more: the store drops first's 6 tail blocks
    got = idx.lookup_tiers(prompt(first), [b])
    assert got == [TierTokens(remote=64)]
    assert idx.memory_bytes() <= idx.max_memory_bytes(2, stores=1)


def test_a_router_in_approximate_mode_routes_to_the_store_it_sends_to() -> None:
    router = build_router({"seed": 1, "prefix_index": {"mode": "approximate", "block_size_tokens": 16}})
    a, b = endpoint("a"), endpoint("b")
    first = router.route(request(PROMPT), store_pool([a, b]), NOW_S)
    assert first is not None
    router.on_dispatch(request(PROMPT), first)
    other = b if first.endpoint.id == "a" else a
    decision = router.route(request(PROMPT, debug=True), store_pool([other]), NOW_S)
    assert decision is not None and decision.cached_tiers == TierTokens(remote=159)
