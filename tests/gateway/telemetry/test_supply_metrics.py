"""The supply-side metrics of a known dispatch: prefill tokens, GPU-seconds and dollars saved, KV bytes moved."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.perf.presets import resolve_preset
from backends.perf.roofline import step_cost
from gateway.telemetry.metrics import GatewayMetrics
from policies.routing import build_router
from policies.routing.kv_tiers import KvSupply
from tests.gateway.telemetry.test_metrics import parse, value
from tests.policies.routing.factories import NOW_S, endpoint, request, token_ids
from tests.policies.routing.prefix.events import batch, removed, stored
from tests.policies.routing.prefix.test_tiers import offloaded

KV_BYTES = 2 * 32 * 8 * 128 * 2  # llama-3.1-8b in bf16: 128 KiB per token


def test_a_dram_hit_dispatch_shows_its_savings_and_the_bytes_it_loads() -> None:
    ids = token_ids(4000)
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": []}})
    held = list(range(2000 // 16))  # the first 2000 tokens: in HBM, then offloaded to DRAM
    router.on_kv_batch("a", batch(stored(ids[:2000]), removed(ids[:2000], held), offloaded(ids[:2000], held)))
    config = PoolConfig(name="llama", model="m", replicas=1, preset="llama-3.1-8b@h100", usd_per_gpu_hour=7.2)
    decision = router.route(request(ids), Pool(config, endpoints=[endpoint("a", pool="llama")]), NOW_S)
    assert decision is not None
    supply = router.supply(decision, 4000)
    assert supply is not None
    metrics = GatewayMetrics()
    metrics.observe_supply("llama", supply)
    metrics.observe_supply("llama", supply)  # counters add up over dispatches
    _, s = parse(metrics)
    preset = resolve_preset("llama-3.1-8b@h100")
    saved_s = step_cost(preset, [(2000, 0)]).compute_s - 2000 * KV_BYTES / 25e9  # compute less DRAM load
    assert value(s, "tokenway_prefill_tokens_saved_total", pool="llama", measure="real") == 2 * 2000
    assert 2000 < value(s, "tokenway_prefill_tokens_saved_total", pool="llama", measure="credited") < 2 * 2000
    assert value(s, "tokenway_prefill_gpu_seconds_saved_total", pool="llama") == pytest.approx(2 * saved_s)
    assert value(s, "tokenway_prefill_saved_usd_total", pool="llama") == pytest.approx(2 * saved_s * 7.2 / 3600)
    assert value(s, "tokenway_kv_bytes_moved_total", pool="llama", link="cpu") == 2 * 2000 * KV_BYTES


def test_links_are_a_bounded_label_and_unpriced_pools_have_no_dollars() -> None:
    metrics = GatewayMetrics()
    metrics.observe_supply("p", KvSupply(100, 100.0, 0.5, None, (("cross_rack", 10), ("from-a-client", 99))))
    families, s = parse(metrics)
    assert value(s, "tokenway_kv_bytes_moved_total", link="cross_rack") == 10
    assert {dict(ls)["link"] for n, ls in s if n == "tokenway_kv_bytes_moved_total"} == {"cross_rack"}
    assert value(s, "tokenway_prefill_gpu_seconds_saved_total", pool="p") == 0.5
    assert not families["tokenway_prefill_saved_usd"].samples
