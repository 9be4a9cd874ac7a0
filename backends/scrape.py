"""Metrics scraping: each endpoint's engine metrics, parsed by its adapter into `EndpointStats`.

Every `scrape_interval_s` (250 ms by default: load routing is blind with slow or renamed metrics, as
production-stack's 30 s scrapes in `src/vllm_router/stats/engine_stats.py` were) each READY or
DRAINING endpoint gets one GET, as its own task so a slow engine delays no other and never two at
once. A successful scrape replaces `endpoint.stats` with
`scraped_at_s = now`; a failed one leaves the old stats to age, and stats older than
`stats_max_age_s` count as saturated for routing (`is_stale`). Endpoints whose engine exports no
metrics (remote APIs) are stamped fresh each tick: their load is the gateway's own accounting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from backends import health, lora_discovery
from backends.adapters import get_adapter
from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.health import EndpointTasks
from backends.types import Endpoint, EndpointState, MetricsFormatError

log = logging.getLogger(__name__)

SCRAPED_STATES = frozenset({EndpointState.READY, EndpointState.DRAINING})


def is_stale(endpoint: Endpoint, now_s: float, max_age_s: float) -> bool:
    """True when the endpoint's engine metrics are too old to trust (never scraped counts)."""
    if not get_adapter(endpoint.engine).metrics_paths:
        return False
    return endpoint.stats_age_s(now_s) > max_age_s


class Scraper:
    """Per-endpoint scraping state: which metrics path answers, which scrapes are in flight."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._path_index: dict[str, int] = {}
        self._tasks = EndpointTasks("scrape")
        self._warned: set[str] = set()

    async def scrape(self, endpoint: Endpoint, session: aiohttp.ClientSession) -> bool:
        """One scrape of one endpoint; True when its stats were updated."""
        adapter = get_adapter(endpoint.engine)
        paths = adapter.metrics_paths
        if not paths:
            endpoint.stats.scraped_at_s = self.clock()
            return True
        index = self._path_index.get(endpoint.id, 0)
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            async with session.get(endpoint.base_url + paths[index], timeout=timeout) as response:
                body = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("scrape %s: %r", endpoint.id, exc)
            return False
        if status == 404 and index + 1 < len(paths):
            self._path_index[endpoint.id] = index + 1  # an older build: try the next path next time
            return False
        if status != 200:
            return False
        try:
            stats = adapter.parse_metrics(body, endpoint.stats)
        except (MetricsFormatError, UnicodeDecodeError) as exc:
            if endpoint.id not in self._warned:
                self._warned.add(endpoint.id)
                log.warning("endpoint %s: unusable metrics at %s: %s", endpoint.id, paths[index], exc)
            return False
        stats.scraped_at_s = self.clock()
        endpoint.stats = stats
        endpoint.inflight.scraped()
        return True

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        for endpoint in fleet.endpoints():
            if endpoint.state not in SCRAPED_STATES or self._tasks.busy(endpoint.id):
                continue
            self._tasks.start(endpoint.id, self.scrape(endpoint, session))

    async def close(self) -> None:
        await self._tasks.close()


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Scrape every endpoint's metrics every `settings.scrape_interval_s` until cancelled."""
    scraper = Scraper(settings, clock)
    try:
        while True:
            scraper.tick(fleet, session)
            await asyncio.sleep(settings.scrape_interval_s)
    finally:
        await scraper.close()


async def watch(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The fleet's background watch, as one task to start: active health checks, metrics scraping and
    the LoRA adapters each engine lists (`lora_discovery.py`) until cancelled. The gateway creates the
    upstream `ClientSession` and runs it for its lifetime (cancelling it stops the loops); the relay
    feeds passive health through `backends.health.report_success` / `report_failure`."""
    async with asyncio.TaskGroup() as group:
        group.create_task(health.run(fleet, session, settings, clock), name="backends health")
        group.create_task(run(fleet, session, settings, clock), name="backends scrape")
        group.create_task(lora_discovery.run(fleet, session, settings, clock), name="backends lora discovery")
