"""CPU-seconds per request of tokenway beside LiteLLM's proxy and Portkey's gateway, short and ~100k-token prompts.

Issue 46 asks for tokenway's cost next to the gateways people would otherwise run, in one run with
ratios, and for the floor peers (a bare aiohttp pass-through, nginx) to stay in it. Wall-clock RPS
on this shared 2-core host moves by tens of percent with the other tenants' load; the CPU one proxy
process (and its children: LiteLLM's workers, nginx's) spends per request served, read from /proc,
moves far less, so it is the headline and RPS is quoted beside it.

Setup, all in one run: one instant nginx upstream (a canned chat completion and vLLM's `/tokenize`,
`bench.overhead.apis`) and the client on core 1; every proxy on core 0, each configured as a plain
pass-through to that upstream:
- bare aiohttp pass-through (`bench.overhead.passthrough`) and nginx `proxy_pass`;
- Portkey's gateway (npm `@portkey-ai/gateway`, Node), an OpenAI provider with a custom host given in
  its `x-portkey-*` headers;
- LiteLLM's proxy (PyPI `litellm[proxy]`), a `config.yaml` whose one model is an OpenAI-compatible
  deployment at the upstream; no database, no callbacks, its master key = the bench's API key;
- tokenway with `bench.overhead`'s full policy (API-key auth, metrics, ledger, predictor).

The client (aiohttp, in this process, pinned to core 1) sends a fixed number of requests at a fixed
concurrency (the long body is ~0.5 MB: too long for wrk's environment-variable body). Rounds are
interleaved: each round visits every target and workload, every other round in reverse order, so a
drift of the host's load favours none; the table quotes the mean and the per-round range.

The peers are installed on demand, outside the tracked tree and git-ignored (never by tests):

    .venv/bin/python -m bench.overhead.peers --install      # bench/.venv-litellm, bench/.portkey
    .venv/bin/python -m bench.overhead.peers [--rounds 3] [--short-requests 1000] [--long-requests 200]

Results: bench/results/overhead-peers.md and overhead-peers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.notes import with_plot
from bench.overhead.apis import start_api_upstream
from bench.overhead.long_prompt import words
from bench.overhead.run import KEY, LOAD_CORE, PROXY_CORE, RESULTS, ensure_tools, start_nginx, tokenway_config
from tests.support.procs import free_port, http_get

REPO = Path(__file__).resolve().parents[2]
LITELLM_VENV = REPO / "bench" / ".venv-litellm"
PORTKEY_DIR = REPO / "bench" / ".portkey"
PORTKEY_VERSION = "1.15.2"
PORTKEY_SERVER = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
BARE = "bare aiohttp pass-through"
WORKLOADS = ("short", "~100k-token prompt")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def install() -> None:
    """Install the two peers into their git-ignored folders (a bench step, never a test's)."""
    if not (LITELLM_VENV / "bin" / "litellm").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    if not PORTKEY_SERVER.exists():
        PORTKEY_DIR.mkdir(parents=True, exist_ok=True)
        npm = ["npm", "install", "--no-audit", "--no-fund", f"@portkey-ai/gateway@{PORTKEY_VERSION}"]
        subprocess.run(npm, cwd=PORTKEY_DIR, check=True)


def versions() -> dict[str, str]:
    """The peers' installed versions, for the results' header (a rerun must know what it compared)."""
    out: dict[str, str] = {}
    pip = subprocess.run(
        [str(LITELLM_VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
    )
    out["litellm"] = pip.stdout.strip() or "?"
    package = PORTKEY_SERVER.parents[1] / "package.json"
    out["@portkey-ai/gateway"] = orjson.loads(package.read_bytes())["version"] if package.exists() else "?"
    out["node"] = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip() or "?"
    return out


def _tree(pid: int) -> list[int]:
    """A process and all its descendants: LiteLLM and nginx serve from children, so the parent alone
    would undercount them."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, p in parents.items() if p == parent and child not in tree]
        tree += children
        frontier += children
    return tree


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of a process tree two ways: the sum of its live threads' on-CPU nanoseconds
    (/proc/PID/task/TID/schedstat; precise, but a thread that exited during the point is missed) and
    user + system clock ticks of each process (/proc/PID/stat; counts exited threads, but in 10 ms
    steps, coarse for nginx's few microseconds per request). The first is the headline, the second
    its cross-check."""
    precise = ticks = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += (int(fields[11]) + int(fields[12])) * _TICK_S
            for task in Path(f"/proc/{p}/task").iterdir():
                precise += int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue
    return precise, ticks


def bodies() -> dict[str, bytes]:
    """The two request bodies: the ~30-token chat of `bench.overhead` and a ~100k-word prompt (about as
    many tokens; fixed vocabulary and seed, nothing downloaded)."""
    short = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one word."},
        ],
        "max_tokens": 8,
    }
    long = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": words(random.Random(46), 100_000)},
        ],
        "max_tokens": 8,
    }
    return {"short": orjson.dumps(short), "~100k-token prompt": orjson.dumps(long)}


@dataclass
class Target:
    name: str
    port: int
    start: Callable[[], subprocess.Popen[bytes]]
    ready_path: str = "/"
    headers: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Point:
    target: str
    workload: str
    round: int
    requests: int
    ok: int
    rps: float
    p50_ms: float
    cpu_ms_per_request: float
    tick_cpu_ms_per_request: float = float("nan")


async def load(url: str, body: bytes, headers: dict[str, str], requests: int, connections: int) -> Point:
    """`requests` POSTs of one body with `connections` in flight; fills rps, p50 and ok (not CPU)."""
    left = requests
    ok = 0
    latencies: list[float] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, ok
        while left > 0:
            left -= 1
            start = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                ok += response.status == 200
            latencies.append((time.perf_counter() - start) * 1000)

    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(connections)))
        elapsed = time.perf_counter() - began
    return Point("", "", 0, requests, ok, requests / elapsed, statistics.median(latencies), float("nan"))


def _popen(argv: list[str], env: dict[str, str], cwd: Path, quiet: bool = False) -> subprocess.Popen[bytes]:
    sink = subprocess.DEVNULL if quiet else None  # the peers' banners would bury the bench's own lines
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=sink, stderr=sink)


def targets(workdir: Path, upstream_port: int) -> list[Target]:
    upstream = f"http://127.0.0.1:{upstream_port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pin = ["taskset", "-c", PROXY_CORE]
    out: list[Target] = []

    port = free_port()
    bare = [*pin, sys.executable, "-m", "bench.overhead.passthrough", str(port), upstream]
    out.append(Target(BARE, port, partial(_popen, bare, env, REPO)))

    port = free_port()
    # the long body held in memory: a temp file would land in the workdir, which nginx's workers cannot write
    block = f"""upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 512; }}
        server {{ listen 127.0.0.1:{port}; client_max_body_size 16m; client_body_buffer_size 2m;
        location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}"""
    out.append(Target("nginx proxy_pass", port, partial(start_nginx, workdir, "proxy", block, PROXY_CORE)))

    if PORTKEY_SERVER.exists():
        port = free_port()
        portkey = [*pin, "node", str(PORTKEY_SERVER), f"--port={port}", "--headless"]
        # 127.0.0.1 is in Portkey's default TRUSTED_CUSTOM_HOSTS, so the custom host is accepted
        headers = {"x-portkey-provider": "openai", "x-portkey-custom-host": f"{upstream}/v1"}
        node_env = {**os.environ, "NODE_ENV": "production"}
        name = f"Portkey gateway {versions()['@portkey-ai/gateway']}"
        out.append(Target(name, port, partial(_popen, portkey, node_env, workdir, quiet=True), headers=headers))

    if (LITELLM_VENV / "bin" / "litellm").exists():
        port = free_port()
        # a master key (the bench's API key): the proxy refuses to start without one, and it makes
        # LiteLLM check a key per request as tokenway does
        config = {
            "general_settings": {"master_key": KEY},
            "model_list": [
                {
                    "model_name": "bench-model",
                    "litellm_params": {"model": "openai/bench-model", "api_base": f"{upstream}/v1", "api_key": "none"},
                }
            ],
        }
        path = workdir / "litellm.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [*pin, str(LITELLM_VENV / "bin" / "litellm"), "--config", str(path), "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--num_workers", "1"]
        # the local cost map: nothing fetched at start (this host reaches no network but package registries)
        lenv = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        lenv |= {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
        name = f"LiteLLM proxy {versions()['litellm']}"
        start = partial(_popen, argv, lenv, workdir, quiet=True)
        out.append(Target(name, port, start, ready_path="/health/liveliness"))

    port = free_port()
    full = {"telemetry": {"metrics": {"enabled": True}}}  # the ledger and the predictor are on by default
    cfg = tokenway_config(workdir / "tokenway", [upstream_port], port, full)
    gw = [*pin, sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve", "--config", str(cfg)]
    out.append(Target("tokenway (full policy)", port, partial(_popen, gw, env, REPO), "/readyz"))
    return out


def idle_cpu(found: list[Target], seconds: float) -> dict[str, float]:
    """Each target's CPU milliseconds per second with no request in flight: background loops
    (LiteLLM's schedulers, tokenway's timers) are charged to the requests of a point, so their size
    says how much of a per-request figure is not the request's."""
    before = {t.name: tree_cpu_seconds(t.proc.pid)[0] for t in found if t.proc is not None}
    time.sleep(seconds)
    after = {t.name: tree_cpu_seconds(t.proc.pid)[0] for t in found if t.proc is not None}
    return {name: (after[name] - before[name]) / seconds * 1000 for name in before}


def wait_up(target: Target, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status, _ = http_get(f"http://127.0.0.1:{target.port}{target.ready_path}")
            if status == 200 or (status and target.ready_path == "/"):
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{target.name} never answered on port {target.port}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--install", action="store_true", help="install LiteLLM and Portkey, then exit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--short-requests", type=int, default=1000)
    parser.add_argument("--long-requests", type=int, default=200)
    parser.add_argument("--prewarm-short", type=int, default=1000, help="short requests per target before round 1")
    parser.add_argument("--prewarm-long", type=int, default=100, help="long requests per target before round 1")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU measured over this long")
    parser.add_argument("--out", default=str(RESULTS / "overhead-peers.md"))
    args = parser.parse_args()
    if args.install:
        install()
        return 0
    ensure_tools()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops the proxies it started
    os.sched_setaffinity(0, {int(LOAD_CORE)})  # the client shares the load core with the upstream
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="tw-peers-"))
    upstream, upstream_port = start_api_upstream(workdir, LOAD_CORE)
    requests = {"short": args.short_requests, "~100k-token prompt": args.long_requests}
    payloads = bodies()
    points: list[Point] = []
    idle: dict[str, float] = {}
    found = targets(workdir, upstream_port)
    try:
        for target in found:
            target.proc = target.start()
        for target in found:
            wait_up(target)
        for target in found:  # JITs (Node's V8) and caches settle before any point counts
            url = f"http://127.0.0.1:{target.port}/v1/chat/completions"
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **target.headers}
            for workload, n in (("short", args.prewarm_short), ("~100k-token prompt", args.prewarm_long)):
                asyncio.run(load(url, payloads[workload], headers, n, args.connections))
        idle = idle_cpu(found, args.idle_seconds)
        for round_ in range(args.rounds):
            order = found if round_ % 2 == 0 else found[::-1]
            for target in order:
                assert target.proc is not None
                url = f"http://127.0.0.1:{target.port}/v1/chat/completions"
                headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **target.headers}
                for workload in WORKLOADS if round_ % 2 == 0 else WORKLOADS[::-1]:
                    body, n = payloads[workload], requests[workload]
                    asyncio.run(load(url, body, headers, max(n // 5, 4 * args.connections), args.connections))
                    before = tree_cpu_seconds(target.proc.pid)
                    point = asyncio.run(load(url, body, headers, n, args.connections))
                    after = tree_cpu_seconds(target.proc.pid)
                    point.target, point.workload, point.round = target.name, workload, round_ + 1
                    point.cpu_ms_per_request = (after[0] - before[0]) / max(point.ok, 1) * 1000
                    point.tick_cpu_ms_per_request = (after[1] - before[1]) / max(point.ok, 1) * 1000
                    points.append(point)
                    print(
                        f"round {round_ + 1} {target.name} / {workload}: {point.cpu_ms_per_request:.3f} CPU ms/req, "
                        f"{point.rps:,.0f} rps, p50 {point.p50_ms:.2f} ms, {point.ok}/{n} ok",
                        flush=True,
                    )
    finally:
        for target in found:
            if target.proc is not None:
                target.proc.terminate()
        for target in found:
            if target.proc is not None:
                try:
                    target.proc.wait(15)
                except subprocess.TimeoutExpired:
                    target.proc.kill()
        upstream.terminate()
        upstream.wait(10)
    out = Path(args.out)
    write(points, idle, out, args, versions(), load_before, os.getloadavg())
    plot(points, out.with_suffix(".png"))
    return 0


def summarize(points: list[Point]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (target, workload): mean and range over rounds of CPU ms per request and RPS, and the ratio
    of the means to the bare pass-through's in the same workload."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for p in points:
        row = out.setdefault(
            (p.target, p.workload), {"cpu": [], "ticks": [], "rps": [], "p50": [], "ok": 0, "requests": 0}
        )
        row["cpu"].append(p.cpu_ms_per_request)
        row["ticks"].append(p.tick_cpu_ms_per_request)
        row["rps"].append(p.rps)
        row["p50"].append(p.p50_ms)
        row["ok"] += p.ok
        row["requests"] += p.requests
    for (_, workload), row in out.items():
        bare = out.get((BARE, workload))
        row["cpu_ratio"] = statistics.mean(row["cpu"]) / statistics.mean(bare["cpu"]) if bare else float("nan")
        row["rps_ratio"] = statistics.mean(row["rps"]) / statistics.mean(bare["rps"]) if bare else float("nan")
    return out


def render(
    points: list[Point],
    idle: dict[str, float],
    args: argparse.Namespace,
    peer_versions: dict[str, str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> str:
    summary = summarize(points)
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Gateway overhead beside LiteLLM and Portkey: CPU per request, short and ~100k-token prompts",
        "",
        f"Generated by `python -m bench.overhead.peers` on {now}: {args.rounds} interleaved rounds (every other in "
        f"reverse order), {args.short_requests} short / {args.long_requests} long requests per point after a "
        f"fifth as many of warm-up (and {args.prewarm_short} short + {args.prewarm_long} long per target before "
        f"round 1, so V8's JIT and every cache have settled), {args.connections} in flight, one aiohttp client "
        f"on core {LOAD_CORE} with "
        f"the instant nginx upstream; each proxy on core {PROXY_CORE}. CPU = on-CPU time of every thread of the "
        "proxy process and its children (/proc/PID/task/TID/schedstat) divided by the requests answered 200; "
        "the `ticks` column is the same from /proc/PID/stat's user + system clock ticks (10 ms steps, but it also "
        "counts threads that exited), a cross-check. The long prompt is 100,000 words "
        "(about as many tokens, ~0.5 MB of JSON). Versions: "
        + ", ".join(f"{k} {v}" for k, v in peer_versions.items())
        + f". Host load {load_before[0]:.2f} before, {load_after[0]:.2f} after (2 cores, shared).",
        "",
        "| workload | target | CPU ms / request (mean) | rounds | ticks | CPU vs bare | RPS (mean) | rounds "
        "| RPS vs bare | p50 ms | answered 200 |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for workload in WORKLOADS:
        for (target, w), row in summary.items():
            if w != workload:
                continue
            cpu, rps = row["cpu"], row["rps"]
            lines.append(
                f"| {workload} | {target} | {statistics.mean(cpu):.3f} | {min(cpu):.3f}-{max(cpu):.3f} | "
                f"{statistics.mean(row['ticks']):.3f} | {row['cpu_ratio']:.2f}x | "
                f"{statistics.mean(rps):,.0f} | {min(rps):,.0f}-{max(rps):,.0f} | "
                f"{row['rps_ratio']:.2f}x | {statistics.median(row['p50']):.2f} | {row['ok']}/{row['requests']} |"
            )
    tokenway = [k for k in summary if k[0].startswith("tokenway")]
    peers = [k for k in summary if k[0].startswith(("LiteLLM", "Portkey"))]
    if tokenway and peers:
        lines += ["", "tokenway's CPU per request as a fraction of each peer's, per workload (mean of rounds):", ""]
        for workload in WORKLOADS:
            tw = [statistics.mean(summary[k]["cpu"]) for k in tokenway if k[1] == workload]
            for peer in (k for k in peers if k[1] == workload):
                if tw:
                    share = tw[0] / statistics.mean(summary[peer]["cpu"])
                    lines.append(f"- {workload}: tokenway / {peer[0]} = {share:.2f}x")
    if idle:
        lines += [
            "",
            f"Idle CPU before the rounds ({args.idle_seconds:g} s with no request in flight), charged to the "
            "points' requests like any other CPU of the process:",
            "",
            "| target | idle CPU ms per second |",
            "| --- | ---: |",
        ]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in idle.items()]
    lines.append("")
    return "\n".join(lines)


def write(
    points: list[Point],
    idle: dict[str, float],
    out: Path,
    args: argparse.Namespace,
    peer_versions: dict[str, str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        with_plot(render(points, idle, args, peer_versions, load_before, load_after), out, "CPU per request")
    )
    raw = [p.__dict__ for p in points]
    out.with_name(out.stem + "-raw.json").write_bytes(orjson.dumps(raw, option=orjson.OPT_INDENT_2))
    print(out.read_text())


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(points)
    names = list(dict.fromkeys(p.target for p in points))
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(11, 4))
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        rows = [summary[(n, workload)] for n in names if (n, workload) in summary]
        means = [statistics.mean(r["cpu"]) for r in rows]
        low = [m - min(r["cpu"]) for m, r in zip(means, rows, strict=True)]
        high = [max(r["cpu"]) - m for m, r in zip(means, rows, strict=True)]
        ax.barh(range(len(rows)), means, xerr=[low, high], color="tab:blue")
        ax.set_yticks(range(len(rows)), [n for n in names if (n, workload) in summary], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("CPU ms per request (bars: round range)")
        ax.set_title(workload)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
