"""Scraping: stats parsed per adapter, path fallback for older TRT-LLM, staleness, remote APIs."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from backends import scrape
from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.scrape import Scraper, is_stale
from backends.types import Endpoint, EndpointState
from tests.backends.builders import fixture_text, pool
from tests.backends.fake_engine import fake_engine
from tests.support.polling import wait_for_async


class Clock:
    now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def make_endpoint(engine: str, base_url: str) -> Endpoint:
    return Endpoint(id="p/both-0", pool="p", base_url=base_url, engine=engine, served_model="m",
                    state=EndpointState.READY)  # fmt: skip


async def test_vllm_scrape_updates_stats_and_staleness() -> None:
    clock = Clock()
    scraper = Scraper(BackendsSettings(), clock)
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, fixture_text("vllm_0_33_metrics.txt"))
        e = make_endpoint("vllm", engine.base_url)
        assert is_stale(e, clock.now_s, 2.0)  # never scraped
        assert await scraper.scrape(e, session)
        assert (e.stats.running, e.stats.waiting, e.stats.num_gpu_blocks) == (12, 4, 27579)
        assert e.stats.scraped_at_s == 50.0
        assert not is_stale(e, 51.0, 2.0)
        engine.set("/metrics", 500)
        clock.now_s = 60.0
        assert not await scraper.scrape(e, session)
        assert e.stats.running == 12  # kept, but aging
        assert is_stale(e, clock.now_s, 2.0)


async def test_trtllm_falls_back_to_json_iteration_stats_on_older_builds() -> None:
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, fixture_text("trtllm_iteration_stats.json"), {"content-type": "application/json"})
        e = make_endpoint("trtllm", engine.base_url)
        assert not await scraper.scrape(e, session)  # /prometheus/metrics: 404
        assert await scraper.scrape(e, session)
        assert (e.stats.running, e.stats.waiting, e.stats.block_size) == (9, 4, 32)
        assert engine.hits == {"/prometheus/metrics": 1, "/metrics": 1}


async def test_trtllm_prometheus_preferred() -> None:
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/prometheus/metrics", 200, fixture_text("trtllm_prometheus.txt"))
        e = make_endpoint("trtllm", engine.base_url)
        assert await scraper.scrape(e, session)
        assert e.stats.kv_usage_ratio == pytest.approx(0.4)


async def test_unusable_metrics_leave_stats_alone() -> None:
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, "process_cpu_seconds_total 1\n")
        e = make_endpoint("vllm", engine.base_url)
        assert not await scraper.scrape(e, session)
        assert e.stats.scraped_at_s == 0.0


async def test_remote_api_is_never_stale() -> None:
    clock = Clock()
    scraper = Scraper(BackendsSettings(), clock)
    async with aiohttp.ClientSession() as session:
        e = make_endpoint("openai", "http://127.0.0.1:9")
        assert not is_stale(e, 1e9, 2.0)
        assert await scraper.scrape(e, session)
        assert e.stats.scraped_at_s == 50.0


async def test_run_scrapes_ready_endpoints_only() -> None:
    settings = BackendsSettings(scrape_interval_s=0.02)
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, fixture_text("vllm_old_metrics.txt"))
        fleet = Fleet.from_configs([
            pool(name="a", engine="vllm", endpoints=[{"url": engine.base_url}]),
            pool(name="b", engine="vllm", endpoints=[{"url": engine.base_url}]),
        ])  # fmt: skip
        ready = fleet.pools["a"].endpoints[0]
        ready.state = EndpointState.READY
        starting = fleet.pools["b"].endpoints[0]
        task = asyncio.create_task(scrape.run(fleet, session, settings))
        try:
            await wait_for_async(lambda: ready.stats.scraped_at_s != 0.0, what="a scrape")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ready.stats.kv_usage_ratio == pytest.approx(0.75)
        assert starting.stats.scraped_at_s == 0.0
