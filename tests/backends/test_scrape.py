"""Scraping: stats parsed per adapter, path fallback for older TRT-LLM, staleness, remote APIs."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from backends import scrape
from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.scrape import Scraper, is_stale
from backends.types import Endpoint, EndpointState, EndpointStats
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


# --- what an engine reports is input (bench/chaos/engine_channels.py) --------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # an infinite or absurd count made int() raise in the adapter: the scrape task died each tick
        ("vllm:num_requests_running +Inf\nvllm:num_requests_waiting 2\n", (0, 2, 0.0)),
        ("vllm:num_requests_running 1e300\nvllm:num_requests_waiting 1e300\n", None),
        # two samples of 1e308 (one per data-parallel rank) summed to infinity
        ("vllm:num_requests_running 1e308\n" * 2 + "vllm:num_requests_waiting 1\n", (0, 1, 0.0)),
        # negative gauges: a waiting count of -1 divided by zero in the queue scorer
        ("vllm:num_requests_running -5\nvllm:num_requests_waiting -1\nvllm:kv_cache_usage_perc -3\n", (0, 0, 0.0)),
        ("vllm:num_requests_running 3\nvllm:kv_cache_usage_perc 40\n", (3, 0, 1.0)),
        ("vllm:num_requests_running 9000000000000000\n", (scrape.MAX_ENGINE_REQUESTS, 0, 0.0)),
        # a label that is an infinite float made int() raise too
        ('vllm:num_requests_running 1\nvllm:cache_config_info{block_size="1e999",num_gpu_blocks="-4"} 1', (1, 0, 0.0)),
    ],
    ids=["inf", "1e300", "sum-overflows", "negative", "ratio-above-1", "huge", "inf-label"],
)
async def test_hostile_metric_values_are_dropped_or_clamped(text: str, expected: tuple[int, int, float] | None) -> None:
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, text)
        e = make_endpoint("vllm", engine.base_url)
        updated = await scraper.scrape(e, session)
    assert updated == (expected is not None)
    if expected is not None:
        assert (e.stats.running, e.stats.waiting, e.stats.kv_usage_ratio) == expected
        assert e.stats.block_size is None and e.stats.num_gpu_blocks is None
    else:
        assert scraper.unusable == {e.id: 1}


@pytest.mark.parametrize(
    "body",
    [
        '[{"iter": "a", "numActiveRequests": 1}, {"iter": 2, "numActiveRequests": 1}]',  # TypeError in max()
        '[{"numActiveRequests": 1, "kvCacheStats": [1], "inflightBatchingStats": "x"}]',  # AttributeError
        '[{"numActiveRequests": Infinity, "numQueuedRequests": NaN, "kvCacheStats": {"maxNumBlocks": 1e999}}]',
        "[" * 100_000,  # RecursionError
        '{"a": ' * 50 + "1",  # cut short
    ],
    ids=["iter-mixed", "stats-not-objects", "non-finite", "deep", "cut"],
)
async def test_trtllm_iteration_stats_of_any_shape_never_fail_the_scrape(body: str) -> None:
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/metrics", 200, body, {"content-type": "application/json"})
        e = make_endpoint("trtllm", engine.base_url)
        scraper._path_index[e.id] = 1  # the JSON path
        await scraper.scrape(e, session)  # raises nothing
    assert 0 <= e.stats.running <= scrape.MAX_ENGINE_REQUESTS


async def test_metrics_past_the_size_bound_are_not_read() -> None:
    """A body without end used to be read whole into memory, four times a second."""
    scraper = Scraper(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        line = "vllm:num_requests_running 1\n"
        engine.set("/metrics", 200, line * (scrape.MAX_METRICS_BYTES // len(line) + 1))
        e = make_endpoint("vllm", engine.base_url)
        assert not await scraper.scrape(e, session)
        assert e.stats.scraped_at_s == 0.0 and scraper.unusable == {e.id: 1}
        engine.set("/metrics", 200, line)
        assert await scraper.scrape(e, session)  # the next good scrape is used


def test_bounded_stats_bounds_every_field() -> None:
    many = frozenset(f"adapter-{i}" for i in range(2 * scrape.MAX_LISTED)) | {"x" * 10_000}
    stats = scrape.bounded_stats(
        EndpointStats(
            running=10**400,
            waiting=-3,
            kv_usage_ratio=float("nan"),
            prefix_cache_hits_tokens=float("inf"),
            prefix_cache_queries_tokens=-1.0,
            preemptions=1e300,
            block_size=0,
            num_gpu_blocks=1 << 40,
            waiting_by_reason={f"r{i}": 10**30 for i in range(1000)},
            sleep_state="x" * 1000,
            running_loras=many,
            max_loras=-7,
            kv_offload_bytes={"gpu_to_cpu": float("nan"), "x" * 1000: 1.0},
        )
    )
    assert (stats.running, stats.waiting, stats.kv_usage_ratio) == (scrape.MAX_ENGINE_REQUESTS, 0, 0.0)
    assert (stats.prefix_cache_hits_tokens, stats.prefix_cache_queries_tokens) == (0.0, 0.0)
    assert stats.preemptions == scrape.MAX_COUNTER
    assert stats.block_size is None and stats.num_gpu_blocks is None and stats.sleep_state is None
    assert len(stats.waiting_by_reason) == scrape.MAX_LABEL_KEYS
    assert set(stats.waiting_by_reason.values()) == {scrape.MAX_ENGINE_REQUESTS}
    assert len(stats.running_loras) == scrape.MAX_LISTED and all(len(n) <= 256 for n in stats.running_loras)
    assert stats.max_loras == 0 and stats.kv_offload_bytes == {"gpu_to_cpu": 0.0}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"data": [{"id": "a", "parent": "m"}, {"id": 5, "parent": "m"}, {"id": "b", "parent": 7}]}', {"a"}),
        (b'{"data": [{"id": "' + b"x" * 1000 + b'", "parent": "m"}, {"id": "ok", "parent": "m"}]}', {"ok"}),
        (b'{"data": {"id": "a"}}', None),
        (b"[" * 5000, None),
        (b'{"data": [' + b'{"id": "a", "parent": "m"},' * 3 + b"null, 1, []]}", {"a"}),
    ],
    ids=["non-strings", "long-id", "not-a-list", "deep", "odd-entries"],
)
def test_listed_adapters_of_any_shape(body: bytes, expected: set[str] | None) -> None:
    names = scrape.listed_adapters(body)
    assert names == (None if expected is None else frozenset(expected))


async def test_a_models_listing_past_the_size_bound_is_not_read() -> None:
    discovery = scrape.LoraDiscovery(BackendsSettings(), Clock())
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        entry = '{"id": "a", "parent": "m"},'
        engine.set("/v1/models", 200, '{"data": [' + entry * (scrape.MAX_LISTING_BYTES // len(entry) + 1) + "null]}")
        e = make_endpoint("vllm", engine.base_url)
        assert not await discovery.discover(e, session)
        assert e.loras is None
