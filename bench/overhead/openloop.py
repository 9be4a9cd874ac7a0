"""Open-loop latency probe: requests sent at a fixed rate whatever the answers, latency per request.

Closed-loop load (wrk with N connections) keeps N requests in flight, so its latency is N / RPS:
it measures throughput. The latency a request pays for crossing a proxy is seen at a light, fixed
offered load instead; the same probe hits the upstream directly and through each proxy, so its own
client-side cost cancels in the difference.
"""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp

BODY = (
    b'{"model":"bench-model","messages":[{"role":"system","content":"You are a helpful assistant."},'
    b'{"role":"user","content":"Say hello in one word."}],"max_tokens":8}'
)


async def probe(url: str, key: str, rate_rps: float, duration_s: float) -> list[float]:
    """Latencies (ms) of requests started every 1/rate seconds for `duration_s`."""
    latencies: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        start = time.perf_counter()
        async with session.post(url, data=BODY, headers=headers) as response:
            await response.read()
            if response.status != 200:
                errors += 1
                return
        latencies.append((time.perf_counter() - start) * 1000)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):  # warm the connection pool
            await one(session)
        latencies.clear()
        tasks = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        n = int(rate_rps * duration_s)
        for i in range(n):
            delay = start + i / rate_rps - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    if errors:
        print(f"open-loop probe: {errors} non-200 answers", file=sys.stderr)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    url, key, rate, duration = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    import uvloop

    uvloop.install()
    values = asyncio.run(probe(url, key, rate, duration))
    print(f"{percentile(values, 50):.4f} {percentile(values, 90):.4f} {percentile(values, 99):.4f} {len(values)}")


if __name__ == "__main__":
    main()
