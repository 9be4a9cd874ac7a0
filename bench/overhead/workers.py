"""`tokenway serve --workers N` on one host: requests per second and CPU per request with 1 and 2
workers, and the accuracy of a limit the workers share at 3x overload.

    .venv/bin/python -m bench.overhead.workers [--duration 8] [--connections 64] [--repeat 2]

Each point starts `tokenway serve --workers N` with `state: memory` (so N = 1 is the ordinary single
process with limits in memory, and N = 2 is the group: two workers on one port with SO_REUSEPORT and
the group's private Redis on a Unix socket), a tenant limit (every request's admission and settlement
go through the limiter), telemetry, ledger and predictor off, two endpoints of an instant upstream
(nginx `return 200`). wrk connects straight to the port: the kernel spreads its connections over the
workers. Throughput and the group's CPU seconds (parent, workers, private Redis, from /proc) are
measured over the same window, N = 1 and N = 2 alternating, `--repeat` pairs.

Accuracy: a key limited to `--rpm` requests per minute; its bucket is first emptied (requests until the
first 429), then requests arrive open-loop at 3x the limit's rate for `--accuracy-duration` seconds,
each on a new connection (so every worker receives its share); every request admitted from the first
429 on is refill, so the ideal is exactly rpm x window / 60 (the method of bench/limiter/accuracy.py).

This machine has two cores, shared by the workers, the private Redis, nginx and the load generators
(wrk, and this script's open loop): N = 2 cannot double anything here. Read CPU per request (what a
request costs the gateway, whatever the core count) and the ratios, not the absolute RPS.
Writes bench/results/workers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.overhead.run import (
    COMPLETION,
    KEY,
    RESULTS,
    TOKENIZE_LOCATION,
    cpu_seconds,
    ensure_tools,
    parse_wrk,
    start_nginx,
    tokenway_config,
)
from tests.support.procs import _env, free_port, free_ports, wait_http

REPO = Path(__file__).resolve().parents[2]
CORES = "0-1"
OVERLOAD = 3.0


@dataclass
class Point:
    workers: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float
    requests: float

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / max(self.requests, 1.0) * 1e6


@dataclass
class Accuracy:
    workers: int
    rpm: int
    window_s: float
    offered: int
    admitted: int
    rejected: int
    other: int
    answered_by: int
    run_s: float  # from the first request sent to the last arrival
    admitted_in_run: int  # every request admitted, the burst included

    @property
    def ratio(self) -> float:
        return (self.admitted / self.window_s * 60.0) / self.rpm

    @property
    def ratio_in_run(self) -> float:
        """Admitted over the whole run / (a full bucket + refill over the run): no start to detect."""
        return self.admitted_in_run / (self.rpm + self.rpm / 60.0 * self.run_s)


def wrk(url: str, connections: int, duration_s: float) -> tuple[float, dict[str, float], int]:
    script = Path(__file__).with_name("post.lua")
    argv = ["taskset", "-c", CORES, "wrk", "-t2", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s",
            str(script), url]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env={**_env(), "TW_BENCH_KEY": KEY}, check=True)
    return parse_wrk(out.stdout)


def start_group(workdir: Path, upstream: list[int], workers: int, limits: list[dict[str, Any]]) -> tuple[Any, int]:
    port = free_port()
    extra: dict[str, Any] = {
        "telemetry": {"metrics": {"enabled": False}},
        "ledger": {"enabled": False},
        "predictor": {"enabled": False},
        "state": {"backend": "memory", "keys_db": None},
        "server": {"workers": workers, "drain_timeout_s": 2},
    }
    config = tokenway_config(workdir, upstream, port, extra)
    policies = yaml.safe_load((config.parent / "policies.yaml").read_text())
    policies["limits"] = limits
    (config.parent / "policies.yaml").write_text(yaml.safe_dump(policies))
    argv = ["taskset", "-c", CORES, sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve",
            "--config", str(config)]  # fmt: skip
    proc = subprocess.Popen(argv, env=_env(), cwd=workdir, stdout=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90, proc=proc)
        wait_for_workers(port, workers)
    except BaseException:
        stop_group(proc)
        raise
    return proc, port


def wait_for_workers(port: int, workers: int, timeout_s: float = 90.0) -> None:
    """Until every worker has answered (each names itself in `x-tokenway-replica`): a load that starts
    while one is still starting measures fewer workers than the point says."""
    if workers == 1:
        return
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {workers} workers answered within {timeout_s:g} s")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:  # a new connection
                seen.add(reply.headers.get("x-tokenway-replica", ""))
        except urllib.error.HTTPError:  # 503: that worker's first health probes are still out
            time.sleep(0.05)


def stop_group(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def group_cpu_s(pid: int) -> float:
    return cpu_seconds(pid)  # the process and its children: the workers and the private Redis


def throughput(workdir: Path, upstream: list[int], workers: int, args: argparse.Namespace) -> Point:
    limits = [{"scope": "tenant", "rpm": 100_000_000, "tpm": 10_000_000_000, "max_concurrent": 100_000}]
    proc, port = start_group(workdir, upstream, workers, limits)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        wrk(url, args.connections, args.warmup)
        before = group_cpu_s(proc.pid)
        rps, pct, errors = wrk(url, args.connections, args.duration)
        cpu_s = group_cpu_s(proc.pid) - before
    finally:
        stop_group(proc)
    point = Point(workers, rps, pct["50"], pct["99"], errors, cpu_s, rps * args.duration)
    print(f"{workers} worker(s): {rps:,.0f} rps, {point.cpu_us_per_request:.0f} CPU µs/request, errors {errors}",
          flush=True)  # fmt: skip
    return point


async def _post(session: aiohttp.ClientSession, url: str) -> tuple[int, str, float]:
    body = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as reply:
        await reply.read()
        return reply.status, reply.headers.get("x-tokenway-replica", ""), time.monotonic()


async def _accuracy_run(url: str, rpm: int, duration_s: float) -> tuple[float, int, int, int, int, int, float, int]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)  # a new connection per request
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        first_429: float | None = None
        first_sent = time.monotonic()
        burst_admitted = 0
        while first_429 is None:  # empty the bucket: the burst a full minute allows
            replies = await asyncio.gather(*(_post(session, url) for _ in range(32)))
            burst_admitted += sum(1 for status, _, _ in replies if status == 200)
            rejected = [t for status, _, t in replies if status == 429]
            if rejected:
                first_429 = min(rejected)
        rate = OVERLOAD * rpm / 60.0
        started = time.monotonic()
        tasks: list[asyncio.Task[tuple[int, str, float]]] = []
        n = 0
        while (due := started + n / rate) < started + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.ensure_future(_post(session, url)))
            n += 1
        ended = time.monotonic()
        results = await asyncio.gather(*tasks)
    window_s = ended - first_429
    admitted = sum(1 for status, _, _ in results if status == 200)
    rejected_n = sum(1 for status, _, _ in results if status == 429)
    other = len(results) - admitted - rejected_n
    workers = len({worker for _, worker, _ in results if worker})
    return window_s, len(results), admitted, rejected_n, other, workers, ended - first_sent, burst_admitted + admitted


def accuracy(workdir: Path, upstream: list[int], workers: int, args: argparse.Namespace) -> Accuracy:
    limits = [{"scope": "key", "rpm": args.rpm}]
    proc, port = start_group(workdir, upstream, workers, limits)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        window_s, offered, admitted, rejected, other, answered, run_s, in_run = asyncio.run(
            _accuracy_run(url, args.rpm, args.accuracy_duration)
        )
    finally:
        stop_group(proc)
    result = Accuracy(workers, args.rpm, window_s, offered, admitted, rejected, other, answered, run_s, in_run)
    print(f"{workers} worker(s): admitted {admitted} of {offered} in {window_s:.1f} s: {result.ratio:.4f} of the limit",
          flush=True)  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="N = 1 / N = 2 pairs (alternating)")
    parser.add_argument("--rpm", type=int, default=1200, help="the accuracy run's limit")
    parser.add_argument("--accuracy-duration", type=float, default=30.0)
    parser.add_argument("--out", default=str(RESULTS / "workers.md"))
    args = parser.parse_args()
    ensure_tools()
    workdir = Path(tempfile.mkdtemp(prefix="tw-workers-"))
    up1, up2 = free_ports(2)
    upstream = start_nginx(
        workdir,
        "upstream",
        f"""server {{ listen 127.0.0.1:{up1} reuseport; listen 127.0.0.1:{up2} reuseport;
            location = /health {{ return 200 ''; }} {TOKENIZE_LOCATION}
            location / {{ default_type application/json; return 200 '{COMPLETION}'; }} }}""",
        CORES,
    )
    wait_http(f"http://127.0.0.1:{up1}/health")
    started = time.monotonic()
    points: list[Point] = []
    accuracies: list[Accuracy] = []
    try:
        points += [
            throughput(workdir / f"rps-{n}-{r}", [up1, up2], n, args) for r in range(args.repeat) for n in (1, 2)
        ]
        accuracies += [accuracy(workdir / f"acc-{n}", [up1, up2], n, args) for n in (1, 2)]
    finally:
        upstream.terminate()
        upstream.wait(10)
    write(points, accuracies, Path(args.out), args, time.monotonic() - started)
    return 0


def write(
    points: list[Point], accuracies: list[Accuracy], out: Path, args: argparse.Namespace, elapsed_s: float
) -> None:
    ones = [p for p in points if p.workers == 1]
    twos = [p for p in points if p.workers == 2]

    def mean(values: list[float]) -> float:
        return sum(values) / max(len(values), 1)

    rps1, rps2 = mean([p.rps for p in ones]), mean([p.rps for p in twos])
    cpu1, cpu2 = mean([p.cpu_us_per_request for p in ones]), mean([p.cpu_us_per_request for p in twos])
    lines = [
        "# Workers: `tokenway serve --workers N` on one host",
        "",
        f"Generated by `bench/overhead/workers.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "
        f"{elapsed_s / 60:.1f} min, on a host with {os.cpu_count()} cores (load average at the end: "
        f"{os.getloadavg()[0]:.1f}). `state: memory` in both: N = 1 is one process with limits in memory, N = 2 "
        "two workers on one port (SO_REUSEPORT) sharing the group's private Redis (Unix socket). A tenant limit "
        "(every request is admitted and settled by the limiter), telemetry, ledger and predictor off, an instant "
        f"upstream (nginx). wrk, {args.connections} connections straight to the port, {args.duration:g} s per "
        f"point after {args.warmup:g} s of warm-up, N = 1 and N = 2 alternating. CPU is the group's (parent, "
        "workers, private Redis) over the measured window, from /proc.",
        "",
        "**Read with care:** the two cores also run wrk, nginx and (for the accuracy runs) the load generator; "
        "a second worker competes with them rather than getting a core of its own, so the >= 0.8 x N scaling "
        "the issue asks for cannot be shown on this machine. CPU per request is the number that carries over.",
        "",
        "| workers | RPS | p50 ms | p99 ms | CPU µs / request (group) | errors |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {p.workers} | {p.rps:,.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} | {p.cpu_us_per_request:.0f} | "
            f"{p.errors} |"
            for p in points
        ),
        "",
        f"Mean: N = 2 serves {rps2 / rps1:.2f}x N = 1's requests per second (the issue's bar on N dedicated cores: "
        f">= {0.8 * 2:.1f}x) at {cpu2 / cpu1:.2f}x its CPU per request ({cpu1:.0f} vs {cpu2:.0f} µs): the "
        "difference is the shared state (each admission and settlement a Redis script over a Unix socket, plus "
        "the private Redis's own CPU) and the shared routing state's publishing.",
        "",
        f"## A shared limit at {OVERLOAD:g}x overload",
        "",
        f"A key limited to {args.rpm} requests per minute, its bucket emptied first, then {OVERLOAD:g}x its rate "
        f"open-loop for {args.accuracy_duration:g} s, a new connection per request. Target: within 1 %. Two "
        "readings: *after the first 429* counts the open loop's admissions over the time from the first 429 "
        "(ideal: refill only, the limit per minute); that start is the client's guess of when the bucket ran "
        "empty, and a worker's precheck (a 429 from its own copy of the bucket before the prompt is counted, "
        "policies/limits/admission.py) can answer the first 429 a little before Redis's bucket is empty, so "
        "this reading can count a few requests of burst as refill. *Whole run* needs no start: every request "
        "admitted from the first one sent, over a full bucket plus refill over the run.",
        "",
        "| workers | limit rpm | offered (open loop) | admitted | 429 | other | workers that answered | "
        "after the first 429: admitted / limit | whole run: admitted / (bucket + refill) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {a.workers} | {a.rpm} | {a.offered} | {a.admitted} in {a.window_s:.1f} s | {a.rejected} | {a.other} | "
            f"{a.answered_by or 1} | {a.ratio:.4f} | {a.ratio_in_run:.4f} ({a.admitted_in_run} in {a.run_s:.1f} s) |"
            for a in accuracies
        ),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
