"""Trace replay: routers compared on one simulated fleet with the same arrivals.

    .venv/bin/python -m bench.replay.run                      # the full run (~20 min on 2 cores)
    .venv/bin/python -m bench.replay.run --quick              # a smoke run (small subsets, 2 routers)
    .venv/bin/python -m bench.replay.run --seeds 7,8 --kv-aware --loads 0.8   # issue 42's two rounds

One `sim` process runs `--engines` simulated `llama-3.1-8b@h100` engines (prefix caching,
KV events on). For every (trace, load, router) a fresh router process is started in front of them,
the engines' caches are emptied (`POST /reset_prefix_cache`), and the load generator (`bench.loadgen` in its own
process, aiohttp, open loop, streaming) replays the same requests at the same arrival times.

Time: the engines run on a simulated clock `--time-scale` times the wall clock (below 1: slower
than real, so a 2-core host keeps up with eight fast GPUs). Arrival rates are set in simulated
seconds: `load x capacity`, capacity being the least-load router's measured throughput on the
Mooncake subset (an all-at-once burst; see `stats.capacity_from_burst`), or `--capacity`.
Latencies are reported twice: as the engines measured them (simulated seconds, the primary
numbers; host CPU delays excluded) and as the client saw them (real seconds x time scale).

Writes `bench/results/replay.md` and `bench/results/replay-ttft-cdf.png`; the raw numbers
(`replay.json`), every plan, per-request results and router logs stay in `--workdir`. Needs
`bench/.venv-vllm-router/` for the vllm-router rows (`pip install vllm-router` there); without it
those rows are skipped with a note on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import Shot, bearer, completion_body, write_plan
from bench.replay import fleet as fleet_mod
from bench.replay import fronts, report
from bench.replay.stats import RunSummary, capacity_from_burst, percentile, queue_p90, summarize, ttft_floors
from bench.replay.workload import (
    PromptBuilder,
    TraceRequest,
    best_case_cached_tokens,
    infinite_cache_hit_ratio,
    load_azure,
    load_mooncake,
    scaled_arrivals,
)
from bench.traces import traces_dir

REPO = Path(__file__).resolve().parents[2]
TRACES = traces_dir()
RESULTS = REPO / "bench" / "results"
MODEL = "llama-3.1-8b"
MAX_MODEL_LEN = 131_072  # the preset's context: longer trace rows are dropped
CPU_LOG: list[dict[str, Any]] = []  # per replay: CPU seconds of the engines' and the router's processes


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[TraceRequest]
    loads: list[float]
    description: str
    time_scale: float


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=Path, default=TRACES, help="the shared traces folder")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--preset", default="llama-3.1-8b@h100")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per real second (Mooncake)")
    p.add_argument("--azure-time-scale", type=float, default=0.25, help="the same for the Azure replay")
    p.add_argument("--mooncake-requests", type=int, default=180, help="about this many (whole conversations)")
    p.add_argument("--azure-requests", type=int, default=200)
    p.add_argument("--azure-trace", choices=("code", "conv", "none"), default="code")
    p.add_argument("--loads", default="0.5,0.8,1.0", help="fractions of the measured capacity (Mooncake)")
    p.add_argument("--azure-loads", default="0.8", help="fractions of the Azure subset's own capacity")
    p.add_argument("--capacity", type=float, default=None, help="Mooncake capacity (sim req/s); skip measuring")
    p.add_argument("--azure-capacity", type=float, default=None, help="Azure capacity (sim req/s)")
    p.add_argument("--routers", default="all", help="comma-separated router names, or all")
    p.add_argument("--kv-aware", action="store_true", help="also run vllm-router --policy kv_aware")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, one full round each (Mooncake subset, prompt words, router RNG); "
        "default: --seed alone",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: small subsets, two routers, one load")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report path (default bench/results/replay.md; with --quick, the workdir)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="logs and plans (default: a temp dir)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the report and plot from --workdir's replay.json and results (no replay)",
    )
    return p


def _routers(args: argparse.Namespace, seed: int) -> list[fronts.RouterSpec]:
    specs = fronts.tokenway_routers(seed, args.preset) + fronts.vllm_router_routers(args.kv_aware)
    if args.routers != "all":
        wanted = [r.strip() for r in args.routers.split(",") if r.strip()]
        unknown = set(wanted) - {s.name for s in specs}
        if unknown:
            raise SystemExit(f"unknown routers {sorted(unknown)}; known: {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in wanted]
    if not fronts.VLLM_ROUTER_BIN.exists():
        skipped = [s.name for s in specs if s.kind == "vllm-router"]
        if skipped:
            print(f"note: {fronts.VLLM_ROUTER_BIN} missing, skipping {skipped}", file=sys.stderr)
        specs = [s for s in specs if s.kind != "vllm-router"]
    return specs


def replay(
    spec: fronts.RouterSpec,
    fleet: fleet_mod.Fleet,
    requests: list[TraceRequest],
    arrivals_real_s: list[float],
    *,
    label: str,
    workdir: Path,
    seed: int,
) -> tuple[list[dict[str, Any]], float, list[int], float, float]:
    """(outcomes, engine cache hit rate, requests per engine, wall seconds, host CPU busy share) of one replay."""
    fleet_mod.reset_caches(fleet)
    run_dir = _run_dir(workdir, label)
    front = fronts.start_front(spec, fleet, run_dir)
    try:
        prompts = PromptBuilder(seed)
        shots = [
            Shot(at, completion_body(fleet.served_model, prompts.prompt(r), r.output_tokens), bearer(fronts.API_KEY))
            for r, at in zip(requests, arrivals_real_s, strict=True)
        ]
        plan_path, results_path = run_dir / "plan.json", run_dir / "results.json"
        write_plan(plan_path, front.url, shots, label=label)
        before = fleet_mod.snapshot(fleet)
        cpu_before = fleet_mod.host_cpu_busy_s()
        procs_before = (fleet_mod.process_cpu_s(fleet.proc.pid), sum(map(fleet_mod.process_cpu_s, front.pids)))
        children_before = os.times()
        loadgen = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", str(plan_path), str(results_path)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        if loadgen.wait() != 0:
            raise RuntimeError(f"load generator failed for {label} (exit {loadgen.returncode})")
        cpu_after = fleet_mod.host_cpu_busy_s()
        children_after = os.times()
        procs_after = (fleet_mod.process_cpu_s(fleet.proc.pid), sum(map(fleet_mod.process_cpu_s, front.pids)))
        CPU_LOG.append({"label": label, "engines_cpu_s": procs_after[0] - procs_before[0],
                        "router_cpu_s": procs_after[1] - procs_before[1],
                        "loadgen_cpu_s": children_after.children_user + children_after.children_system
                        - children_before.children_user - children_before.children_system})  # fmt: skip
        fleet_mod.wait_idle(fleet)
        after = fleet_mod.snapshot(fleet)
    finally:
        front.stop()
    outcomes: list[dict[str, Any]] = json.loads(results_path.read_text())
    starts = [o["scheduled_s"] + o["late_s"] for o in outcomes]
    ends = [s + o["e2e_s"] for s, o in zip(starts, outcomes, strict=True)]
    wall_s = max(ends) - min(starts)
    total = cpu_after[1] - cpu_before[1]
    cpu_busy = (cpu_after[0] - cpu_before[0]) / total if total > 0 else float("nan")
    hit = fleet_mod.cache_hit_rate(before, after)
    return outcomes, hit, fleet_mod.per_engine_requests(before, after), wall_s, cpu_busy


def measure_capacity(
    fleet: fleet_mod.Fleet, workload: Workload, args: argparse.Namespace, workdir: Path, seed: int, tag: str = ""
) -> tuple[float, dict[str, Any]]:
    """Least-load throughput under an all-at-once burst of the workload (sim req/s)."""
    spec = next(s for s in fronts.tokenway_routers(seed, args.preset) if s.name == "least-load")
    # every arrival within ~3 simulated seconds: the queue never empties until the tail
    arrivals = [a / workload.time_scale for a in scaled_arrivals(workload.requests, len(workload.requests) / 3.0)]
    outcomes, hit, _, wall_s, cpu_busy = replay(
        spec, fleet, workload.requests, arrivals, label=f"capacity {workload.name}{tag}", workdir=workdir, seed=seed
    )
    capacity = capacity_from_burst(outcomes, workload.time_scale)
    ok = sum(1 for o in outcomes if o["ok"])
    detail = {"capacity_rps": capacity, "ok": ok, "requests": len(outcomes), "wall_s": wall_s, "cache_hit_rate": hit,
              "host_cpu_busy": cpu_busy}  # fmt: skip
    print(f"capacity {workload.name}: {capacity:.2f} sim req/s ({ok}/{len(outcomes)} ok, {wall_s:.0f} s wall)",
          file=sys.stderr)  # fmt: skip
    return capacity, detail


def _run_dir(workdir: Path, label: str) -> Path:
    return workdir / label.replace(" ", "_").replace("/", "-")


def run_label(trace: str, load: float, router: str, seed: int | None) -> str:
    """A replay's label (and workdir folder): `s<seed> ` first in multi-seed runs, the router last."""
    return f"{'' if seed is None else f's{seed} '}{trace} {load:.0%} {router}"


def write_report(workdir: Path, out: Path, args: argparse.Namespace | None = None) -> None:
    """The report and plot from a finished run's workdir (`replay.json` + per-replay results)."""
    raw = json.loads((workdir / "replay.json").read_text())
    if args is not None:
        _add_floors(raw["meta"], args)
    summaries: list[RunSummary] = []
    outcomes_by_run: dict[tuple[str, float, str, int], list[dict[str, Any]]] = {}
    for row in raw["runs"]:
        s = RunSummary(**row)
        label = run_label(s.trace, s.load, s.router, s.seed if raw["meta"].get("seeds") else None)
        path = _run_dir(workdir, label) / "results.json"
        if path.exists():
            outcomes = outcomes_by_run[(s.trace, s.load, s.router, s.seed)] = json.loads(path.read_text())
            if math.isnan(s.queue_p90_s):  # written before the field existed
                s = dataclasses.replace(s, queue_p90_s=queue_p90(outcomes))
        summaries.append(s)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_path = out.with_name(out.stem + "-ttft-cdf.png")
    plotted = report.plot_cdfs(outcomes_by_run, summaries, plot_path)
    out.write_text(report.markdown(raw["meta"], summaries, plot_path.name if plotted else None))


def _add_floors(meta: dict[str, Any], args: argparse.Namespace) -> None:
    """Each workload's no-queue TTFT floor p90 (`stats.ttft_floors`), for runs recorded without it."""
    preset = meta.get("preset", args.preset)
    for key, w in meta["workloads"].items():
        if "ttft_floor_p90_s" in w:
            continue
        name, _, tag = key.partition(" s")
        seed = int(tag) if tag else int(meta.get("seed", args.seed))
        found = [
            x for x in _workloads(args, seed, args.traces / "mooncake" / "synthetic_trace.jsonl") if x.name == name
        ]
        if found and len(found[0].requests) == w["requests"]:
            w["ttft_floor_p90_s"] = percentile(ttft_floors(best_case_cached_tokens(found[0].requests), preset), 90)


def _workloads(args: argparse.Namespace, seed: int, mooncake_path: Path) -> list[Workload]:
    """The traces of one round: the Mooncake subset depends on the seed, the Azure rows do not."""
    workloads = [
        Workload(
            "mooncake",
            load_mooncake(mooncake_path, args.mooncake_requests, seed, MAX_MODEL_LEN),
            [float(x) for x in args.loads.split(",")],
            "Mooncake synthetic trace, random whole conversations",
            args.time_scale,
        )
    ]
    if args.azure_trace != "none":
        azure_path = args.traces / "azure_llm_2023" / f"AzureLLMInferenceTrace_{args.azure_trace}.csv"
        if azure_path.exists():
            workloads.append(
                Workload(
                    f"azure-{args.azure_trace}",
                    load_azure(azure_path, args.azure_requests, 0, MAX_MODEL_LEN),
                    [float(x) for x in args.azure_loads.split(",")],
                    f"Azure LLM inference 2023 ({args.azure_trace}), first rows, no prefix sharing",
                    args.azure_time_scale,
                )
            )
        else:
            print(f"note: {azure_path} missing, Azure rows skipped", file=sys.stderr)
    return workloads


def _describe(w: Workload, preset: str) -> dict[str, Any]:
    floors = ttft_floors(best_case_cached_tokens(w.requests), preset)
    return {
        "ttft_floor_p90_s": percentile(floors, 90),
        "description": w.description,
        "requests": len(w.requests),
        "mean_prompt_tokens": sum(r.input_tokens for r in w.requests) / len(w.requests),
        "mean_output_tokens": sum(r.output_tokens for r in w.requests) / len(w.requests),
        "infinite_cache_hit_ratio": infinite_cache_hit_ratio(w.requests),
        "trace_span_s": w.requests[-1].arrival_s - w.requests[0].arrival_s,
        "loads": w.loads,
        "time_scale": w.time_scale,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only:
        if args.workdir is None:
            raise SystemExit("--report-only needs --workdir")
        write_report(args.workdir, args.out or RESULTS / "replay.md", args)
        return 0
    if args.quick:
        args.mooncake_requests, args.azure_requests = min(args.mooncake_requests, 60), min(args.azure_requests, 40)
        args.loads, args.azure_loads = "0.8", "0.8"
        if args.routers == "all":
            args.routers = "round-robin,tokenway-approx"
    mooncake_path = args.traces / "mooncake" / "synthetic_trace.jsonl"
    if not mooncake_path.exists():
        print(f"trace missing: {mooncake_path} (the shared traces folder is needed)", file=sys.stderr)
        return 2
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    multi = len(seeds) > 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tokenway-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", file=sys.stderr)
    if args.out is None:
        args.out = workdir / "replay.md" if args.quick else RESULTS / "replay.md"
    t_start = time.monotonic()
    cpu_start = os.times()
    summaries: list[RunSummary] = []
    capacities: dict[str, dict[str, Any]] = {}
    described: dict[str, dict[str, Any]] = {}
    time_scales: dict[str, float] = {}
    routers: list[fronts.RouterSpec] = []

    def save() -> None:
        """replay.json after every replay: a run cut short still reports what it measured."""
        cpu_now = os.times()
        meta = {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "engines": args.engines,
            "preset": args.preset,
            "time_scales": time_scales,
            "elapsed_s": time.monotonic() - t_start,
            "children_cpu_s": (cpu_now.children_user + cpu_now.children_system)
            - (cpu_start.children_user + cpu_start.children_system),
            "seed": seeds[0],
            "seeds": seeds if multi else None,
            "capacities": capacities,
            "cpu": CPU_LOG,
            "workloads": described,
            "routers": [{"name": s.name, "note": s.note} for s in routers],
            "argv": sys.argv[1:] if argv is None else argv,
        }
        raw = {"meta": meta, "runs": [s.row() for s in summaries]}
        (workdir / "replay.json").write_text(json.dumps(raw, indent=1))

    for seed in seeds:
        tag = f" s{seed}" if multi else ""
        workloads = _workloads(args, seed, mooncake_path)
        routers = _routers(args, seed)
        for w in workloads:
            n = len(w.requests)
            hit = infinite_cache_hit_ratio(w.requests)
            described[w.name + tag] = _describe(w, args.preset)
            time_scales[w.name] = w.time_scale
            print(f"{w.name}{tag}: {n} requests, mean prompt {described[w.name + tag]['mean_prompt_tokens']:,.0f} "
                  f"tokens, infinite-cache block hit ratio {hit:.1%}", file=sys.stderr)  # fmt: skip
            fleet = fleet_mod.start_fleet(
                workdir / (w.name + tag.replace(" ", "-")), engines=args.engines, preset=args.preset,
                time_scale=w.time_scale, served_model=MODEL,
            )  # fmt: skip
            try:
                given = args.capacity if w.name == "mooncake" else args.azure_capacity
                if given is not None:
                    capacity, detail = given, {"capacity_rps": given, "given": True}
                else:
                    capacity, detail = measure_capacity(fleet, w, args, workdir, seed, tag)
                capacities[w.name + tag] = detail
                for load in w.loads:
                    rate = load * capacity
                    arrivals = [a / w.time_scale for a in scaled_arrivals(w.requests, rate)]
                    for spec in routers:
                        label = run_label(w.name, load, spec.name, seed if multi else None)
                        outcomes, hit, per_engine, wall_s, cpu_busy = replay(
                            spec, fleet, w.requests, arrivals, label=label, workdir=workdir, seed=seed
                        )
                        summary = summarize(
                            trace=w.name, load=load, router=spec.name, offered_rps=rate, outcomes=outcomes,
                            wall_s=wall_s, time_scale=w.time_scale, cache_hit_rate=hit, per_engine=per_engine,
                            host_cpu_busy=cpu_busy, seed=seed,
                        )  # fmt: skip
                        summaries.append(summary)
                        save()
                        print(f"  {label}: ttft p50 {summary.ttft_p50_s:.2f}s p90 {summary.ttft_p90_s:.2f}s "
                              f"hit {hit:.1%} ok {summary.ok}/{summary.requests} cpu {cpu_busy:.0%}",
                              file=sys.stderr)  # fmt: skip
            finally:
                with contextlib.suppress(Exception):
                    fleet.stop()
    save()
    write_report(workdir, args.out, args)
    print(f"wrote {args.out} ({(time.monotonic() - t_start) / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
