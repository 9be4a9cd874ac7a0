"""Replicas on one host: requests per second with 1, 2 and 4 tokenway replicas sharing one Redis,
with the replicas' shared routing state on and off (the cost of publishing and folding).

    .venv/bin/python -m bench.overhead.replicas [--duration 8] [--connections 64] [--replicas 1,2,4]

Every replica runs `state: redis` with a tenant limit (so each request's admission and settlement
are Redis scripts) over two upstream endpoints (the scoring router weighs them), telemetry, ledger
and predictor off; Debian's haproxy (TCP round robin) spreads wrk's connections over them. The
instant upstream is nginx `return 200`. This machine has two cores shared by everything (replicas,
wrk, haproxy, nginx, Redis): read the on/off ratio at each replica count, not the absolute RPS.
Writes bench/results/overhead-replicas.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.overhead.run import (
    KEY,
    RESULTS,
    TOKENIZE_LOCATION,
    cpu_seconds,
    ensure_tools,
    start_nginx,
    tokenway_config,
)
from gateway.app.settings import ReplicasSettings
from tests.support.haproxy import start_haproxy
from tests.support.procs import _env, free_port, free_ports, http_get, stop_process, wait_http

REPO = Path(__file__).resolve().parents[2]

CORES = "0-1"


@dataclass
class Point:
    replicas: int
    shared: bool
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us_per_request: float
    published: int
    applied: int


def wrk(url: str, connections: int, duration_s: float) -> tuple[float, dict[str, float], int]:
    from bench.overhead.run import parse_wrk

    script = Path(__file__).with_name("post.lua")
    argv = ["taskset", "-c", CORES, "wrk", "-t2", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s",
            str(script), url]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env={**_env(), "TW_BENCH_KEY": KEY}, check=True)
    return parse_wrk(out.stdout)


def run_point(
    workdir: Path, upstream_ports: list[int], n: int, shared: bool, redis_url: str, args: argparse.Namespace
) -> Point:
    prefix = f"tokenway-bench:{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {
        "telemetry": {"metrics": {"enabled": False}},
        "ledger": {"enabled": False},
        "predictor": {"enabled": False},
        "state": {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix},
    }
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(n):
            port = free_port()
            state = {**extra["state"], "replicas": {"share": shared, "id": f"r{i}"}}
            config = tokenway_config(workdir / f"n{n}-{'on' if shared else 'off'}-r{i}", upstream_ports, port,
                                     {**extra, "state": state})  # fmt: skip
            _limits(config.parent / "policies.yaml")
            argv = ["taskset", "-c", CORES, sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve",
                    "--config", str(config)]  # fmt: skip
            procs.append(subprocess.Popen(argv, env=_env(), cwd=REPO))
            ports.append(port)
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=60)
        balancer = start_haproxy(workdir / f"lb-{n}-{shared}", ports)
        try:
            url = balancer.url + "/v1/chat/completions"
            wrk(url, args.connections, args.warmup)
            cpu_before = sum(cpu_seconds(p.pid) for p in procs)
            rps, pct, errors = wrk(url, args.connections, args.duration)
            cpu_us = (sum(cpu_seconds(p.pid) for p in procs) - cpu_before) / max(rps * args.duration, 1) * 1e6
            published = applied = 0
            for port in ports:
                status, text = http_get(f"http://127.0.0.1:{port}/admin/replicas")
                if status == 200 and '"dispatches_published"' in text:
                    import orjson

                    doc = orjson.loads(text)
                    published += int(doc["dispatches_published"])
                    applied += int(doc["dispatches_applied"])
        finally:
            balancer.stop()
    finally:
        for proc in procs:
            stop_process(proc)
        _clean(redis_url, prefix)
    point = Point(n, shared, rps, pct["50"], pct["99"], errors, cpu_us, published, applied)
    print(f"{n} replicas, sharing {'on' if shared else 'off'}: {rps:,.0f} rps p50 {pct['50']:.2f} ms "
          f"errors {errors}", flush=True)  # fmt: skip
    return point


def _limits(policies_path: Path) -> None:
    import yaml

    doc = yaml.safe_load(policies_path.read_text())
    doc["limits"] = [{"scope": "tenant", "rpm": 100_000_000, "tpm": 10_000_000_000, "max_concurrent": 100_000}]
    policies_path.write_text(yaml.safe_dump(doc))


def _clean(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        client.delete(key)


def micro(n: int = 20_000) -> dict[str, float]:
    """In-process CPU µs per dispatch: routing, `on_dispatch` without and with the replicas'
    listener (the hot-path cost of sharing), the publisher's flush (block keys read per dispatch,
    off the request path but on the same loop) and encoding + decoding the batch."""
    from backends.config import PoolConfig
    from backends.fleet import Fleet
    from backends.types import EndpointState
    from gateway.app.settings import ReplicasSettings
    from gateway.replicas.bus import ReplicaBus
    from gateway.replicas.wire import Batch, decode, encode
    from policies.routing.pipeline import build_router
    from policies.routing.types import RouteRequest
    from policies.types import Principal, RequestFacts

    pool_config = {
        "name": "p",
        "model": "m",
        "engine": "vllm",
        "endpoints": [{"url": "http://a:1"}, {"url": "http://b:1"}],
    }
    fleet = Fleet.from_configs([PoolConfig.model_validate(pool_config)])
    for endpoint in fleet.endpoints():
        endpoint.state = EndpointState.READY
    router = build_router()
    bus = ReplicaBus(ReplicasSettings(), "redis://127.0.0.1:6379/0", "micro", fleet, router)
    principal = Principal("k", "t", None, 0, True)
    requests = [
        RouteRequest(
            RequestFacts(f"r{i}", "chat", {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}, "m",
                         "m", principal, prompt_tokens=256, prompt_token_ids=list(range(i, i + 256)))
        )
        for i in range(n)
    ]  # fmt: skip
    pool = fleet.pools["p"]

    def per_call(work: Any) -> float:
        started = time.process_time()
        work()
        return (time.process_time() - started) / n * 1e6

    decisions: list[Any] = []
    out: dict[str, float] = {}
    out["route"] = per_call(lambda: decisions.extend(router.route(r, pool, 0.0) for r in requests))

    def dispatch_all() -> None:
        for r, d in zip(requests, decisions, strict=True):
            router.on_dispatch(r, d)

    out["on_dispatch"] = per_call(dispatch_all)
    router.dispatch_listener = bus.dispatched
    out["on_dispatch + listener"] = per_call(dispatch_all)
    taken: list[Any] = []
    out["flush (keys)"] = per_call(lambda: taken.extend(bus._take_dispatches()))

    def wire() -> None:
        for i in range(0, n, 25):
            decode(encode(Batch("r", i, [("p/both-s0", 1, 2, 3)], taken[i : i + 25])))

    out["encode + decode"] = per_call(wire)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeat", type=int, default=2, help="off/on pairs per replica count (alternating)")
    parser.add_argument("--out", default=str(RESULTS / "overhead-replicas.md"))
    args = parser.parse_args()
    costs = micro()
    print("in-process µs per dispatch:", {k: round(v, 2) for k, v in costs.items()}, flush=True)
    ensure_tools()
    workdir = Path(tempfile.mkdtemp(prefix="tw-replicas-"))
    up1, up2 = free_ports(2)
    upstream = start_nginx(
        workdir,
        "upstream",
        f"""server {{ listen 127.0.0.1:{up1} reuseport; listen 127.0.0.1:{up2} reuseport;
            location = /health {{ return 200 ''; }} {TOKENIZE_LOCATION}
            location / {{ default_type application/json; return 200 '{_completion()}'; }} }}""",
        CORES,
    )
    wait_http(f"http://127.0.0.1:{up1}/health")
    points: list[Point] = []
    started = time.monotonic()
    try:
        points += [
            run_point(workdir, [up1, up2], n, shared, args.redis_url, args)
            for n in (int(x) for x in args.replicas.split(","))
            for _ in range(args.repeat)
            for shared in (False, True)
        ]
    finally:
        upstream.terminate()
        upstream.wait(10)
    write(points, Path(args.out), args, time.monotonic() - started, costs)
    return 0


def _completion() -> str:
    from bench.overhead.run import COMPLETION

    return COMPLETION


def write(points: list[Point], out: Path, args: argparse.Namespace, elapsed_s: float, costs: dict[str, float]) -> None:
    off: dict[int, Point] = {}
    lines = [
        "# Replicas sharing Redis: the cost of shared routing state",
        "",
        f"Generated by `bench/overhead/replicas.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "
        f"{elapsed_s / 60:.1f} min. N tokenway replicas (`state: redis`, a tenant limit: every admit and settle "
        "is a Redis script; two upstream endpoints, so the scoring router and the prefix index work; telemetry, "
        f"ledger and predictor off) behind haproxy (TCP round robin); wrk with {args.connections} connections, "
        f"{args.duration:g} s per point after {args.warmup:g} s of warm-up; instant upstream (nginx). Everything "
        "shares this host's 2 cores, so added replicas compete with wrk, haproxy, nginx and Redis for them: the "
        "columns to read are the on/off ratios at equal replica counts, each `on` row against the `off` run "
        f"just before it (host load average at the end of the run: {os.getloadavg()[0]:.1f} on 2 cores; other "
        "processes' load moves single points by far more than sharing costs, so the pairs are repeated).",
        "",
        "| replicas | shared routing state | RPS | p50 ms | p99 ms | RPS on / off | CPU µs / req (replicas) "
        "| dispatches published | folded by peers | errors |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        if not p.shared:
            off[p.replicas] = p  # each "on" row is compared with the "off" run just before it
        base = off.get(p.replicas)
        ratio = f"{p.rps / base.rps:.2f}" if p.shared and base else "-"
        lines.append(
            f"| {p.replicas} | {'on' if p.shared else 'off'} | {p.rps:,.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} | "
            f"{ratio} | {p.cpu_us_per_request:.0f} | {p.published:,} | {p.applied:,} | {p.errors} |"
        )
    lines += [
        "",
        "## In-process cost per dispatch (CPU µs, one core, no I/O)",
        "",
        "What sharing adds where it runs: the request path pays the listener's append inside `on_dispatch`; "
        "the publisher reads each dispatch's block keys when it flushes (every "
        f"{ReplicasSettings().advanced.publish_interval_ms:g} ms, same event loop, not on any request's path) "
        "and encodes the batch; every peer decodes it. 256-token prompts, two endpoints, the default scoring pipeline.",
        "",
        "| step | µs per dispatch |",
        "| --- | ---: |",
        *(f"| {name} | {value:.2f} |" for name, value in costs.items()),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
