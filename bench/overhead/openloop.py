"""Latency probes: what one request pays for crossing a proxy, without wrk's queueing.

    python -m bench.overhead.openloop URL KEY RATE DURATION_S
    python -m bench.overhead.openloop --sequential URL KEY REQUESTS

Closed-loop load (wrk with N connections) keeps N requests in flight, so its latency is N / RPS:
it measures throughput. Two probes measure the crossing itself; each hits the upstream directly and
through each proxy, so its own client-side cost cancels in the difference:

- open loop: requests start at a fixed, light rate whatever the answers (the proxy sits idle between
  them, so each request also pays for waking it). The schedule is the benchmarks' open loop
  (`bench.loadgen.open_loop`); the request is not theirs: a tiny unary chat completion timed to its
  last byte, with nothing parsed, since only the difference with and without a proxy counts;
- sequential: one connection, each request sent the moment the previous answer arrived, from a
  raw-socket client (the path's own latency: no queueing, no idle wake-ups, ~no client cost).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from urllib.parse import urlsplit

import aiohttp

from bench.loadgen import open_loop

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
        n = int(rate_rps * duration_s)
        await open_loop([i / rate_rps for i in range(n)], lambda _: one(session))
    if errors:
        print(f"open-loop probe: {errors} non-200 answers", file=sys.stderr)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def sequential(url: str, key: str, requests: int, warmup: int = 300) -> list[float]:
    """Latencies (ms) of `requests` requests sent one after another on one keep-alive connection."""
    parts = urlsplit(url)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    )
    request = head.encode() + BODY
    latencies: list[float] = []
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warmup + requests):
            start = time.perf_counter()
            sock.sendall(request)
            answer = b""
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection")
                answer += data
                end = answer.find(b"\r\n\r\n")
                if end < 0:
                    continue
                fields = answer[:end].lower()
                if not fields.startswith(b"http/1.1 200"):
                    raise ConnectionError(f"answer {fields[:40]!r}")
                at = fields.find(b"content-length:")
                if len(answer) >= end + 4 + int(fields[at + 15 :].split(b"\r\n", 1)[0]):
                    break
            if i >= warmup:
                latencies.append((time.perf_counter() - start) * 1000)
    return latencies


def main() -> None:
    if sys.argv[1] == "--sequential":
        values = sequential(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        print(f"{percentile(values, 50):.4f} {percentile(values, 90):.4f} {percentile(values, 99):.4f} {len(values)}")
        return
    url, key, rate, duration = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    import uvloop

    uvloop.install()
    values = asyncio.run(probe(url, key, rate, duration))
    print(f"{percentile(values, 50):.4f} {percentile(values, 90):.4f} {percentile(values, 99):.4f} {len(values)}")


if __name__ == "__main__":
    main()
