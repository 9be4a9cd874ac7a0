"""The fleet's watch (`backends.scrape.watch`): health checks and scraping together, on the session the
gateway passes in."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from backends import scrape
from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.types import EndpointState
from tests.backends.builders import fixture_text, pool
from tests.backends.fake_engine import fake_engine
from tests.support.polling import wait_for_async


async def test_static_endpoint_becomes_ready_and_gets_scraped() -> None:
    settings = BackendsSettings(health_interval_s=0.05, scrape_interval_s=0.02)
    async with fake_engine() as engine, aiohttp.ClientSession() as session:
        engine.set("/health", 200)
        engine.set("/metrics", 200, fixture_text("vllm_0_33_metrics.txt"))
        fleet = Fleet.from_configs([pool(name="p", engine="vllm", endpoints=[{"url": engine.base_url}])])
        endpoint = fleet.pools["p"].endpoints[0]
        task = asyncio.create_task(scrape.watch(fleet, session, settings))
        try:
            await wait_for_async(lambda: endpoint.state is EndpointState.READY, what="ready")
            await wait_for_async(lambda: endpoint.stats.running == 12, what="a scrape")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
