"""The route observer counts the supply side of each dispatch (`ScoringRouter.supply`) on the walk."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import GatewayMetrics
from gateway.transport.observers import RouteMetrics
from policies.routing import build_router
from tests.gateway.request.walk import build, chat_request, fleet
from tests.gateway.transport.test_engine import ANSWER, FakeEngine, serve

__all__ = ["serve"]  # the fixture


async def test_a_repeated_prompt_counts_the_prefill_it_saved(serve: Any) -> None:
    metrics = GatewayMetrics()
    router = build_router({"seed": 1, "prefix_index": {"mode": "approximate", "block_size_tokens": 4}})
    walk = build(fleet({"big": [await serve(FakeEngine([(200, ANSWER)]))]}), hooks=[RouteMetrics(metrics, router)])
    walk.director.dispatch.router = router  # the gateway's scoring router instead of the walk's fixed one

    def saved(name: str, **labels: str) -> float:
        return sum(
            s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    assert (await walk.director.handle(chat_request(), "chat")).status == 200
    assert saved("tokenway_prefill_tokens_saved_total") == 0  # a cold cache saves nothing
    assert (await walk.director.handle(chat_request(), "chat")).status == 200
    hit = saved("tokenway_prefix_cache_estimated_hit_tokens_total")
    assert hit > 0
    assert saved("tokenway_prefill_tokens_saved_total", pool="big", measure="real") == hit
    assert saved("tokenway_prefill_gpu_seconds_saved_total", pool="big") > 0
    assert saved("tokenway_prefill_engine_gpu_seconds_saved_total") == 0  # this engine reports no cached tokens
    await walk.upstream.close()


async def test_the_engines_count_of_cached_tokens_prices_the_saving_too(serve: Any) -> None:
    metrics = GatewayMetrics()
    router = build_router({"seed": 1, "prefix_index": {"mode": "approximate", "block_size_tokens": 4}})
    cached = {**ANSWER, "usage": {**ANSWER["usage"], "prompt_tokens_details": {"cached_tokens": 8}}}
    engine = FakeEngine([(200, ANSWER), (200, cached)])
    walk = build(fleet({"big": [await serve(engine)]}), hooks=[RouteMetrics(metrics, router)])
    walk.director.dispatch.router = router

    def saved(name: str) -> float:
        return sum(
            s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
            if s.name == name and s.labels.get("pool") == "big"
        )

    assert (await walk.director.handle(chat_request(), "chat")).status == 200
    assert saved("tokenway_prefill_engine_gpu_seconds_saved_total") == 0
    assert (await walk.director.handle(chat_request(), "chat")).status == 200
    engine_s = saved("tokenway_prefill_engine_gpu_seconds_saved_total")
    assert engine_s > 0  # 8 tokens by the engine's count, whatever the router expected
    await walk.upstream.close()
