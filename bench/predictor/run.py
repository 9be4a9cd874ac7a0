"""Latency predictor and SLO gate on the simulated fleet, through the gateway.

    .venv/bin/python -m bench.predictor.run [--engines 2] [--time-scale 0.25] [--loads 0.5,0.7,0.9]

1. Start N simulated Llama-3.1-8B@H100 engines (one process, `--time-scale K`: K engine seconds per
   wall second; K < 1 slows the engines so that the gateway, the engines and the client, all
   Python on this 2-vCPU machine, are never the bottleneck).
2. Capacity: a closed loop of Azure-conversation requests (more in flight than the engines batch),
   steady completions per second = the fleet's capacity for that workload.
3. Training: other windows of the trace at 50, 70 and 90 % of capacity, back to back as one
   schedule, through a gateway whose predictor saves its models (so the model has seen every load,
   and mostly the steady state a fleet is in, not ramps from idle).
4. Per load (a share of capacity) and mode, a fresh gateway that loads the trained model replays the
   same Azure window for `--duration-s` engine seconds, arrivals rescaled to the load (open loop):
     off: the default routing pipeline, no SLO classes (the predictor still predicts and learns);
     on:  the default pipeline plus the `latency` scorer, and SLO classes: the interactive tenant
          queues (bounded by its TTFT objective) on a miss, the sheddable tenant is shed.
   Plus the Mooncake synthetic trace (long, shared prefixes) at one load, for accuracy.
5. Writes bench/results/predictor.md, predictor.png (predicted vs actual) and predictor-slo.png.

Accuracy is measured on every served request with the prediction the gateway made for the
endpoint that served it, before it ran (`x-tokenway-prediction`, a debug header), against the
latency the client saw (a queued request's wait is subtracted: it was predicted at dispatch).
All latencies are reported in engine time (wall x K), rates in engine-time requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.predictor import report
from bench.predictor.workload import (
    PromptBuilder,
    TraceRequest,
    arrivals_at,
    load_azure,
    load_mooncake,
    with_sheddable_share,
)
from policies.policy import hash_key
from policies.routing.config import RoutingConfig
from tests.support.procs import Gateway, SimEngines, start_gateway, start_sim, static_pool, stop_process

MODEL = "llama-3.1-8b"
PRESET = "llama-3.1-8b@h100"
INTERACTIVE_KEY = "sk-bench-interactive"
SHEDDABLE_KEY = "sk-bench-sheddable"
KEYS = {False: INTERACTIVE_KEY, True: SHEDDABLE_KEY}
MAX_CONTEXT = 16384
MAX_OUTPUT = 1000


def policies(slo: dict[str, Any] | None) -> dict[str, Any]:
    classes = {"slo_classes": {"interactive": slo}} if slo else {}
    tenant_class = {"slo_class": "interactive"} if slo else {}
    return {
        "tenants": {"interactive": {**tenant_class}, "batch": {"priority": "sheddable", **tenant_class}},
        "keys": [
            {"id": "interactive", "tenant": "interactive", "sha256": hash_key(INTERACTIVE_KEY)},
            {"id": "batch", "tenant": "batch", "sha256": hash_key(SHEDDABLE_KEY)},
        ],
        "models": {MODEL: {"context_length": MAX_CONTEXT}},
        **classes,
    }


def routing_with_latency(weight: float) -> dict[str, Any]:
    default = RoutingConfig().default.model_dump()
    default["scorers"] = [*default["scorers"], {"type": "latency", "weight": weight, "params": {}}]
    return {"default": default}


# mode -> (SLO classes, latency scorer); a gated mode may name its class's `compare` after a dash:
# "on-p90", "on-mean", or "on-0.3" (compare: probability, min_probability 0.3)
MODES: dict[str, tuple[bool, bool]] = {
    "off": (False, False),
    "on": (True, True),
    "scorer": (False, True),
    "gate": (True, False),
}


def mode_parts(mode: str) -> tuple[bool, bool, dict[str, Any]]:
    """(SLO classes, latency scorer, the class's compare settings) of a mode name."""
    base, _, variant = mode.partition("-")
    slo, latency = MODES[base]
    if not variant:
        return slo, latency, {}
    if variant in ("p90", "mean"):
        return slo, latency, {"compare": variant}
    return slo, latency, {"compare": "probability", "min_probability": float(variant)}


def start_bench_gateway(
    workdir: Path, sims: SimEngines, args: argparse.Namespace, model_dir: Path, *, mode: str, **sections: Any
) -> Gateway:
    slo, latency, compare = mode_parts(mode)
    slo_class = None
    if slo:
        slo_class = {
            "ttft_ms": args.ttft_slo_ms * (1.0 - args.headroom) / args.time_scale,
            "tpot_ms": args.tpot_slo_ms * (1.0 - args.headroom) / args.time_scale,
            "on_miss": "queue",
            "max_queue_ms": args.ttft_slo_ms / args.time_scale,
            **compare,
        }
    predictor = {
        "model_dir": str(model_dir),
        "prior": {"time_scale": args.time_scale},
        "export_samples": 20_000,  # every outcome of a run, for GET /admin/predictor/samples
        **args.predictor,
    }
    config: dict[str, Any] = {"predictor": predictor, "ledger": {"enabled": False}, "server": {"drain_timeout_s": 1}}
    if latency:
        config["routing"] = routing_with_latency(args.latency_weight)
    return start_gateway(
        workdir,
        pools=[static_pool("llama", MODEL, sims.urls, preset=PRESET)],
        policies=policies(slo_class),
        **config,
        **sections,
    )


def shots_of(
    requests: list[TraceRequest], arrivals: list[float], prompts: PromptBuilder, salt: str, *, debug: bool = True
) -> list[loadgen.Shot]:
    """Streamed completions of the trace's lengths; `KEYS[sheddable]` authenticates each, and the
    debug header asks for the gateway's prediction (the accuracy columns)."""
    return [
        loadgen.Shot(
            at,
            loadgen.completion_body(MODEL, prompts.prompt(r, salt), r.output_tokens),
            loadgen.bearer(KEYS[r.sheddable], debug=debug),
        )
        for r, at in zip(requests, arrivals, strict=True)
    ]


def outcome_rows(requests: list[TraceRequest], outcomes: list[loadgen.Outcome]) -> list[dict[str, Any]]:
    """The report's rows: each outcome with its trace request's tenant and lengths."""
    return [
        {**o.row(), "sheddable": r.sheddable, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
        for r, o in zip(requests, outcomes, strict=True)
    ]


def admin(gw: Gateway, path: str) -> Any:
    with urllib.request.urlopen(gw.url + path, timeout=10) as response:
        return json.loads(response.read())


def wait_idle(sims: SimEngines, timeout_s: float = 600.0) -> None:
    """Until every engine reports nothing running or waiting (the previous run drained)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in sims.urls:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
                for line in response.read().decode().splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        time.sleep(0.5)
    raise TimeoutError("engines still busy")


def measure_capacity(sims: SimEngines, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Closed loop over the measured window itself: capacity depends on the lengths (the trace's
    mean output varies 130-260 tokens between windows)."""
    requests = load_azure(args.capacity_requests, 0, MAX_CONTEXT, MAX_OUTPUT)
    gw = start_bench_gateway(workdir / "capacity", sims, args, workdir / "models-scratch", mode="off")
    try:
        started = time.perf_counter()
        shots = shots_of(requests, [0.0] * len(requests), PromptBuilder(7), "capacity", debug=False)
        outcomes = asyncio.run(loadgen.closed_loop(gw.url, shots, args.engines * 320, label="capacity"))
        wall_s = time.perf_counter() - started
    finally:
        gw.stop()
    ends = sorted(o.scheduled_s + o.e2e_s for o in outcomes if o.ok)
    steady = ends[len(ends) // 5 : len(ends) * 4 // 5]
    rate_wall = (len(steady) - 1) / (steady[-1] - steady[0])
    return {
        "rate_wall": rate_wall,
        "requests": len(outcomes),
        "ok": len(ends),
        "wall_s": wall_s,
        "mean_input": sum(r.input_tokens for r in requests) / len(requests),
        "mean_output": sum(r.output_tokens for r in requests) / len(requests),
    }


def run_one(
    name: str,
    sims: SimEngines,
    args: argparse.Namespace,
    workdir: Path,
    trained: Path,
    segments: list[tuple[list[TraceRequest], float]],
    *,
    mode: str,
    seed: int,
) -> dict[str, Any]:
    """A fresh gateway (with a copy of the `trained` models) replays the (requests, wall rate)
    segments back to back, as one open-loop schedule (no drain between them)."""
    wait_idle(sims)
    model_dir = workdir / f"models-{name}"
    shutil.copytree(trained, model_dir)
    gw = start_bench_gateway(workdir / name, sims, args, model_dir, mode=mode)
    requests: list[TraceRequest] = []
    arrivals: list[float] = []
    for segment, rate_wall in segments:
        offset = arrivals[-1] + 1.0 / rate_wall if arrivals else 0.0
        arrivals += [offset + at for at in arrivals_at(segment, rate_wall)]
        requests += [replace(r, index=len(requests) + i) for i, r in enumerate(segment)]
    try:
        before = admin(gw, "/admin/predictor")
        started = time.perf_counter()
        shots = shots_of(requests, arrivals, PromptBuilder(seed), name)
        outcomes = asyncio.run(loadgen.replay(gw.url, shots, label=name, timeout_s=600))
        rows = outcome_rows(requests, outcomes)
        wall_s = time.perf_counter() - started
        status = admin(gw, "/admin/predictor")
        samples = admin(gw, "/admin/predictor/samples")["pools"] if args.raw else {}
    finally:
        gw.stop()
    return {
        "name": name,
        "mode": mode,
        "slo": mode_parts(mode)[0],
        "rate_wall": segments[-1][1],
        "wall_s": wall_s,
        "rows": rows,
        "predictor_before": before,
        "predictor_after": status,
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=0.25, help="engine seconds per wall second")
    parser.add_argument("--loads", default="0.5,0.7,0.9", help="shares of measured capacity")
    parser.add_argument(
        "--duration-s",
        type=float,
        default=90.0,
        help="engine seconds of arrivals per run (the last --skip-cooldown-s are not measured)",
    )
    parser.add_argument("--train-duration-s", type=float, default=60.0, help="per training load (50/70/90 %%)")
    parser.add_argument("--capacity-requests", type=int, default=1500)
    parser.add_argument("--capacity", type=float, default=None, help="skip the probe: engine-time req/s")
    parser.add_argument("--mooncake-load", type=float, default=0.7, help="0 skips the Mooncake run")
    parser.add_argument("--mooncake-requests", type=int, default=400)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="engine-time TTFT objective")
    parser.add_argument("--tpot-slo-ms", type=float, default=75.0, help="engine-time TPOT objective")
    parser.add_argument(
        "--headroom", type=float, default=0.0, help="the gate's class is this much tighter than the objective measured"
    )
    parser.add_argument("--sheddable-share", type=float, default=0.3)
    parser.add_argument("--latency-weight", type=float, default=2.0)
    parser.add_argument(
        "--modes",
        default="off,on,scorer",
        help="off, on (scorer + SLO gate); ablations at the top load: scorer (only), gate (only)",
    )
    parser.add_argument(
        "--skip-warmup-s",
        type=float,
        default=30.0,
        help="engine seconds of each run's first arrivals left out of the statistics (ramp-up)",
    )
    parser.add_argument(
        "--skip-cooldown-s",
        type=float,
        default=15.0,
        help="engine seconds of each run's last arrivals left out of the statistics: they keep "
        "the measured requests' futures real (when arrivals stop, running requests speed up)",
    )
    parser.add_argument("--predictor", type=json.loads, default={}, help="extra predictor settings (JSON)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--out", type=Path, default=report.RESULTS / "predictor.md")
    parser.add_argument("--raw", type=Path, default=Path("var/bench/predictor-raw.json"), help="per-request data")
    args = parser.parse_args()

    loads = [float(x) for x in args.loads.split(",") if x]
    workdir = Path(tempfile.mkdtemp(prefix="bench-predictor-"))
    print(f"work directory {workdir}", file=sys.stderr)
    sims = start_sim(workdir, count=args.engines, preset=PRESET, served_model_name=MODEL, time_scale=args.time_scale)
    started = time.time()
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [],
    }
    try:
        if args.capacity is None:
            print("capacity probe (closed loop)", file=sys.stderr)
            results["capacity"] = measure_capacity(sims, args, workdir)
        else:
            results["capacity"] = {"rate_wall": args.capacity * args.time_scale, "given": True}
        capacity_wall = results["capacity"]["rate_wall"]
        print(f"capacity {capacity_wall / args.time_scale:.1f} req/s (engine time)", file=sys.stderr)

        capacity = capacity_wall / args.time_scale  # engine-time req/s

        def window(start: int, load: float, duration_s: float) -> tuple[list[TraceRequest], float]:
            count = max(50, int(load * capacity * duration_s))
            requests = with_sheddable_share(
                load_azure(count, start, MAX_CONTEXT, MAX_OUTPUT), args.sheddable_share, seed=start
            )
            return requests, load * capacity_wall

        trained = workdir / "models-trained"
        training = [window(6000 + 3000 * k, load, args.train_duration_s) for k, load in enumerate((0.5, 0.7, 0.9))]
        results["training"] = {
            k: v
            for k, v in run_one("train", sims, args, workdir, _empty(workdir), training, mode="off", seed=11).items()
            if k != "rows"
        }
        shutil.copytree(workdir / "models-train", trained)

        azure_work = 0.0
        for i, load in enumerate(loads):
            segment = window(0, load, args.duration_s)
            azure_work = _work(segment[0])
            for mode in args.modes.split(","):
                if mode not in ("off", "on") and load != max(loads):
                    continue  # the ablations run at the top load only
                name = f"azure-{int(load * 100)}-{mode}"
                run = run_one(name, sims, args, workdir, trained, [segment], mode=mode, seed=100 + i)
                run.update(trace="azure", load=load)
                results["runs"].append(run)
        if args.mooncake_load > 0:
            mooncake = with_sheddable_share(
                load_mooncake(args.mooncake_requests, 3, MAX_CONTEXT, MAX_OUTPUT), args.sheddable_share, 4
            )
            work_ratio = _work(mooncake) / (azure_work or _work(window(0, 0.5, 10)[0]))
            rate = args.mooncake_load * capacity_wall / work_ratio
            run = run_one("mooncake", sims, args, workdir, trained, [(mooncake, rate)], mode="off", seed=300)
            run.update(trace="mooncake", load=args.mooncake_load, work_ratio=work_ratio)
            results["runs"].append(run)
    finally:
        stop_process(sims.proc)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    results["duration_s"] = time.time() - started
    results["host"] = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    args.raw.write_text(json.dumps(results))  # every request's outcome: re-render with `report.py RAW`
    report.write(results, args.out)
    print(f"wrote {args.out} ({results['duration_s'] / 60:.1f} min)", file=sys.stderr)


def _empty(workdir: Path) -> Path:
    path = workdir / "models-empty"
    path.mkdir(exist_ok=True)
    return path


def _work(requests: list[TraceRequest]) -> float:
    """Rough engine work per request relative to another trace: prefill tokens count a tenth of a
    decoded one (batched prefill is cheap per token), so capacity scales with this."""
    return sum(0.1 * r.input_tokens + r.output_tokens for r in requests) / len(requests)


if __name__ == "__main__":
    main()
