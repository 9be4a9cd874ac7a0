"""The fleet's background watch: active health checks and metrics scraping, as one task to start.

The gateway creates the upstream `ClientSession` and runs `run(fleet, session, settings)` as a task
for its lifetime (cancelling it stops both loops); the relay feeds passive health through
`backends.health.report_success` / `report_failure`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from backends import health, scrape
from backends.config import BackendsSettings
from backends.fleet import Fleet


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Health checks and scraping until cancelled."""
    async with asyncio.TaskGroup() as group:
        group.create_task(health.run(fleet, session, settings, clock), name="backends health")
        group.create_task(scrape.run(fleet, session, settings, clock), name="backends scrape")
