"""The SLO benchmark's batch row: interactive attainment with a large batch running beside it.

    .venv/bin/python -m bench.predictor.batch [--loads 0.8] [--batch-lines 300] [--capacity 15.4]
        [--repeat-alone] [--paced]

Same fleet, workload and objectives as `bench.predictor.run` (2 simulated Llama-3.1-8B@H100 at
`--time-scale 0.25`, the Azure conversation trace replayed open loop, TTFT <= 1 s and TPOT <= 75 ms in
engine time, the `on` mode: SLO classes and the latency scorer). Per load, two fresh gateways replay
the same window of interactive requests:

  alone:  the interactive requests only;
  batch:  the same, with a Batch API batch of `--batch-lines` requests (another window of the trace:
          its prompts and output lengths) created just before the first interactive request, by a
          key of another tenant, through the official client's endpoints. It runs beside the
          interactive traffic, on spare capacity only, and on after it until done.

  alone-2 (`--repeat-alone`): the alone run again, after the batch run: how far two runs of the
          same window differ with no batch at all (the noise a batch's effect is judged against).

Plus one run of the batch with no interactive traffic at all (its completion time on an idle fleet).
Every run samples the gateway's batch gauges, so each miss can be set beside what the batch was
doing when it came (`bench.predictor.batch_misses`).
Reports interactive attainment alone vs beside the batch (target: within 1 point), the latency
percentiles, the batch lines done while the interactive window lasted, and the batch's completion
time, all in engine time. Writes bench/results/batch-slo.md and batch-slo.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import loadgen, notes
from bench.predictor import report
from bench.predictor.batch_misses import BatchSampler, miss_rows, report_lines
from bench.predictor.run import (
    MAX_CONTEXT,
    MAX_OUTPUT,
    MODEL,
    PRESET,
    SHEDDABLE_KEY,
    admin,
    outcome_rows,
    run_one,
    shots_of,
    start_bench_gateway,
    wait_idle,
)
from bench.predictor.workload import PromptBuilder, TraceRequest, arrivals_at, load_azure
from tests.support.procs import SimEngines, start_sim, stop_process

MODE_WORDS = {
    "on": "SLO classes and the latency scorer: the batch gate also checks each line's predicted latency",
    "off": "the default routing, no SLO classes: the batch gate judges by engine queue, KV use and its cap",
}
BATCH_KEY = SHEDDABLE_KEY  # the benchmark's second tenant ("batch") makes the batch
RESULTS = report.RESULTS


@dataclass(slots=True)
class BatchProgress:
    created_s: float = 0.0  # wall, perf_counter
    done_s: float | None = None
    status: str = ""
    points: list[tuple[float, int]] = field(default_factory=list)  # (wall s since created, lines completed)
    completed: int = 0
    failed: int = 0


def batch_file(requests: list[TraceRequest], prompts: PromptBuilder, salt: str) -> bytes:
    rows = [
        {
            "custom_id": f"line-{r.index}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": prompts.prompt(r, salt),
                "max_tokens": r.output_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for r in requests
    ]
    return b"\n".join(orjson.dumps(row) for row in rows) + b"\n"


async def create_batch(base_url: str, content: bytes) -> str:
    headers = {"Authorization": f"Bearer {BATCH_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="batch.jsonl", content_type="application/jsonl")
        async with session.post(base_url + "/v1/files", data=form) as response:
            file = await response.json()
            if response.status != 200:
                raise RuntimeError(f"upload failed: {file}")
        body = {"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        async with session.post(base_url + "/v1/batches", json=body) as response:
            batch = await response.json()
            if response.status != 200:
                raise RuntimeError(f"batch create failed: {batch}")
    return str(batch["id"])


async def follow(base_url: str, batch_id: str, progress: BatchProgress, stop: asyncio.Event, limit_s: float) -> None:
    """Poll the batch until it is finished (or `limit_s`), noting its progress over time."""
    headers = {"Authorization": f"Bearer {BATCH_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        while time.perf_counter() - progress.created_s < limit_s:
            async with session.get(f"{base_url}/v1/batches/{batch_id}") as response:
                batch = await response.json()
            counts = batch.get("request_counts") or {}
            progress.status = batch["status"]
            progress.completed, progress.failed = int(counts.get("completed", 0)), int(counts.get("failed", 0))
            progress.points.append((time.perf_counter() - progress.created_s, progress.completed))
            if progress.status in ("completed", "failed", "expired", "cancelled"):
                progress.done_s = time.perf_counter() - progress.created_s
                if progress.status == "completed":
                    progress.completed = int(counts.get("total", progress.completed))
                return
            with contextlib.suppress(TimeoutError):  # poll once a second until stopped
                await asyncio.wait_for(stop.wait(), 1.0)


async def run_beside(
    base_url: str,
    interactive: list[TraceRequest],
    arrivals: list[float],
    content: bytes | None,
    name: str,
    seed: int,
    limit_s: float,
) -> tuple[list[Any], BatchProgress | None, float, list[tuple[float, int, int]]]:
    """Create the batch (if any), replay the interactive window (sampling the batch's gauges), follow
    the batch to its end."""
    progress: BatchProgress | None = None
    follower: asyncio.Task[None] | None = None
    stop = asyncio.Event()
    if content is not None:
        batch_id = await create_batch(base_url, content)
        progress = BatchProgress(created_s=time.perf_counter())
        follower = asyncio.create_task(follow(base_url, batch_id, progress, stop, limit_s))
    started = time.perf_counter()
    sampler = BatchSampler(base_url)
    sampler.start(started)
    shots = shots_of(interactive, arrivals, PromptBuilder(seed), name)
    outcomes = await loadgen.replay(base_url, shots, label=name, timeout_s=600) if interactive else []
    window_s = time.perf_counter() - started
    samples = await sampler.stop()
    if follower is not None:
        await follower
    return outcomes, progress, window_s, samples


def run(
    name: str,
    sims: SimEngines,
    args: argparse.Namespace,
    workdir: Path,
    trained: Path,
    interactive: list[TraceRequest],
    rate_wall: float,
    content: bytes | None,
    seed: int,
) -> dict[str, Any]:
    wait_idle(sims)
    model_dir = workdir / f"models-{name}"
    shutil.copytree(trained, model_dir)
    batch = {
        "dir": str(workdir / name / "batch"),
        "runner": {"max_lines_per_endpoint": args.max_lines_per_endpoint},
        "spare": {"slo_headroom": args.slo_headroom, "paced_starts": args.paced},
    }
    gw = start_bench_gateway(workdir / name, sims, args, model_dir, mode=args.mode, batch=batch)
    arrivals = arrivals_at(interactive, rate_wall) if interactive else []
    try:
        outcomes, progress, window_s, samples = asyncio.run(
            run_beside(gw.url, interactive, arrivals, content, name, seed, args.batch_limit_s)
        )
        metrics = _batch_metrics(gw.url)
        status = admin(gw, "/admin/predictor")
    finally:
        gw.stop()
    ts = args.time_scale
    out: dict[str, Any] = {
        "name": name,
        "mode": args.mode,
        "slo": True,
        "trace": "azure",
        "rate_wall": rate_wall,
        "rows": outcome_rows(interactive, outcomes),
        "window_s": window_s * ts,
        "predictor_after": status,
        "batch_metrics": metrics,
        "batch_samples": samples,
    }
    if progress is not None:
        during = max((n for t, n in progress.points if t <= window_s), default=0)
        out["batch"] = {
            "status": progress.status,
            "completed": progress.completed,
            "failed": progress.failed,
            "done_s": progress.done_s * ts if progress.done_s is not None else None,
            "during_window": during,
            "points": [(t * ts, n) for t, n in progress.points],
        }
    return out


def _batch_metrics(url: str) -> dict[str, float]:
    import urllib.request

    found: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("tokenway_batch_"):
                key, _, value = line.rpartition(" ")
                found[key] = float(value)
    return found


def write(results: dict[str, Any], out: Path) -> None:
    args = results["args"]
    ts = args["time_scale"]
    lines = [
        "# Batch beside interactive traffic: the SLO benchmark's batch row",
        "",
        f"Generated by `python -m bench.predictor.batch` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({results['host']}) in {results['duration_s'] / 60:.0f} min"
        + (
            ". Host load average (1/5/15 min) before: "
            + " / ".join(f"{x:.2f}" for x in results["load_before"])
            + ", after: "
            + " / ".join(f"{x:.2f}" for x in results["load_after"])
            if "load_before" in results
            else ""
        )
        + ".",
        "",
        "## Setup",
        "",
        f"- Fleet, workload and objectives of `bench.predictor.run` (its [results](predictor.md)): "
        f"{args['engines']} simulated Llama-3.1-8B@H100 at `--time-scale {ts}`, the Azure conversation trace "
        f"replayed open loop for {args['duration_s']:.0f} engine seconds per run (statistics over the arrivals "
        f"from {args['skip_warmup_s']:.0f} s to {args['duration_s'] - args['skip_cooldown_s']:.0f} s), "
        f"TTFT <= {args['ttft_slo_ms']:.0f} ms and TPOT <= {args['tpot_slo_ms']:.0f} ms in engine time; mode "
        f"`{args['mode']}` ({MODE_WORDS.get(args['mode'], 'see bench.predictor.run')}); "
        f"capacity {args['capacity']:.1f} req/s; the predictor "
        f"learned {args['train_duration_s']:.0f} s at {int(args['train_load'] * 100)} % load first.",
        f"- The batch: {args['batch_lines']} `/v1/completions` lines from another window of the trace "
        f"(mean prompt {results['batch_mean_input']:.0f}, output {results['batch_mean_output']:.0f} tokens; "
        f"{results['batch_tokens']:,} output tokens in all), uploaded and created through `/v1/files` and "
        "`/v1/batches` just before the first interactive request, by a key of another tenant. Batch settings: "
        f"`runner.max_lines_per_endpoint: {args['max_lines_per_endpoint']}`, `spare.slo_headroom: "
        f"{args['slo_headroom']}`, `spare.paced_starts: {str(args.get('paced', False)).lower()}`, the rest the "
        "defaults (no engine queue, KV under 60 %, nobody waiting in the gateway for the pool).",
        "- Per load, **alone** replays the interactive window on a fresh gateway; **batch** replays the same "
        "window beside the batch."
        + (
            " **alone-2** replays it alone once more, after the batch run (the noise)."
            if args.get("repeat_alone")
            else ""
        )
        + (" **idle** runs the batch on an idle fleet." if results.get("idle") else ""),
        "",
        "## Interactive attainment, alone and beside the batch",
        "",
        "| load | run | interactive req | attainment | vs alone | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms "
        "| batch lines done in the window | batch done after (s) |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    by_load: dict[float, dict[str, dict[str, Any]]] = {}
    for summary in results["summaries"]:
        by_load.setdefault(summary["load"], {})[summary["kind"]] = summary
    verdicts: list[tuple[float, float]] = []
    noise: list[tuple[float, float]] = []
    for load, kinds in sorted(by_load.items()):
        alone = kinds.get("alone")
        for kind in ("alone", "batch", "alone-2"):
            s = kinds.get(kind)
            if s is None:
                continue
            delta = ""
            if kind != "alone" and alone is not None and s["attainment"] is not None:
                points = (s["attainment"] - alone["attainment"]) * 100
                delta = f"{points:+.1f} pt"
                (verdicts if kind == "batch" else noise).append((load, points))
            batch = s.get("batch") or {}
            ttft = " / ".join(report._f(x, 0) for x in s["ttft"])
            tpot = " / ".join(report._f(x, 1) for x in s["tpot"])
            done = report._f(batch.get("done_s"), 0) if batch else ""
            lines.append(
                f"| {int(load * 100)} % | {kind} | {s['offered']} | {report._f(s['attainment'], pct=True)} | {delta} "
                f"| {ttft} | {tpot} | {batch.get('during_window', '') if batch else ''} | {done} |"
            )
    idle = results.get("idle")
    if idle is not None:
        batch = idle["batch"]
        lines.append(f"| — | idle | 0 | — | — | — | — | — | {report._f(batch.get('done_s'), 0)} |")
    lines += ["", ""]
    within = all(abs(points) <= 1.0 for _load, points in verdicts)
    lines.append(
        "Interactive attainment beside the batch vs alone: "
        + ", ".join(f"{points:+.1f} points at {int(load * 100)} %" for load, points in verdicts)
        + f" (target: within 1 point: **{'yes' if within else 'no'}**)."
    )
    if noise:
        lines.append(
            "The same window alone twice (alone-2 vs alone, no batch): "
            + ", ".join(f"{points:+.1f} points at {int(load * 100)} %" for load, points in noise)
            + " — the run-to-run noise the batch's effect is measured against."
        )
    for load, kinds in sorted(by_load.items()):
        batch = (kinds.get("batch") or {}).get("batch")
        if batch and idle is not None and idle["batch"].get("done_s") and batch.get("done_s"):
            lines.append(
                f"At {int(load * 100)} % load the batch finished {batch['done_s']:.0f} s after it was created "
                f"({batch['during_window']} of {args['batch_lines']} lines while the interactive window lasted), "
                f"{batch['done_s'] / idle['batch']['done_s']:.2f}x its time on an idle fleet "
                f"({idle['batch']['done_s']:.0f} s)."
            )
    lines += ["", notes.plot_line(out, "batch beside interactive traffic"), ""]
    if results.get("misses"):
        lines += report_lines([(m["name"], m) for m in results["misses"]], args)
    lines += ["## Runner counters (each batch run's gateway)", "", "| run | metric | value |", "| --- | --- | ---: |"]
    for summary in [*results["summaries"], *([idle] if idle else [])]:
        for key, value in sorted((summary.get("batch_metrics") or {}).items()):
            if value:
                lines.append(f"| {summary['name']} | `{key}` | {value:,.0f} |")
    lines += ["", *notes.section(out)]
    out.write_text("\n".join(lines) + "\n")
    _plot(results, out.with_suffix(".png"))


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    loads = sorted({s["load"] for s in results["summaries"]})
    width = 0.35
    for offset, kind in ((-width / 2, "alone"), (width / 2, "batch")):
        values = []
        for load in loads:
            found = [s for s in results["summaries"] if s["load"] == load and s["kind"] == kind]
            values.append((found[0]["attainment"] or 0) * 100 if found else 0)
        left.bar([i + offset for i in range(len(loads))], values, width, label=kind)
    left.set_xticks(range(len(loads)), [f"{int(load * 100)} %" for load in loads])
    left.set_ylim(80, 100.5)
    left.set_ylabel("interactive SLO attainment (%)")
    left.set_title("interactive attainment, alone vs beside the batch")
    left.legend()
    for s in [*results["summaries"], *([results["idle"]] if results.get("idle") else [])]:
        batch = s.get("batch")
        if batch:
            label = "idle fleet" if s["kind"] == "idle" else f"beside {int(s['load'] * 100)} % load"
            right.plot([t for t, _ in batch["points"]], [n for _, n in batch["points"]], label=label)
    right.axvline(results["args"]["duration_s"], color="grey", linestyle=":", label="interactive window ends")
    right.set_xlabel("engine seconds since the batch was created")
    right.set_ylabel("lines completed")
    right.set_title("batch progress")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--loads", default="0.8")
    parser.add_argument("--duration-s", type=float, default=45.0, help="engine seconds of interactive arrivals")
    parser.add_argument("--capacity", type=float, default=15.4, help="engine req/s (bench.predictor.run)")
    parser.add_argument("--train-duration-s", type=float, default=20.0)
    parser.add_argument("--train-load", type=float, default=0.7)
    parser.add_argument("--batch-lines", type=int, default=300)
    parser.add_argument("--batch-max-output", type=int, default=256, help="cap on a batch line's output tokens")
    parser.add_argument("--batch-limit-s", type=float, default=600.0, help="wall seconds to wait for the batch")
    parser.add_argument("--max-lines-per-endpoint", type=int, default=8)
    parser.add_argument("--slo-headroom", type=float, default=0.5)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=75.0)
    parser.add_argument("--mode", default="on")
    parser.add_argument("--skip-warmup-s", type=float, default=20.0)
    parser.add_argument("--skip-cooldown-s", type=float, default=5.0)
    parser.add_argument("--no-idle", action="store_true", help="skip the batch-on-an-idle-fleet run")
    parser.add_argument("--repeat-alone", action="store_true", help="each load's alone run again, after the batch")
    parser.add_argument("--paced", action="store_true", help="spare.paced_starts: true (one prefill at a time)")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch-slo.md")
    parser.add_argument("--raw", type=Path, default=Path("var/bench/batch-slo-raw.json"))
    parser.add_argument("--report", type=Path, help="only rewrite the report from this raw file")
    args = parser.parse_args()
    if args.report is not None:
        write(json.loads(args.report.read_text()), args.out)
        return
    # what bench.predictor.run's gateway reads from its arguments
    args.headroom, args.latency_weight, args.predictor = 0.0, 2.0, {}

    loads = [float(x) for x in args.loads.split(",") if x]
    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    print(f"work directory {workdir}", file=sys.stderr)
    batch_requests = load_azure(args.batch_lines, 12_000, MAX_CONTEXT, args.batch_max_output)
    content = batch_file(batch_requests, PromptBuilder(77), "batch")
    sims = start_sim(workdir, count=args.engines, preset=PRESET, served_model_name=MODEL, time_scale=args.time_scale)
    started = time.time()
    load_before = os.getloadavg()
    capacity_wall = args.capacity * args.time_scale
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summaries": [],
        "batch_mean_input": sum(r.input_tokens for r in batch_requests) / len(batch_requests),
        "batch_mean_output": sum(r.output_tokens for r in batch_requests) / len(batch_requests),
        "batch_tokens": sum(r.output_tokens for r in batch_requests),
    }
    raw_runs = []
    try:
        training = load_azure(
            max(50, int(args.train_load * args.capacity * args.train_duration_s)), 6000, MAX_CONTEXT, MAX_OUTPUT
        )
        empty = workdir / "models-empty"
        empty.mkdir()
        run_one("train", sims, args, workdir, empty, [(training, args.train_load * capacity_wall)], mode="off", seed=11)
        trained = workdir / "models-trained"
        shutil.copytree(workdir / "models-train", trained)
        for i, load in enumerate(loads):
            count = max(50, int(load * args.capacity * args.duration_s))
            interactive = [replace(r, index=r.index) for r in load_azure(count, 0, MAX_CONTEXT, MAX_OUTPUT)]
            for kind in ("alone", "batch", *(("alone-2",) if args.repeat_alone else ())):
                name = f"azure-{int(load * 100)}-{kind}"
                print(f"run {name}", file=sys.stderr)
                raw = run(
                    name,
                    sims,
                    args,
                    workdir,
                    trained,
                    interactive,
                    load * capacity_wall,
                    content if kind == "batch" else None,
                    seed=100 + i,
                )
                raw.update(load=load)
                raw_runs.append(raw)
                summary = report.summarize(raw, vars(args))
                summary.update(kind=kind, batch=raw.get("batch"), batch_metrics=raw["batch_metrics"])
                results["summaries"].append(summary)
                results.setdefault("misses", []).append({"name": name, **miss_rows(raw, vars(args))})
        if not args.no_idle:
            print("run idle", file=sys.stderr)
            raw = run("idle", sims, args, workdir, trained, [], capacity_wall, content, seed=999)
            results["idle"] = {
                "name": "idle",
                "kind": "idle",
                "load": 0.0,
                "batch": raw["batch"],
                "batch_metrics": raw["batch_metrics"],
            }
    finally:
        stop_process(sims.proc)
        shutil.rmtree(workdir, ignore_errors=True)
    results["duration_s"] = time.time() - started
    results["load_before"], results["load_after"] = load_before, os.getloadavg()
    results["host"] = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    args.raw.write_text(json.dumps({**results, "runs": raw_runs}, default=str))
    write(results, args.out)
    print(f"wrote {args.out} ({results['duration_s'] / 60:.1f} min)", file=sys.stderr)


if __name__ == "__main__":
    main()
