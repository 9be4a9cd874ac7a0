"""The supply side of a dispatch: tokens, GPU-seconds and dollars a cached prefix saved, KV bytes moved."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.perf.presets import resolve_preset
from backends.perf.roofline import step_cost
from backends.types import Role, Topology
from policies.routing import build_router
from policies.routing.config import KvTiersConfig
from policies.routing.kv_tiers import ChunkCompute, KvSupply, TierTokens
from policies.routing.pipeline import supply_meter, tier_pricing
from policies.routing.types import RouteDecision
from tests.policies.routing.factories import NOW_S, endpoint, pool, request, token_ids
from tests.policies.routing.prefix.events import batch, removed, stored
from tests.policies.routing.prefix.test_tiers import offloaded

PRESET = resolve_preset("llama-3.1-8b@h100")
KV_BYTES = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16: 128 KiB
DRAM_BYTES_PER_S = 25e9  # routing.kv_tiers.cpu's default link


def meter_pool(**config: object) -> Pool:
    return Pool(PoolConfig(name="p", model="m", replicas=1, preset="llama-3.1-8b@h100", **config), endpoints=[])  # type: ignore[arg-type]


def measure(decision: RouteDecision, prompt_tokens: int, credit: str = "physics", **config: object) -> KvSupply:
    p = meter_pool(**config)
    tiers = KvTiersConfig(credit=credit)  # type: ignore[arg-type]
    return supply_meter(p, tier_pricing(p, tiers), tiers).measure(decision, prompt_tokens)


def test_a_dram_hit_saves_its_compute_less_its_load_priced_at_the_pools_gpu_cost() -> None:
    decision = RouteDecision(endpoint("a"), "prefix-hit", cached_tokens_estimate=2000,
                             cached_tiers=TierTokens(gpu=1000, cpu=1000))  # fmt: skip
    s = measure(decision, 3000, usd_per_gpu_hour=3.6)
    gpu_s = step_cost(PRESET, [(1000, 0)]).compute_s
    dram_s = step_cost(PRESET, [(1000, 1000)]).compute_s - 1000 * KV_BYTES / DRAM_BYTES_PER_S
    assert dram_s > 0
    assert s.real_tokens == 2000
    assert 1000 < s.credited_tokens < 2000
    assert s.gpu_seconds == pytest.approx(gpu_s + dram_s)
    assert s.usd == pytest.approx((gpu_s + dram_s) * 3.6 / 3600)
    assert s.bytes_by_link == (("cpu", 1000 * KV_BYTES),)


def test_gpu_seconds_count_every_gpu_of_the_replica_and_no_price_without_one() -> None:
    decision = RouteDecision(endpoint("a"), "prefix-hit", cached_tokens_estimate=4096, cached_tiers=TierTokens(4096))
    one = measure(decision, 5000)
    two = measure(decision, 5000, tensor_parallel=2)
    tp2 = resolve_preset("llama-3.1-8b@h100", 2)
    assert one.usd is None and one.bytes_by_link == ()
    assert one.gpu_seconds == pytest.approx(step_cost(PRESET, [(4096, 0)]).compute_s)
    assert two.gpu_seconds == pytest.approx(2 * step_cost(tp2, [(4096, 0)]).compute_s)


def test_gpu_only_credit_sees_no_lower_tier_and_nothing_is_saved_without_a_hit() -> None:
    tiers = TierTokens(gpu=500, cpu=1500)
    decision = RouteDecision(endpoint("a"), "load", cached_tokens_estimate=500, cached_tiers=tiers)
    s = measure(decision, 3000, credit="gpu-only")
    assert (s.real_tokens, s.credited_tokens, s.bytes_by_link) == (500, 500.0, ())
    cold = measure(RouteDecision(endpoint("a"), "load"), 3000, usd_per_gpu_hour=2.0)
    assert (cold.real_tokens, cold.gpu_seconds, cold.usd, cold.bytes_by_link) == (0, 0.0, 0.0, ())


@pytest.mark.parametrize(
    ("prefill_rack", "link"),
    [pytest.param("r1", "same_rack", id="same-rack"), pytest.param("r2", "cross_rack", id="cross-rack"),
     pytest.param(None, "unknown", id="unlabelled")],
)  # fmt: skip
def test_a_disaggregated_request_moves_what_the_decode_endpoint_lacks_over_its_link(
    prefill_rack: str | None, link: str
) -> None:
    decode = endpoint("d", role=Role.DECODE)
    decode.topology = Topology(node="d", rack="r1", zone="z")
    prefill = endpoint("p", role=Role.PREFILL)
    if prefill_rack is not None:
        prefill.topology = Topology(node="p", rack=prefill_rack, zone="z")
    decision = RouteDecision(decode, "load", prefill_endpoint=prefill, cached_tokens_estimate=1000,
                             cached_tiers=TierTokens(gpu=1000), prefill_cached_tokens_estimate=2048,
                             prefill_cached_tiers=TierTokens(gpu=2048))  # fmt: skip
    s = measure(decision, 4096)
    # the prompt is computed on the prefill endpoint: its cached tokens are the ones not recomputed
    assert s.real_tokens == 2048
    assert s.gpu_seconds == pytest.approx(step_cost(PRESET, [(2048, 0)]).compute_s)
    assert s.bytes_by_link == ((link, (4096 - 1000) * KV_BYTES),)


def test_router_measures_its_own_dispatch_and_baseline_pools_have_none() -> None:
    ids = token_ids(8000)
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    everything = list(range(len(ids) // 16))
    router.on_kv_batch("a", batch(stored(ids), removed(ids, everything), offloaded(ids, everything)))
    eps = [endpoint("a"), endpoint("b")]
    decision = router.route(request(ids), pool(eps), NOW_S)
    assert decision is not None and decision.endpoint.id == "a"
    s = router.supply(decision, 8000)
    assert s is not None and s.real_tokens == 7999 and s.gpu_seconds > 0
    assert s.bytes_by_link == (("cpu", 7999 * KV_BYTES),)  # the pool names no preset: the prior's default
    baseline = build_router({"default": {"router": "round-robin"}})
    d = baseline.route(request(ids), pool(eps), NOW_S)
    assert d is not None and baseline.supply(d, 8000) is None


@pytest.mark.parametrize(
    ("expected", "engine", "split"),
    [
        pytest.param(TierTokens(gpu=1000, cpu=1000), 2000, TierTokens(gpu=1000, cpu=1000), id="as-expected"),
        pytest.param(TierTokens(gpu=1000, cpu=1000), 1500, TierTokens(gpu=1000, cpu=500), id="fewer: the tail goes"),
        pytest.param(TierTokens(gpu=1000, cpu=1000), 2600, TierTokens(gpu=1000, cpu=1600), id="more: deepest tier"),
        pytest.param(TierTokens(), 800, TierTokens(gpu=800), id="unexpected: HBM"),
        pytest.param(TierTokens(gpu=1000, remote=64), 0, TierTokens(), id="none"),
    ],
)  # fmt: skip
def test_the_engines_count_is_laid_over_the_routers_tiers_in_prompt_order(
    expected: TierTokens, engine: int, split: TierTokens
) -> None:
    assert expected.engine_split(engine) == split


def test_the_engines_count_prices_like_the_routers_and_a_disaggregated_request_has_none() -> None:
    tiers = TierTokens(gpu=1000, cpu=1000)
    decision = RouteDecision(endpoint("a"), "prefix-hit", cached_tokens_estimate=2000, cached_tiers=tiers)
    p = meter_pool(usd_per_gpu_hour=3.6)
    config = KvTiersConfig(credit="physics")
    meter = supply_meter(p, tier_pricing(p, config), config)
    router_side, engine_side = meter.measure(decision, 3000), meter.measure_engine(decision, 2000)
    assert engine_side.gpu_seconds == pytest.approx(router_side.gpu_seconds)
    assert engine_side.usd == pytest.approx(router_side.usd)
    assert (engine_side.real_tokens, engine_side.bytes_by_link) == (2000, ())
    short = meter.measure_engine(decision, 1000)  # the engine found only the HBM run
    assert short.gpu_seconds == pytest.approx(step_cost(PRESET, [(1000, 0)]).compute_s)
    router = build_router({"seed": 1})
    pd = RouteDecision(endpoint("d", role=Role.DECODE), "pd", prefill_endpoint=endpoint("p", role=Role.PREFILL))
    assert router.engine_supply(pd, 2000) is None


@pytest.mark.parametrize("name", ["llama-3.1-8b@h100", "llama-3.1-70b@h100"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_chunks_compute_time_is_the_rooflines_step_cost(name: str, tp: int) -> None:
    """The meter and the tier credit price a prefill chunk from constants taken once per preset; they
    must stay the roofline's own `step_cost(...).compute_s` if that formula changes."""
    preset = resolve_preset(name, tp)
    compute = ChunkCompute(preset)
    for new_tokens, context in [(1, 0), (16, 0), (1000, 0), (4096, 0), (512, 4096), (3, 100_000), (8192, 8192)]:
        expected = step_cost(preset, [(new_tokens, context)]).compute_s
        assert compute(new_tokens, context) == pytest.approx(expected, rel=1e-12)
