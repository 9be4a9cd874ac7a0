"""The same trace through one tokenway and through three replicas behind an L4 balancer.

    .venv/bin/python -m bench.replay.replicas                    # Mooncake subset at 80 % load (~10 min)
    .venv/bin/python -m bench.replay.replicas --capacity 7.75    # skip the capacity burst

Same fleet, same arrivals, one after another (caches emptied between): `1 replica` (the default
scoring pipeline, approximate index, state in memory), `3 replicas, shared` (three processes with
`state: redis` sharing routing state through the replicas' stream, haproxy in TCP round-robin
mode in front) and `3 replicas, not shared` (the same three, limits still in Redis, with
`state.replicas.share: false`: each knows only its own dispatches and load). Targets: shared
within 10 % of one replica on p90 TTFT and cache hit rate.

Writes `bench/results/replay-replicas.md`; raw results stay in `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.replay import fleet as fleet_mod
from bench.replay.fronts import RouterSpec
from bench.replay.run import MAX_MODEL_LEN, MODEL, RESULTS, TRACES, Workload, measure_capacity, replay
from bench.replay.stats import RunSummary, summarize
from bench.replay.workload import infinite_cache_hit_ratio, load_mooncake, scaled_arrivals


def specs(seed: int, redis_url: str, prefix: str) -> list[RouterSpec]:
    shared = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}
    return [
        RouterSpec("1 replica", "tokenway", {"seed": seed}, note="one tokenway, state in memory"),
        RouterSpec(
            "3 replicas, shared", "tokenway", {"seed": seed}, replicas=3, state=shared,
            note="three tokenway processes behind haproxy (TCP round robin), `state: redis`: load, prefix-index "
            "insertions and session pins shared through the replicas' stream",
        ),
        RouterSpec(
            "3 replicas, not shared", "tokenway", {"seed": seed}, replicas=3,
            state={**shared, "replicas": {"share": False}},
            note="the same three, limits still in Redis, `state.replicas.share: false`: each routes on its own "
            "dispatches and load only",
        ),
    ]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--preset", default="llama-3.1-8b@h100")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=180)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--capacity", type=float, default=None, help="sim req/s; default: measure with a burst")
    p.add_argument("--redis-url", default=os.environ.get("TOKENWAY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS / "replay-replicas.md")
    p.add_argument("--workdir", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.traces / "mooncake" / "synthetic_trace.jsonl"
    if not path.exists():
        print(f"trace missing: {path} (the shared traces folder is needed)", file=sys.stderr)
        return 2
    workload = Workload(
        "mooncake",
        load_mooncake(path, args.requests, args.seed, MAX_MODEL_LEN),
        [args.load],
        "Mooncake synthetic trace, random whole conversations",
        args.time_scale,
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tokenway-replicas-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", file=sys.stderr)
    prefix = f"tokenway-bench:{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    summaries: list[RunSummary] = []
    host_load: dict[str, tuple[float, float]] = {}
    holder_share: dict[str, float] = {}
    fleet = fleet_mod.start_fleet(
        workdir / "fleet", engines=args.engines, preset=args.preset, time_scale=args.time_scale, served_model=MODEL
    )
    try:
        if args.capacity is not None:
            capacity = args.capacity
        else:
            capacity, _ = measure_capacity(fleet, workload, args, workdir, args.seed)
        rate = args.load * capacity
        arrivals = [a / workload.time_scale for a in scaled_arrivals(workload.requests, rate)]
        for spec in specs(args.seed, args.redis_url, prefix):
            label = f"mooncake {args.load:.0%} {spec.name}"
            load_before = os.getloadavg()[0]
            outcomes, hit, per_engine, wall_s, cpu_busy = replay(
                spec, fleet, workload.requests, arrivals, label=label, workdir=workdir, seed=args.seed
            )
            host_load[spec.name] = (load_before, os.getloadavg()[0])
            holder_share[spec.name] = follow_ups_on_holder(workload.requests, outcomes)
            summary = summarize(
                trace="mooncake", load=args.load, router=spec.name, offered_rps=rate, outcomes=outcomes,
                wall_s=wall_s, time_scale=workload.time_scale, cache_hit_rate=hit, per_engine=per_engine,
                host_cpu_busy=cpu_busy,
            )  # fmt: skip
            summaries.append(summary)
            print(f"  {label}: ttft p50 {summary.ttft_p50_s:.2f}s p90 {summary.ttft_p90_s:.2f}s hit {hit:.1%} "
                  f"ok {summary.ok}/{summary.requests}", file=sys.stderr)  # fmt: skip
    finally:
        fleet.stop()
        _clean_redis(args.redis_url, prefix)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "elapsed_s": time.monotonic() - started,
        "engines": args.engines,
        "preset": args.preset,
        "time_scale": args.time_scale,
        "capacity_rps": capacity,
        "load": args.load,
        "requests": len(workload.requests),
        "mean_prompt_tokens": sum(r.input_tokens for r in workload.requests) / len(workload.requests),
        "infinite_cache_hit_ratio": infinite_cache_hit_ratio(workload.requests),
        "specs": [{"name": s.name, "note": s.note} for s in specs(args.seed, args.redis_url, prefix)],
        "host_load": host_load,
        "holder_share": holder_share,
    }
    (workdir / "replicas.json").write_text(json.dumps({"meta": meta, "runs": [s.row() for s in summaries]}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(meta, summaries))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def follow_ups_on_holder(requests: list[Any], outcomes: list[dict[str, Any]]) -> float:
    """Share of follow-up requests (sharing at least 4 blocks with an earlier one) served by the
    endpoint that served the earlier request they share the longest prefix with."""
    endpoint = {o["index"]: o.get("endpoint") for o in outcomes}
    seen: list[Any] = []
    same = total = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        best, best_len = None, 0
        for earlier in seen:
            n = 0
            for a, b in zip(earlier.hash_ids, request.hash_ids, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = earlier, n
        if best is not None and best_len >= 4:
            total += 1
            same += endpoint.get(best.index) == endpoint.get(request.index)
        seen.append(request)
    return same / total if total else float("nan")


def _clean_redis(url: str, prefix: str) -> None:
    import redis

    try:
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    except redis.RedisError:
        pass


def markdown(meta: dict[str, Any], runs: list[RunSummary]) -> str:
    base = runs[0]
    lines = [
        "# Replicas: one tokenway vs three behind an L4 balancer",
        "",
        f"Generated by `bench/replay/replicas.py` on {meta['when']} ({meta['host']}) in "
        f"{meta['elapsed_s'] / 60:.1f} min. Fleet: {meta['engines']} simulated `{meta['preset']}` engines in one "
        f"process, clock {meta['time_scale']:g}x. Workload: {meta['requests']} requests of the Mooncake synthetic "
        f"trace (whole conversations; mean prompt {meta['mean_prompt_tokens']:,.0f} tokens; an infinite cache "
        f"would hit {meta['infinite_cache_hit_ratio']:.1%} of blocks), offered at {meta['load']:.0%} of "
        f"{meta['capacity_rps']:.2f} req/s (simulated). Same arrivals for every row, one after another, engine "
        "caches emptied between. TTFT is what the engines measured (simulated seconds); cache hit = the engines' "
        "own prefix-cache hits / queries (tokens).",
        "",
        "`on holder` = share of follow-up turns (4+ blocks shared with an earlier request) served where that "
        "earlier request was; `host load` = the 1-minute load average before / after the row (2 cores; other "
        "processes on this machine move it, and with it every latency).",
        "",
        "| front | TTFT p50 | p90 | p99 | client TTFT p90 | cache hit | on holder | p90 vs 1 | hit vs 1 | "
        "requests per engine | host load | ok |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    load = meta.get("host_load", {})
    holder = meta.get("holder_share", {})
    lines += [
        f"| {s.router} | {s.ttft_p50_s:.2f} | {s.ttft_p90_s:.2f} | {s.ttft_p99_s:.2f} | "
        f"{s.client_ttft_p90_s:.2f} | {s.cache_hit_rate:.1%} | {holder.get(s.router, float('nan')):.0%} | "
        f"{s.ttft_p90_s / base.ttft_p90_s:.2f}x | {s.cache_hit_rate / base.cache_hit_rate:.2f}x | "
        f"{' '.join(map(str, s.per_engine))} | {'/'.join(f'{x:.1f}' for x in load.get(s.router, ()))} | "
        f"{s.ok}/{s.requests} |"
        for s in runs
    ]
    lines += ["", "Fronts:", ""]
    lines += [f"- `{spec['name']}` — {spec['note']}" for spec in meta["specs"]]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
