"""KV tiers: the indexes count cached tokens per tier, and a lower-tier hit is credited by physics."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.kv_events import BlockStored
from backends.perf.presets import resolve_preset
from backends.types import Role
from policies.routing import build_router
from policies.routing.kv_tiers import CPU, DISK, REMOTE, TierLink, TierPricing, TierTokens
from policies.routing.prefix_blocks import ENGINE_HASHERS
from policies.routing.prefix_index import ApproximatePrefixIndex
from policies.routing.prefix_precise import PrecisePrefixIndex
from tests.policies.routing.factories import NOW_S, endpoint, pool, prompt, request, token_ids
from tests.policies.routing.prefix.events import batch, engine_hashes, removed, stored

PROMPT = token_ids(160)  # 10 blocks of 16
PRESET = resolve_preset("llama-3.1-8b@h100")
LINKS = (TierLink(25e9), TierLink(5e9, 1e-4), TierLink(1.25e9, 1e-3))


def offloaded(ids: list[int], blocks: list[int]) -> BlockStored:
    """The blocks copied to host DRAM, as vLLM's offloading connector publishes them: hashes only."""
    hashes = engine_hashes(ids)
    return BlockStored([hashes[i] for i in blocks], None, [], 16, "CPU")


@pytest.mark.parametrize("engine", ["sim", "vllm"], ids=["engine-hash-keys", "token-keys"])
def test_precise_index_splits_a_match_into_its_hbm_run_and_the_offloaded_run(engine: str) -> None:
    idx = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
    e = endpoint("a", engine=engine)
    idx.apply("a", batch(stored(PROMPT)))
    assert idx.lookup_tiers(prompt(PROMPT), [e], NOW_S) == [TierTokens(gpu=159)]
    # HBM evicts the tail, the offload tier keeps it
    idx.apply("a", batch(removed(PROMPT, [6, 7, 8, 9]), offloaded(PROMPT, [6, 7, 8, 9])))
    assert idx.lookup_tiers(prompt(PROMPT), [e], NOW_S) == [TierTokens(gpu=96, cpu=63)]
    assert idx.lookup(prompt(PROMPT), [e], NOW_S) == [159]
    # DRAM drops a block in the middle: the engine's match ends there
    idx.apply("a", batch(removed(PROMPT, [8], medium="CPU")))
    assert idx.lookup_tiers(prompt(PROMPT), [e], NOW_S) == [TierTokens(gpu=96, cpu=32)]


def test_a_block_in_both_tiers_counts_in_hbm() -> None:
    idx = PrecisePrefixIndex(engine_hashers=ENGINE_HASHERS)
    e = endpoint("a")
    idx.apply("a", batch(stored(PROMPT), offloaded(PROMPT, list(range(10)))))  # write-through offloading
    assert idx.lookup_tiers(prompt(PROMPT), [e], NOW_S) == [TierTokens(gpu=159)]
    idx.apply("a", batch(removed(PROMPT, list(range(10)))))
    assert idx.lookup_tiers(prompt(PROMPT), [e], NOW_S) == [TierTokens(cpu=159)]


def test_approximate_index_moves_blocks_pushed_out_of_hbm_to_the_offload_lru() -> None:
    hbm = endpoint("a", num_gpu_blocks=40)  # 640 tokens: 10 blocks of 64
    first, second = token_ids(640), token_ids(640, start=5)
    tiered = ApproximatePrefixIndex(block_tokens=64, offload_tokens_of=lambda _pool: 640)
    hbm_only = ApproximatePrefixIndex(block_tokens=64)
    for index in (tiered, hbm_only):
        index.record(prompt(first), hbm)
        index.record(prompt(second), hbm)
    assert hbm_only.lookup_tiers(prompt(first), [hbm]) == [TierTokens()]
    assert tiered.lookup_tiers(prompt(first), [hbm]) == [TierTokens(cpu=639)]
    assert tiered.lookup_tiers(prompt(second), [hbm]) == [TierTokens(gpu=639)]
    tiered.record(prompt(first), hbm)  # reused: back in HBM, pushing `second` down
    assert tiered.lookup_tiers(prompt(first), [hbm]) == [TierTokens(gpu=639)]
    assert tiered.lookup_tiers(prompt(second), [hbm]) == [TierTokens(cpu=639)]
    assert tiered.stats()["a"].capacity_blocks == 20
    tiered.record(prompt(token_ids(640, start=8)), hbm)  # 20 new blocks flush both tiers
    tiered.record(prompt(token_ids(640, start=9)), hbm)
    assert tiered.lookup(prompt(first), [hbm]) == [0]


def test_physics_credit_grows_with_the_prefix_and_falls_with_the_link() -> None:
    pricing = TierPricing("physics", preset=PRESET, links=LINKS)
    short_dram = pricing.run_credit(CPU, 0, 1024)
    long_dram = pricing.run_credit(CPU, 64_000, 1024)
    assert 0.5 < short_dram < long_dram < 1.0  # attention: a deep run costs more to recompute
    assert pricing.run_credit(DISK, 0, 1024) < short_dram
    assert pricing.run_credit(REMOTE, 0, 16) == 0.0  # 1 ms to fetch 16 tokens: recomputing is faster
    tiers = TierTokens(gpu=1000, cpu=1000)
    assert 1000 < pricing.credited(tiers) < 2000
    assert pricing.load_s(CPU, 1000) == pytest.approx(1000 * 131072 / 25e9)


@pytest.mark.parametrize(
    ("mode", "visible", "credited"),
    [
        pytest.param("flat", 400, 400.0, id="flat"),
        pytest.param("gpu-only", 100, 100.0, id="gpu-only"),
        pytest.param("constant", 400, 100 + 0.75 * 100 + 0.25 * 200, id="constant"),
    ],
)
def test_other_credit_modes(mode: str, visible: int, credited: float) -> None:
    tiers = TierTokens(gpu=100, cpu=100, disk=100, remote=100)
    pricing = TierPricing(mode)
    assert pricing.visible(tiers) == visible
    assert pricing.credited(tiers) == pytest.approx(credited)


@pytest.mark.parametrize(
    ("gpu_holder", "expected"),
    [pytest.param(True, "gpu", id="hbm-beats-dram"), pytest.param(False, "cpu", id="dram-beats-nothing")],
)
def test_router_prefers_hbm_to_dram_to_recomputing(gpu_holder: bool, expected: str) -> None:
    ids = token_ids(8000)
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    eps = [endpoint("gpu"), endpoint("cpu"), endpoint("cold")]
    everything = list(range(len(ids) // 16))
    router.on_kv_batch("cpu", batch(stored(ids), removed(ids, everything), offloaded(ids, everything)))
    router.on_kv_batch("gpu", batch(stored(ids) if gpu_holder else stored(token_ids(32, start=3))))
    router.on_kv_batch("cold", batch(stored(token_ids(32, start=4))))
    decision = router.route(request(ids), pool(eps), NOW_S)
    assert decision is not None and decision.endpoint.id == expected
    if expected == "cpu":
        assert decision.cached_tiers == TierTokens(cpu=7999)
        assert decision.cached_tokens_estimate == 7999  # real tokens: the engine will not compute them
        router.on_dispatch(request(ids), decision)
        assert router.report(NOW_S).cached_tokens_by_tier["cpu"] == 7999


def test_gpu_only_credit_does_not_see_offloaded_blocks() -> None:
    ids = token_ids(8000)
    router = build_router(
        {"seed": 1, "prefix_index": {"mode": "precise"}, "kv_tiers": {"credit": "gpu-only"}, "default": {"filters": []}}
    )
    everything = list(range(len(ids) // 16))
    router.on_kv_batch("cpu", batch(stored(ids), removed(ids, everything), offloaded(ids, everything)))
    decision = router.route(request(ids, debug=True), pool([endpoint("cpu"), endpoint("other")]), NOW_S)
    assert decision is not None
    assert decision.scores["cpu"]["cached"] == 0.0


def test_work_cost_prices_a_dram_hit_between_an_hbm_hit_and_a_miss() -> None:
    ids = token_ids(8000)
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    everything = list(range(len(ids) // 16))
    router.on_kv_batch("gpu", batch(stored(ids)))
    router.on_kv_batch("cpu", batch(stored(ids), removed(ids, everything), offloaded(ids, everything)))
    router.on_kv_batch("cold", batch(stored(token_ids(32, start=4))))
    eps = [endpoint("gpu"), endpoint("cpu"), endpoint("cold")]
    decision = router.route(request(ids, debug=True), pool(eps), NOW_S)
    assert decision is not None
    work = {k: v["work-cost"] for k, v in decision.scores.items()}
    assert work["gpu"] > work["cpu"] > work["cold"]
    assert 0 < decision.scores["cpu"]["credited"] < 7999


@pytest.mark.parametrize(
    ("credit", "expected"),
    [
        pytest.param("physics", ("decode-0", "few-uncached", None), id="pulled-from-its-dram"),
        pytest.param("gpu-only", (None, "disaggregated", "prefill-0"), id="recomputed-on-the-prefill-leg"),
    ],
)
def test_a_decode_replica_holding_the_prefix_in_dram_loads_it_instead_of_a_prefill_leg(
    credit: str, expected: tuple[str | None, str, str | None]
) -> None:
    """PD: when the conversation so far sits in a decode replica's host DRAM, only the new turn is
    uncached there, so the replica prefills it itself and its offloading connector loads the rest,
    with no prefill leg recomputing the prefix and no KV connector parameters sent; a router blind
    to lower tiers sends the whole prompt through a prefill leg."""
    history, turn = token_ids(8000), token_ids(200, start=7)
    router = build_router(
        {"seed": 1, "prefix_index": {"mode": "precise"}, "kv_tiers": {"credit": credit}, "default": {"filters": []}}
    )
    eps = [
        endpoint("prefill-0", pool="pd", role=Role.PREFILL),
        endpoint("decode-0", pool="pd", role=Role.DECODE),
        endpoint("decode-1", pool="pd", role=Role.DECODE),
    ]
    blocks = list(range(len(history) // 16))
    router.on_kv_batch("decode-0", batch(stored(history), removed(history, blocks), offloaded(history, blocks)))
    pd = Pool(PoolConfig(name="pd", model="m", roles={"prefill": 1, "decode": 2}), endpoints=eps)
    d = router.route(request(history + turn), pd, NOW_S)
    assert d is not None
    prefill = d.prefill_endpoint.id if d.prefill_endpoint is not None else None
    holder = d.endpoint.id if credit == "physics" else None  # blind: either decode replica
    assert (holder, d.pd_reason, prefill) == expected
    if credit == "physics":
        assert d.cached_tiers == TierTokens(cpu=8000)
