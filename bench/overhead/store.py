"""The shared store's cost: the same policy (three buckets, metrics, ledger) with its state in memory
and in Redis, one tokenway process each on the same core, measured in interleaved rounds.

    .venv/bin/python -m bench.overhead.store [--rounds 5] [--duration 6] [--connections 32]
        [--profile DIR]   # also record a py-spy profile of each variant (speedscope JSON)
        [--only REGEX] [--out bench/results/NAME.md]
    .venv/bin/python -m bench.overhead.store --report-only bench/results/raw/NAME.json --out bench/results/NAME.md

Every variant runs as its own `tokenway serve` pinned to core 0, all started at once (an idle one
costs nothing); wrk (1 thread), the instant upstream (nginx `return 200`) and a private
redis-server share core 1. Each round runs wrk against every variant in turn, so all see the same
background load; the table reports per-round ratios to the memory variant of the same round and
their medians. CPU µs per request (the proxy process's user + system CPU over the requests it
served) is less sensitive to other processes' load than requests per second: on a shared host
the proxy may wait for its core, which lowers RPS but not the CPU it spends per request.
Writes bench/results/overhead-store.md (or `--out`) with its raw points in raw/ beside it and,
when a `+ hierarchy` variant ran, issue 45's ratio per round (table and .png).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench.limiter.common import RedisServer
from bench.notes import section
from bench.overhead.run import (
    COMPLETION,
    LOAD_CORE,
    PROXY_CORE,
    RESULTS,
    TOKENIZE_LOCATION,
    cpu_seconds,
    ensure_tools,
    start_nginx,
    tokenway_config,
    wrk,
)
from tests.support.procs import _env, free_port, free_ports, http_get, stop_process, wait_http

REPO = Path(__file__).resolve().parents[2]

LIMITS = [{"scope": "key", "rpm": 10**9, "tpm": 10**12}, {"scope": "tenant", "tpm": 10**12}]  # 3 buckets
MEMORY = "memory"
# The spend hierarchy (issue 45): the three buckets plus budgets of the organisation, the team, the
# project (tenant), the key and a tag every request carries (`x-tokenway-tags`), never exhausted.
HIERARCHY = {
    "orgs": {"acme": {}},
    "teams": {"search": {"org": "acme"}},
    "budgets": [
        {"scope": "org", "usd_per_month": 1e9},
        {"scope": "team", "usd_per_month": 1e9},
        {"scope": "tenant", "usd_per_day": 1e9},
        {"scope": "key", "usd_per_day": 1e9},
        {"scope": "tag", "match": {"tag": "feature-x"}, "usd_per_day": 1e9},
    ],
}
TAGS = "feature-x"


def variants(redis_url: str) -> dict[str, dict[str, Any]]:
    """name -> extra gateway.yaml sections. All: 3 buckets, metrics and ledger on, predictor off."""
    base: dict[str, Any] = {"telemetry": {"metrics": {"enabled": True}}, "ledger": {}, "predictor": {"enabled": False}}
    redis_state = {"backend": "redis", "redis_url": redis_url}
    return {
        MEMORY: base,
        "redis": {**base, "state": {**redis_state, "key_prefix": "bench-a", "replicas": {"share": False}}},
        "redis + shared routing state": {**base, "state": {**redis_state, "key_prefix": "bench-b"}},
        "memory + hierarchy": {**base, "_policies": HIERARCHY},
        "redis + hierarchy": {
            **base,
            "state": {**redis_state, "key_prefix": "bench-c", "replicas": {"share": False}},
            "_policies": HIERARCHY,
        },
    }


@dataclass
class Point:
    variant: str
    round: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float
    store_errors: int = 0  # Redis errors during the point (timeouts on this loaded host)
    local: int = 0  # requests admitted locally (fail-open) during the point
    redis_cpu_us: float = 0.0  # the private redis-server's CPU over the point, per request served


def limiter_counters(port: int) -> tuple[int, int]:
    """(Redis errors, local fail-open admissions) so far, from /admin/status (open on loopback)."""
    status, text = http_get(f"http://127.0.0.1:{port}/admin/status", timeout_s=10)
    if status != 200:
        return 0, 0
    admission = orjson.loads(text).get("admission", {})
    return int(admission.get("redis_errors", 0)), int(admission.get("local_admissions", 0))


def start_variant(
    workdir: Path, name: str, extra: dict[str, Any], upstream: int, tree: Path = REPO
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    extra = dict(extra)
    hierarchy = extra.pop("_policies", None)
    slug = re.sub(r"\W+", "-", name)  # each variant its own ledger files and batch folder (one process each)
    extra["ledger"] = {**extra.get("ledger", {}), "file_prefix": f"bench-{slug}"}
    extra["batch"] = {**extra.get("batch", {}), "dir": str(workdir / slug / "batch")}
    config = tokenway_config(workdir / re.sub(r"\W+", "-", name), [upstream], port, extra)
    policies = config.parent / "policies.yaml"
    doc = yaml.safe_load(policies.read_text())
    doc["limits"] = LIMITS
    if hierarchy is not None:
        doc.update(hierarchy)
        for tenant in doc["tenants"].values():
            tenant["team"] = "search"
    policies.write_text(yaml.safe_dump(doc))
    argv = ["taskset", "-c", PROXY_CORE, sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve",
            "--config", str(config)]  # fmt: skip
    env = {**_env(), "PYTHONPATH": str(tree)}
    return subprocess.Popen(argv, env=env, cwd=tree), port


def profile(pid: int, out: Path, url: str, connections: int, duration_s: float) -> None:
    """py-spy samples the proxy while wrk loads it (the profiler runs on the load core)."""
    spy = Path(sys.executable).with_name("py-spy")
    argv = ["taskset", "-c", LOAD_CORE, str(spy), "record", "--pid", str(pid), "--rate", "400", "--format",
            "speedscope", "--output", str(out), "--duration", f"{int(duration_s) + 1}", "--nonblocking"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(url, connections, duration_s)
    proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--only", default="", help="regex over variant names (memory always runs)")
    parser.add_argument("--profile", default="", help="a folder: record a py-spy profile of each variant")
    parser.add_argument("--baseline", default="", help="another source tree: its memory and redis variants run too")
    parser.add_argument("--baseline-label", default="", help="what the baseline tree is, for the results")
    parser.add_argument("--out", default=str(RESULTS / "overhead-store.md"))
    parser.add_argument("--report-only", default="", help="re-render --out from a raw file a run wrote (no run)")
    args = parser.parse_args()
    if args.report_only:
        raw = orjson.loads(Path(args.report_only).read_bytes())
        meta = raw["meta"]
        for name in ("rounds", "duration", "connections", "baseline", "baseline_label"):
            setattr(args, name, meta[name])
        write(
            [Point(**p) for p in raw["points"]],
            Path(args.out),
            args,
            meta["elapsed_s"],
            meta["load_before"],
            meta["load_after"],
            meta["at"],
        )
        return 0
    ensure_tools()
    workdir = Path(tempfile.mkdtemp(prefix="tw-store-"))
    redis_server = RedisServer(workdir)
    subprocess.run(["taskset", "-p", "-c", LOAD_CORE, str(redis_server.proc.pid)], check=True, capture_output=True)
    (upstream_port,) = free_ports(1)
    upstream = start_nginx(
        workdir,
        "upstream",
        f"""server {{ listen 127.0.0.1:{upstream_port};
            location = /health {{ return 200 ''; }} {TOKENIZE_LOCATION}
            location / {{ default_type application/json; return 200 '{COMPLETION}'; }} }}""",
        LOAD_CORE,
    )
    chosen = {n: v for n, v in variants(redis_server.url).items() if n == MEMORY or re.search(args.only, n)}
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    points: list[Point] = []
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        wait_http(f"http://127.0.0.1:{upstream_port}/health")
        for name, extra in chosen.items():
            procs[name] = start_variant(workdir, name, extra, upstream_port)
        if args.baseline:
            base = Path(args.baseline).resolve()
            for name in (MEMORY, "redis"):
                extra = variants(redis_server.url)[name]
                if "state" in extra:
                    extra = {**extra, "state": {**extra["state"], "key_prefix": "bench-base"}}
                procs[f"{name} (baseline)"] = start_variant(workdir, f"{name}-baseline", extra, upstream_port, base)
        for proc, port in procs.values():
            wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90, proc=proc)
        for _, port in procs.values():
            wrk(f"http://127.0.0.1:{port}/v1/chat/completions", args.connections, args.warmup)
        for r in range(args.rounds):
            order = list(procs.items())
            if r % 2:
                order.reverse()  # neither variant always runs first after the other's burst
            for name, (proc, port) in order:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                tags = TAGS if "hierarchy" in name else ""
                wrk(url, args.connections, 1.0, tags)
                errors0, local0 = limiter_counters(port)
                before, redis_before = cpu_seconds(proc.pid), cpu_seconds(redis_server.proc.pid)
                rps, pct, errors = wrk(url, args.connections, args.duration, tags)
                served = max(rps * args.duration, 1)
                cpu_us = (cpu_seconds(proc.pid) - before) / served * 1e6
                redis_us = (cpu_seconds(redis_server.proc.pid) - redis_before) / served * 1e6
                errors1, local1 = limiter_counters(port)
                point = Point(
                    name, r, rps, pct["50"], pct["99"], errors, cpu_us, errors1 - errors0, local1 - local0, redis_us
                )
                points.append(point)
                print(
                    f"round {r} {name}: {rps:,.0f} rps, {cpu_us:.0f} CPU µs/req, Redis {redis_us:.0f}, "
                    f"errors {errors}, store errors {point.store_errors}, local {point.local}",
                    flush=True,
                )
        if args.profile:
            folder = Path(args.profile)
            folder.mkdir(parents=True, exist_ok=True)
            for name, (proc, port) in procs.items():
                out = folder / (re.sub(r"\W+", "-", name) + ".speedscope.json")
                profile(proc.pid, out, f"http://127.0.0.1:{port}/v1/chat/completions", args.connections, 8.0)
                print(f"profile of {name}: {out}", flush=True)
    finally:
        for proc, _ in procs.values():
            stop_process(proc)
        upstream.terminate()
        upstream.wait(10)
        redis_server.stop()
    elapsed_s, load_after, at = time.monotonic() - started, os.getloadavg()[0], time.gmtime()
    out = Path(args.out)
    raw_path = out.parent / "raw" / (out.stem + ".json")
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "rounds": args.rounds, "duration": args.duration, "connections": args.connections,
        "baseline": args.baseline, "baseline_label": args.baseline_label, "elapsed_s": elapsed_s,
        "load_before": load_before, "load_after": load_after, "at": time.strftime("%Y-%m-%d %H:%M UTC", at),
    }  # fmt: skip
    raw_path.write_bytes(orjson.dumps({"meta": meta, "points": [vars(p) for p in points]}, option=orjson.OPT_INDENT_2))
    write(points, out, args, elapsed_s, load_before, load_after, meta["at"])
    return 0


def write(
    points: list[Point], out: Path, args: argparse.Namespace, elapsed_s: float, load0: float, load1: float, at: str
) -> None:
    names = list(dict.fromkeys(p.variant for p in points))
    memory = {p.round: p for p in points if p.variant == MEMORY}
    lines = [
        "# The shared store's cost: the same policy in memory and in Redis"
        + (", and with the spend hierarchy (issue 45)" if any("hierarchy" in n for n in names) else ""),
        "",
        f"Generated by `python -m bench.overhead.store` on {at} "
        f"in {elapsed_s / 60:.1f} min. Each variant is one `tokenway serve` pinned to core {PROXY_CORE} (all "
        f"started at once, loaded one at a time); wrk (1 thread, {args.connections} connections, "
        f"{args.duration:g} s per point), the instant upstream (nginx `return 200`) and a private redis-server "
        f"share core {LOAD_CORE}. Policy: three buckets (key rpm + key tpm + tenant tpm, never exhausted), "
        "metrics and ledger on, predictor off, one upstream endpoint. `redis` keeps the buckets in Redis with "
        "the replicas' shared routing state off; `redis + shared routing state` has it on (the default with "
        "`state: redis`). The `+ hierarchy` variants add budgets of the organisation, the team, the project "
        "(tenant), the key and a tag every request carries (`x-tokenway-tags`), never exhausted: five more "
        "counters in the same atomic reservation (issue 45). "
        f"{args.rounds} rounds, the variants interleaved in each (alternating order). Host load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end, on 2 cores shared with other work: absolute RPS "
        "moves with it; the ratios within a round, and CPU µs per request, much less.",
        "",
        *(
            [
                f"Rows marked (baseline) are the memory and redis variants run from another source tree "
                f"(`--baseline {args.baseline_label or args.baseline}`) in the same rounds, against the same "
                "upstream and Redis.",
                "",
            ]
            if args.baseline
            else []
        ),
        "| variant | RPS (median) | CPU µs / req (median) | Redis CPU µs / req (median) | "
        "RPS / memory (median of rounds) | memory CPU / variant CPU (median) | p50 ms | p99 ms | errors | "
        "Redis errors | admitted locally |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        rows = [p for p in points if p.variant == name]
        rps_ratio = [p.rps / memory[p.round].rps for p in rows if p.round in memory]
        cpu_ratio = [memory[p.round].cpu_us / p.cpu_us for p in rows if p.round in memory and p.cpu_us > 0]
        lines.append(
            f"| {name} | {statistics.median(p.rps for p in rows):,.0f} | "
            f"{statistics.median(p.cpu_us for p in rows):.0f} | "
            f"{statistics.median(p.redis_cpu_us for p in rows):.0f} | "
            f"{statistics.median(rps_ratio):.2f} | "
            f"{statistics.median(cpu_ratio):.2f} | {statistics.median(p.p50_ms for p in rows):.2f} | "
            f"{statistics.median(p.p99_ms for p in rows):.2f} | {sum(p.errors for p in rows)} | "
            f"{sum(p.store_errors for p in rows)} | {sum(p.local for p in rows)} |"
        )
    lines += hierarchy_lines(points)
    if plot_hierarchy(points, out.with_suffix(".png")):
        lines += ["", f"![hierarchy / three buckets per round]({out.with_suffix('.png').name})"]
    lines += ["", "Every round:", "", "| round | variant | RPS | CPU µs / req | Redis CPU µs / req | RPS / memory | "
              "errors | Redis errors | admitted locally |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for p in points:
        base = memory.get(p.round)
        ratio = f"{p.rps / base.rps:.2f}" if base else "-"
        lines.append(f"| {p.round} | {p.variant} | {p.rps:,.0f} | {p.cpu_us:.0f} | {p.redis_cpu_us:.0f} | {ratio} | "
                     f"{p.errors} | {p.store_errors} | {p.local} |")  # fmt: skip
    lines.append("")
    lines += section(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


@dataclass(frozen=True)
class HierarchyRatios:
    """Per round that ran both on one store: the hierarchy's CPU per request over the three buckets',
    the gateway's alone and the gateway's plus the private redis-server's."""

    rounds: list[int]
    gateway: list[float]
    with_redis: list[float]


def _hierarchy_ratios(points: list[Point], store: str) -> HierarchyRatios:
    three = {p.round: p for p in points if p.variant == store and p.cpu_us > 0}
    pairs = [(three[p.round], p) for p in points if p.variant == f"{store} + hierarchy" and p.round in three]
    return HierarchyRatios(
        [h.round for _, h in pairs],
        [h.cpu_us / t.cpu_us for t, h in pairs],
        [(h.cpu_us + h.redis_cpu_us) / (t.cpu_us + t.redis_cpu_us) for t, h in pairs],
    )


def plot_hierarchy(points: list[Point], path: Path) -> bool:
    """Per round, the hierarchy's CPU per request over the three buckets' (False: no hierarchy variant ran)."""
    series = {store: _hierarchy_ratios(points, store) for store in (MEMORY, "redis")}
    if not any(r.rounds for r in series.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for store, ratios in series.items():
        if not ratios.rounds:
            continue
        ax.plot(ratios.rounds, ratios.gateway, "o-", label=f"{store}: gateway CPU")
        if store != MEMORY:
            ax.plot(ratios.rounds, ratios.with_redis, "s--", label=f"{store}: gateway + Redis CPU")
    ax.axhline(1.15, color="red", linewidth=1, label="target 1.15x")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("round")
    ax.set_ylabel("CPU per request: hierarchy / three buckets")
    ax.set_title("The spend hierarchy's cost per request (issue 45)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def hierarchy_lines(points: list[Point]) -> list[str]:
    """Issue 45's target, per store: the hierarchy's CPU per request over the three buckets', per round
    (the two variants of one round ran back to back), for the gateway's CPU (bench/overhead's measure)
    and for the gateway's plus the redis-server's (the private Redis serves only the variant loaded)."""
    out: list[str] = []
    for store in (MEMORY, "redis"):
        ratios = _hierarchy_ratios(points, store)
        if not ratios.rounds:
            continue
        if not out:
            out += [
                "",
                "Issue 45's target, the hierarchy's CPU per request at most 1.15x the three buckets': "
                "`+ hierarchy` over its store's three-bucket variant, round by round (median, min-max over rounds). "
                "`gateway + Redis` adds the private redis-server's CPU per request to the gateway's "
                "(the limits' scripts, the ledger's stream and anything else the variant sends it).",
                "",
                "| store | gateway CPU: hierarchy / three | gateway + Redis CPU: hierarchy / three | rounds |",
                "| --- | --- | --- | ---: |",
            ]
        gw, total = ratios.gateway, ratios.with_redis
        out.append(
            f"| {store} | {statistics.median(gw):.3f} ({min(gw):.3f}-{max(gw):.3f}) | "
            f"{statistics.median(total):.3f} ({min(total):.3f}-{max(total):.3f}) | {len(gw)} |"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
