"""Probe: the gateway's memory under hostile client strings.

50,000 requests, each with a random `x-request-id`, a random `x-session-id` and a 100 KB random
`user`, against fast simulated engines. The gateway's RSS is sampled as they go: every table keyed by
client input is bounded (docs/security.md), so after a warm-up it must level off instead of growing
with the requests.
"""

from __future__ import annotations

import asyncio
import os
import random
import string
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.chaos.common import KEY, MODEL, policies, running, start_stack

USER_BYTES = 100 * 1024


async def _load(url: str, total: int, concurrency: int, on_progress: Any) -> dict[int, int]:
    statuses: dict[int, int] = {}
    alphabet = string.ascii_letters + string.digits
    blob = "".join(random.choice(alphabet) for _ in range(USER_BYTES + 4096))
    counter = iter(range(total))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def worker() -> None:
            for n in counter:
                start = random.randrange(4096)
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                    "user": blob[start : start + USER_BYTES - 36] + uuid.uuid4().hex,
                }
                headers = {
                    "Authorization": f"Bearer {KEY}",
                    "x-request-id": uuid.uuid4().hex + uuid.uuid4().hex,
                    "x-session-id": uuid.uuid4().hex,
                }
                try:
                    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
                        await response.read()
                        statuses[response.status] = statuses.get(response.status, 0) + 1
                except aiohttp.ClientError:
                    statuses[0] = statuses.get(0, 0) + 1
                if n % 1000 == 999:
                    on_progress(n + 1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def run(workdir: Path, *, total: int = 50_000, concurrency: int = 32, warmup: int = 2_000) -> dict[str, Any]:
    stack = start_stack(
        workdir,
        engines=2,
        time_scale=100.0,
        policy=policies([]),
    )
    samples: list[tuple[int, int]] = []
    started = time.monotonic()
    with running(stack):
        asyncio.run(_load(stack.gateway.url, warmup, concurrency, lambda n: None))
        samples.append((0, stack.rss_bytes()))

        def progress(n: int) -> None:
            if n % 5000 == 0:
                samples.append((n, stack.rss_bytes()))

        statuses = asyncio.run(_load(stack.gateway.url, total, concurrency, progress))
        samples.append((total, stack.rss_bytes()))
    rss0 = samples[0][1]
    half = [rss for n, rss in samples if n >= total // 2]
    return {
        "requests": total,
        "statuses": statuses,
        "rss_start_mb": rss0 / 2**20,
        "rss_end_mb": samples[-1][1] / 2**20,
        "growth_mb": (samples[-1][1] - rss0) / 2**20,
        "growth_second_half_mb": (half[-1] - half[0]) / 2**20 if half else 0.0,
        "samples": [(n, rss / 2**20) for n, rss in samples],
        "seconds": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }
