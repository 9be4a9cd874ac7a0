"""Gateway overhead benchmark: tokenway vs a bare aiohttp pass-through vs nginx proxy_pass.

One command runs everything in one go on this machine: an instant upstream (nginx `return 200` with
a fixed chat completion), then each proxy in turn, pinned to core 0, with wrk on core 1 at several
connection counts. Added latency = proxy percentile - direct-to-upstream percentile at the same
connection count. Results go to bench/results/overhead.md and overhead.png.

    .venv/bin/python -m bench.overhead.run [--duration 8] [--connections 8,32,128]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.notes import plot_line
from policies.policy import hash_key
from tests.support.procs import free_port, free_ports, http_get, wait_http

REPO = Path(__file__).resolve().parents[2]

RESULTS = REPO / "bench" / "results"
KEY = "sk-bench-0000"
COMPLETION = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-model",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":24,"completion_tokens":2,"total_tokens":26}}'
)
# vLLM's POST /tokenize (docs/engines.md): the gateway counts a vLLM pool's prompts with it and caches the
# answer per prompt. Without it the instant upstream's 200 (a chat completion, no `tokens`) is an error
# never cached, and every request would pay a second upstream round trip a real engine does not cost.
TOKENIZE = '{"count":24,"max_model_len":8192,"tokens":[' + ",".join(str(i) for i in range(1, 25)) + "]}"
TOKENIZE_LOCATION = f"location = /tokenize {{ default_type application/json; return 200 '{TOKENIZE}'; }}"
PROXY_CORE, LOAD_CORE = "0", "1"
ENDPOINTS = "_endpoints"  # a variant's number of upstream endpoints (ports of the same instant upstream)


def ensure_tools() -> None:
    tools = ("nginx", "wrk", "taskset")
    missing = [t for t in tools if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        print(f"installing {missing} from Debian", flush=True)
        packages = [{"nginx": "nginx", "wrk": "wrk", "taskset": "util-linux"}[m] for m in missing]
        subprocess.run(
            ["apt-get", "install", "-y", "-q", *packages],
            check=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            stdout=subprocess.DEVNULL,
        )


def nginx_bin() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


def start_nginx(workdir: Path, name: str, server_block: str, core: str) -> subprocess.Popen[bytes]:
    prefix = workdir / name
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body; proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fcgi; uwsgi_temp_path {prefix}/uwsgi; scgi_temp_path {prefix}/scgi;
  keepalive_requests 1000000;
  {server_block}
}}
"""
    )
    return subprocess.Popen(["taskset", "-c", core, nginx_bin(), "-p", str(prefix), "-c", str(conf)])


@dataclass
class Run:
    target: str
    connections: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    cpu_us_per_request: float = float("nan")


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (nginx's workers), from /proc."""
    total = 0.0
    pids = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                pids.append(int(entry.name))
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * _TICK_S
    return total


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def parse_wrk(text: str) -> tuple[float, dict[str, float], int]:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    percentiles = {}
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M):
        percentiles[pct] = float(value) * _UNIT[unit]
    errors = 0
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if non2xx:
        errors += int(non2xx.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    return rps, percentiles, errors


def openloop(url: str, rate_rps: float, duration_s: float) -> tuple[float, float, float]:
    """(p50, p90, p99) ms of the open-loop probe at a fixed offered load, run on the load core."""
    argv = [
        "taskset",
        "-c",
        LOAD_CORE,
        sys.executable,
        "-m",
        "bench.overhead.openloop",
        url,
        KEY,
        str(rate_rps),
        str(duration_s),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    p50, p90, p99, _ = out.stdout.split()
    return float(p50), float(p90), float(p99)


def sequential(url: str, requests: int) -> tuple[float, float, float]:
    """(p50, p90, p99) ms of one request at a time on one connection, from the load core."""
    argv = [
        "taskset",
        "-c",
        LOAD_CORE,
        sys.executable,
        "-m",
        "bench.overhead.openloop",
        "--sequential",
        url,
        KEY,
        str(requests),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    p50, p90, p99, _ = out.stdout.split()
    return float(p50), float(p90), float(p99)


def wrk(url: str, connections: int, duration_s: float, tags: str = "") -> tuple[float, dict[str, float], int]:
    script = Path(__file__).with_name("post.lua")
    argv = [
        "taskset",
        "-c",
        LOAD_CORE,
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{duration_s:g}s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    env = {**os.environ, "TW_BENCH_KEY": KEY, **({"TW_BENCH_TAGS": tags} if tags else {})}  # tags: x-tokenway-tags
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    return parse_wrk(out.stdout)


@dataclass
class Target:
    name: str
    start: Callable[[], subprocess.Popen[Any]]
    port: int
    proc: subprocess.Popen[Any] | None = field(default=None, repr=False)


def tokenway_config(workdir: Path, upstream_ports: list[int], port: int, extra: dict[str, Any]) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    policies = {
        "tenants": {"bench": {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {"bench-model": {}},
    }
    (workdir / "policies.yaml").write_text(yaml.safe_dump(policies))
    config = {
        "server": {"host": "127.0.0.1", "port": port, **extra.get("server", {})},
        "policies": "policies.yaml",
        "pools": [
            {
                "name": "instant",
                "model": "bench-model",
                "engine": "vllm",
                "endpoints": [{"url": f"http://127.0.0.1:{p}"} for p in upstream_ports],
            }
        ],
        **{k: v for k, v in extra.items() if k != "server"},
    }
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def tokenway_variants(otlp_url: str) -> dict[str, dict[str, Any]]:
    """Tokenway configurations compared in one run (name -> extra gateway.yaml sections)."""
    off = {"telemetry": {"metrics": {"enabled": False}}, "ledger": {"enabled": False}, "predictor": {"enabled": False}}
    return {
        "tokenway (auth, telemetry off)": off,
        "tokenway (auth, telemetry off, Python's default GC)": {**off, "server": {"gc_young_threshold": 0}},
        "tokenway (+ metrics)": {**off, "telemetry": {"metrics": {"enabled": True}}},
        "tokenway (+ metrics, ledger)": {**off, "telemetry": {"metrics": {"enabled": True}}, "ledger": {}},
        "tokenway (+ metrics, ledger, predictor)": {"telemetry": {"metrics": {"enabled": True}}},
        # two upstream endpoints: the scoring router (prefix index, load gate, scorers, picker) does real work
        "tokenway (+ metrics, ledger, predictor, 2 endpoints)": {
            "telemetry": {"metrics": {"enabled": True}},
            ENDPOINTS: 2,
        },
        "tokenway (+ metrics, ledger, predictor, tracing 100%)": {
            "telemetry": {"metrics": {"enabled": True}, "otlp": {"endpoint": otlp_url, "sample_ratio": 1.0}},
        },
    }


def start_otlp_sink(port: int) -> subprocess.Popen[bytes]:
    """A local OTLP/HTTP receiver that accepts and discards (the collector's cost is not ours)."""
    code = (
        "import sys\nfrom aiohttp import web\n"
        "async def ok(request):\n    await request.read()\n"
        "    return web.Response(content_type='application/x-protobuf')\n"
        "app = web.Application(client_max_size=64 * 1024 * 1024)\n"
        "app.router.add_post('/v1/traces', ok)\napp.router.add_post('/v1/metrics', ok)\n"
        "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None, access_log=None)\n"
    )
    return subprocess.Popen(["taskset", "-c", LOAD_CORE, sys.executable, "-c", code, str(port)])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", default="8,32,128")
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"))
    parser.add_argument("--probe-rate", type=float, default=200.0, help="open-loop requests per second")
    parser.add_argument("--probe-duration", type=float, default=5.0)
    parser.add_argument("--sequential", type=int, default=3000, help="requests of the one-at-a-time probe")
    parser.add_argument("--only", default="", help="regex: run only the targets whose name matches (and direct)")
    args = parser.parse_args()
    connections = [int(c) for c in args.connections.split(",")]
    ensure_tools()
    workdir = Path(tempfile.mkdtemp(prefix="tw-overhead-"))
    upstream_port, second_port = free_ports(2)
    upstream = start_nginx(
        workdir,
        "upstream",
        f"""server {{ listen 127.0.0.1:{upstream_port} reuseport; listen 127.0.0.1:{second_port} reuseport;
            location = /health {{ return 200 ''; }} {TOKENIZE_LOCATION}
            location / {{ default_type application/json; return 200 '{COMPLETION}'; }} }}""",
        LOAD_CORE,
    )
    wait_http(f"http://127.0.0.1:{upstream_port}/health")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    targets: list[Target] = []

    p = free_port()
    targets.append(
        Target(
            "bare aiohttp pass-through",
            lambda p=p: subprocess.Popen(  # type: ignore[misc]
                [
                    "taskset",
                    "-c",
                    PROXY_CORE,
                    sys.executable,
                    # As a module: run as a script, this folder would come first on sys.path and its
                    # tokenize.py would shadow the standard library's.
                    "-m",
                    "bench.overhead.passthrough",
                    str(p),
                    f"http://127.0.0.1:{upstream_port}",
                ],
                env=env,
            ),
            p,
        )
    )
    p = free_port()
    targets.append(
        Target(
            "nginx proxy_pass",
            lambda p=p: start_nginx(  # type: ignore[misc]
                workdir,
                "proxy",
                f"""upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 512; }}
            server {{ listen 127.0.0.1:{p}; location / {{ proxy_pass http://up; proxy_http_version 1.1;
            proxy_set_header Connection ""; }} }}""",
                PROXY_CORE,
            ),
            p,
        )
    )
    otlp_port = free_port()
    otlp_sink = start_otlp_sink(otlp_port)
    for name, extra in tokenway_variants(f"http://127.0.0.1:{otlp_port}").items():
        p = free_port()
        ports = [upstream_port, second_port][: extra.pop(ENDPOINTS, 1)]
        config = tokenway_config(workdir / re.sub(r"\W+", "-", name), ports, p, extra)
        targets.append(
            Target(
                name,
                lambda c=config: subprocess.Popen(  # type: ignore[misc]
                    [
                        "taskset",
                        "-c",
                        PROXY_CORE,
                        sys.executable,
                        "-m",
                        "gateway.app.cli",
                        "--log-level",
                        "WARNING",
                        "serve",
                        "--config",
                        str(c),
                    ],
                    env=env,
                    cwd=REPO,
                ),
                p,
            )
        )

    if args.only:
        targets = [t for t in targets if re.search(args.only, t.name)]
    runs: list[Run] = []
    probes: dict[str, tuple[float, float, float]] = {}
    one_by_one: dict[str, tuple[float, float, float]] = {}
    try:
        direct_url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        probes["direct (no proxy)"] = openloop(direct_url, args.probe_rate, args.probe_duration)
        one_by_one["direct (no proxy)"] = sequential(direct_url, args.sequential)
        for c in connections:
            wrk(f"http://127.0.0.1:{upstream_port}/v1/chat/completions", c, args.warmup)
            rps, pct, errors = wrk(f"http://127.0.0.1:{upstream_port}/v1/chat/completions", c, args.duration)
            runs.append(Run("direct (no proxy)", c, rps, pct["50"], pct["90"], pct["99"], errors))
            print(f"direct c={c}: {rps:,.0f} rps p50={pct['50']:.3f}ms", flush=True)
        for target in targets:
            target.proc = target.start()
            url = f"http://127.0.0.1:{target.port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                status, _ = http_get(url + "/readyz" if target.name.startswith("tokenway") else url + "/health")
                if status == 200 or (status and not target.name.startswith("tokenway")):
                    break
                time.sleep(0.1)
            for c in connections:
                wrk(url + "/v1/chat/completions", c, args.warmup)
                cpu_before = cpu_seconds(target.proc.pid)
                rps, pct, errors = wrk(url + "/v1/chat/completions", c, args.duration)
                cpu_us = (cpu_seconds(target.proc.pid) - cpu_before) / max(rps * args.duration, 1) * 1e6
                runs.append(Run(target.name, c, rps, pct["50"], pct["90"], pct["99"], errors, cpu_us))
                print(f"{target.name} c={c}: {rps:,.0f} rps p50={pct['50']:.3f}ms errors={errors}", flush=True)
            probes[target.name] = openloop(url + "/v1/chat/completions", args.probe_rate, args.probe_duration)
            print(f"{target.name} open-loop: p50={probes[target.name][0]:.3f}ms", flush=True)
            one_by_one[target.name] = sequential(url + "/v1/chat/completions", args.sequential)
            print(f"{target.name} sequential: p50={one_by_one[target.name][0]:.3f}ms", flush=True)
            target.proc.terminate()
            target.proc.wait(10)
            target.proc = None
    finally:
        for target in targets:
            if target.proc is not None:
                target.proc.kill()
        upstream.terminate()
        upstream.wait(10)
        otlp_sink.terminate()
        otlp_sink.wait(10)
    write_results(runs, connections, Path(args.out), args.duration, probes, args.probe_rate, one_by_one)
    return 0


def write_results(
    runs: list[Run],
    connections: list[int],
    out: Path,
    duration_s: float,
    probes: dict[str, tuple[float, float, float]],
    probe_rate: float,
    one_by_one: dict[str, tuple[float, float, float]],
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    direct = {r.connections: r for r in runs if r.target == "direct (no proxy)"}
    bare = {r.connections: r for r in runs if r.target == "bare aiohttp pass-through"}
    lines = [
        "# Gateway overhead",
        "",
        f"Generated by `python -m bench.overhead.run` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"Each proxy is one process pinned to core {PROXY_CORE}; wrk (1 thread) and the instant upstream "
        f"(nginx `return 200`, fixed chat completion) share core {LOAD_CORE}; {duration_s:g} s per point after "
        "a warm-up. Added latency = proxy percentile - direct-to-upstream percentile at the same connection count. "
        "tokenway runs with API-key auth, token estimation, routing and accounting on, over one upstream endpoint "
        "unless the row says 2 (then the scoring router weighs two).",
        "",
        "| target | conns | RPS | p50 ms | p99 ms | added p50 ms | added p99 ms | RPS vs bare | CPU µs / req "
        "| errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        d = direct.get(r.connections)
        b = bare.get(r.connections)
        added50 = r.p50_ms - d.p50_ms if d else float("nan")
        added99 = r.p99_ms - d.p99_ms if d else float("nan")
        ratio = f"{r.rps / b.rps:.2f}" if b and r.target != "direct (no proxy)" else "-"
        lines.append(
            f"| {r.target} | {r.connections} | {r.rps:,.0f} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | "
            f"{added50:.3f} | {added99:.3f} | {ratio} | {r.cpu_us_per_request:.0f} | {r.errors} |"
        )
    d8 = direct.get(8)
    if d8 is not None:
        need = 8 / ((0.5 + d8.p50_ms) / 1000)
        lines += [
            "",
            f"Closed-loop p50 is bound by Little's law: with 8 requests always in flight, p50 ≈ 8 / RPS, so 0.5 ms "
            f"added at 8 connections takes ≥ {need:,.0f} RPS from one core (nginx's class). Python servers on one "
            "core serve a few thousand (the bare pass-through included), so their closed-loop added latency at 8 "
            "connections is mostly the queue of the 7 other requests; the probes below measure the crossing itself.",
        ]
    lines += [
        "",
        f"## Added latency at a light fixed load (open loop, {probe_rate:g} req/s)",
        "",
        "Closed-loop wrk keeps N requests in flight, so its latency is N / RPS (throughput-bound). The latency "
        "one request pays for crossing the proxy is measured here instead: requests start on a fixed schedule "
        "whatever the answers, the same probe also hits the upstream directly, and the difference is the "
        "proxy's added latency.",
        "",
    ]
    lines += _probe_table(probes)
    lines += [
        "",
        "## Added latency of one request at a time (one connection, back to back)",
        "",
        "A raw-socket client sends each request the moment the previous answer arrived: no queueing behind "
        "other requests and no idle wake-up between them, so the difference to the direct row is the "
        "proxy's own path (parse, policy, upstream call, answer).",
        "",
    ]
    lines += _probe_table(one_by_one)
    lines += ["", plot_line(out, "RPS and latency per proxy and connection count"), ""]
    out.write_text("\n".join(lines) + "\n")
    plot(runs, connections, out.with_suffix(".png"))
    print(out.read_text())


def _probe_table(probes: dict[str, tuple[float, float, float]]) -> list[str]:
    lines = [
        "| target | p50 ms | p90 ms | p99 ms | added p50 ms | added p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = probes.get("direct (no proxy)")
    for name, (p50, p90, p99) in probes.items():
        added50 = p50 - base[0] if base else float("nan")
        added99 = p99 - base[2] if base else float("nan")
        lines.append(f"| {name} | {p50:.3f} | {p90:.3f} | {p99:.3f} | {added50:.3f} | {added99:.3f} |")
    return lines


def plot(runs: list[Run], connections: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r.target for r in runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        rows = {r.connections: r for r in runs if r.target == target}
        xs = [j + i * width for j in range(len(connections))]
        ax1.bar(xs, [rows[c].rps if c in rows else 0 for c in connections], width, label=target)
        ax2.bar(xs, [rows[c].p50_ms if c in rows else 0 for c in connections], width, label=target)
    for ax, title in ((ax1, "requests per second"), (ax2, "p50 latency (ms)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(connections))], [f"{c} conns" for c in connections])
        ax.set_title(title)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
