"""Fairness under saturation, side by side: FIFO (no flow control), priority only, flow control
(strictly work-conserving), flow control with a slot reserve, and that on two gateway replicas
sharing Redis; each of the flow modes also with preemption (a light tenant's request that finds the
pool full cuts a stream of the flood, which waits its turn and continues), and the benchmark of
record, `flow-lane`: reserve, preemption and the clear lane (`reserve_clear_lane`), on one replica
and on two (`flow-lane-2`). By default FIFO, priority only and the two `flow-lane` modes run.

    .venv/bin/python -m bench.fairness [--quick] [--time-scale 0.5] [--phase-s 120]

1. Two simulated Llama-3.1-8B@H100 engines (one process; `--max-num-seqs 8` so that a few requests
   per second saturate them; `--time-scale K` engine seconds per wall second, K < 1 keeps the
   Python gateway, engines and client of this 2-vCPU machine from being the bottleneck).
2. Capacity: a closed loop through a FIFO gateway, more in flight than the engines batch; steady
   served tokens per second (uncached prompt + output) = the fleet's capacity.
3. Three tenants (workload.py), rates as shares of that capacity: A (normal, weight 1) floods at 5x its
   fair share, and its outputs triple halfway through the first phase (drift); B (normal, weight 2)
   sends at its usual rate (0.3 of capacity) and in the second phase floods too; C (low) is batch
   traffic. B's solo baseline: B's first phase alone.
4. The same arrivals per mode, through fresh gateways (and freshly started engines); results in
   bench/results/fairness.md and fairness.png (report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.fairness import report
from bench.fairness.client import Outcome, closed_loop, replay, warm
from bench.fairness.workload import Phase, Request, TenantSpec, schedule
from bench.replay.workload import PromptBuilder
from policies.policy import hash_key
from tests.support.procs import Gateway, SimEngines, http_get, start_gateway, start_sim, static_pool

MODEL = "llama-3.1-8b"
PRESET = "llama-3.1-8b@h100"
MAX_NUM_SEQS = 8
RESULTS = Path(__file__).resolve().parents[1] / "results"
REDIS_URL = "redis://127.0.0.1:6379/0"
# of the pool's 2 x 8 batch slots, kept for tenants under their share: at least 4, and as many as
# their recent peak demand less what they hold, plus 2, up to 12 (policies/flow/saturation.py)
RESERVE: dict[str, int] = {"reserve_slots": 4, "reserve_max_slots": 12, "reserve_margin": 2}
FLOW_SECTION: dict[str, Any] = {"enabled": True, "saturation": {"max_engine_waiting": 0}}
RESERVE_SECTION: dict[str, Any] = {"enabled": True, "saturation": {"max_engine_waiting": 0, **RESERVE}}
# a request that finds the pool full cuts a stream of a tenant over its share (policies/flow/saturation.py)
PREEMPT_SECTION: dict[str, Any] = {"enabled": True, "saturation": {"max_engine_waiting": 0, "preempt": True}}
RESERVE_PREEMPT_SECTION: dict[str, Any] = {
    "enabled": True,
    "saturation": {"max_engine_waiting": 0, **RESERVE, "preempt": True},
}
# ... and a request over its share starts only where no prefill is pending while another endpoint with a
# free slot stays clear (policies/flow/saturation.py `clear_lane`)
LANE_SECTION: dict[str, Any] = {
    "enabled": True,
    "saturation": {"max_engine_waiting": 0, **RESERVE, "preempt": True, "reserve_clear_lane": True},
}
MODES: dict[str, dict[str, Any]] = {
    "fifo": {"flow_control": {"enabled": False}, "fairness": "vtc", "replicas": 1},
    "priority": {"flow_control": FLOW_SECTION, "fairness": "arrival", "replicas": 1},
    "flow": {"flow_control": FLOW_SECTION, "fairness": "vtc", "replicas": 1},
    "flow-reserve": {"flow_control": RESERVE_SECTION, "fairness": "vtc", "replicas": 1},
    "flow-2": {"flow_control": RESERVE_SECTION, "fairness": "vtc", "replicas": 2},
    "flow-preempt": {"flow_control": PREEMPT_SECTION, "fairness": "vtc", "replicas": 1},
    "flow-reserve-preempt": {"flow_control": RESERVE_PREEMPT_SECTION, "fairness": "vtc", "replicas": 1},
    "flow-reserve-preempt-2": {"flow_control": RESERVE_PREEMPT_SECTION, "fairness": "vtc", "replicas": 2},
    "flow-lane": {"flow_control": LANE_SECTION, "fairness": "vtc", "replicas": 1},
    "flow-lane-2": {"flow_control": LANE_SECTION, "fairness": "vtc", "replicas": 2},
}


def tenants(phase_s: float) -> list[TenantSpec]:
    p1, p2 = phase_s, 2 * phase_s
    return [
        TenantSpec(
            "A",
            "sk-bench-fair-a",
            "normal",
            1.0,
            300,
            (Phase(0, p1 / 2, 5 / 3, 80), Phase(p1 / 2, p1, 5 / 3, 240), Phase(p1, p2, 5 / 3, 240)),
        ),
        TenantSpec("B", "sk-bench-fair-b", "normal", 2.0, 300, (Phase(0, p1, 0.3, 120), Phase(p1, p2, 2.0, 120))),
        TenantSpec("C", "sk-bench-fair-c", "low", 1.0, 600, (Phase(0, p2, 0.4, 300),)),
    ]


def policy(specs: list[TenantSpec], fairness: str, phase_s: float) -> dict[str, Any]:
    return {
        "tenants": {s.name: {"priority": s.priority, "weight": s.weight} for s in specs},
        "keys": [{"id": s.name.lower(), "tenant": s.name, "sha256": hash_key(s.key)} for s in specs],
        "models": {MODEL: {"default_max_tokens": 1024}},
        "flow_control": {
            "fairness": fairness,
            "bands": {
                "normal": {"max_queue_ms": phase_s * 1000 / 8, "on_timeout": 429},
                "low": {"max_queue_ms": phase_s * 1000 / 4, "on_timeout": 503},
            },
        },
    }


def start_gateways(
    workdir: Path, engines: SimEngines, mode: dict[str, Any], specs: list[TenantSpec], args: argparse.Namespace
) -> list[Gateway]:
    sections: dict[str, Any] = {
        "flow_control": mode["flow_control"],
        "predictor": {"worker": "thread", "online_training": False, "prior": {"time_scale": args.time_scale}},
        "backends": {"scrape_interval_s": 0.05},
        "ledger": {"enabled": False},
    }
    if mode["replicas"] > 1:
        prefix = f"tokenway-bench-fairness:{uuid.uuid4().hex[:8]}"
        sections["state"] = {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix}
    pools = [static_pool("llama", MODEL, engines.urls, max_num_seqs=MAX_NUM_SEQS)]
    doc = policy(specs, mode["fairness"], args.phase_s)
    return [start_gateway(workdir / f"gw{i}", pools=pools, policies=doc, **sections) for i in range(mode["replicas"])]


def start_engines(workdir: Path, args: argparse.Namespace) -> SimEngines:
    workdir.mkdir(parents=True, exist_ok=True)
    extra = ["--max-num-seqs", str(MAX_NUM_SEQS), "--output-len-mean", "1"]
    return start_sim(workdir, count=2, preset=PRESET, time_scale=args.time_scale, served_model_name=MODEL, args=extra)


def admin(gateway: Gateway, path: str) -> Any:
    status, text = http_get(gateway.url + path, timeout_s=10.0)
    return orjson.loads(text) if status == 200 else {"error": status}


def measure_capacity(workdir: Path, args: argparse.Namespace, prompts: PromptBuilder) -> float:
    """Served tokens per second with more requests in flight than the engines batch."""
    probe = TenantSpec("P", "sk-bench-fair-probe", "normal", 1.0, 300, (Phase(0, 10_000, 1.0, 150),))
    requests = schedule([probe], 50.0, seed=args.seed, prompts=prompts, salt=f"probe-{uuid.uuid4().hex}")
    engines = start_engines(workdir / "probe", args)
    try:
        mode = MODES["fifo"]
        (gateway,) = start_gateways(workdir / "probe", engines, mode, [probe], args)
        try:
            elapsed, outcomes = asyncio.run(
                closed_loop(gateway.url, MODEL, probe.key, requests, 4 * MAX_NUM_SEQS, args.probe_s)
            )
        finally:
            gateway.stop()
    finally:
        engines.stop()
    # steady state only: completions after the batch filled and before the clients stopped sending
    end_s = float(args.probe_s)
    start_s = min(5.0, end_s / 3)
    served = [o for o in outcomes if o.ok and start_s <= o.sent_s + o.e2e_s < end_s]
    tokens = sum(o.prompt_tokens - o.cached_tokens + o.completion_tokens for o in served)
    span_s = end_s - start_s
    print(f"capacity: {tokens / span_s:.0f} tokens/s ({len(served) / span_s:.2f} req/s), {elapsed:.0f} s in all")
    return tokens / span_s


def run_mode(
    name: str, workdir: Path, requests: list[Request], specs: list[TenantSpec], args: argparse.Namespace
) -> dict[str, Any]:
    mode = MODES[name] if name in MODES else MODES["flow"]
    engines = start_engines(workdir / name, args)
    try:
        gateways = start_gateways(workdir / name, engines, mode, specs, args)
        try:
            keys = {s.name: s.key for s in specs}
            asyncio.run(warm([g.url for g in gateways], MODEL, keys))
            started = time.time()
            outcomes, ages = asyncio.run(replay_sampled([g.url for g in gateways], keys, requests, args.timeout_s))
            print(f"{name}: {len(outcomes)} requests in {time.time() - started:.0f} s")
            statuses = [admin(g, "/admin/status").get("flow") for g in gateways]
            predictor = [admin(g, "/admin/predictor").get("output_length") for g in gateways]
        finally:
            for g in gateways:
                g.stop()
            failures = [f for g in gateways for f in unexpected_failures(g.log())]
            if failures:
                print(f"{name}: {len(failures)} unexpected failures in the gateway log; the first:\n{failures[0]}")
    finally:
        engines.stop()
    return {
        "outcomes": [o.row() for o in outcomes],
        "flow_status": statuses,
        "output_length": predictor,
        "counters_age_s": ages,
        "unexpected_failures": failures,
    }


def unexpected_failures(log: str) -> list[str]:
    """The tracebacks of requests the gateway answered 500 `internal_error` (a bug, by the project's
    rules): each "failed unexpectedly" line and the traceback after it."""
    found: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "failed unexpectedly" not in line:
            continue
        block = [line]
        for following in lines[i + 1 : i + 80]:
            if following and not following[0].isspace() and not following.startswith("Traceback"):
                block.append(following)
                break
            block.append(following)
        found.append("\n".join(block))
    return found


async def replay_sampled(
    urls: list[str], keys: dict[str, str], requests: list[Request], timeout_s: float
) -> tuple[list[Outcome], list[float]]:
    """The replay, and meanwhile every second each gateway's age of the shared counters it orders
    the normal band by (the staleness of its fairness view; 0 in memory)."""
    ages: list[float] = []
    done = asyncio.Event()

    async def sample() -> None:
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                for url in urls:
                    try:
                        async with session.get(url + "/admin/status") as resp:
                            status = await resp.json()
                        age = status["flow"]["pools"]["llama"]["bands"]["normal"]["counters_age_s"]
                        if age is not None and status["flow"]["pools"]["llama"]["waiting"]:
                            ages.append(float(age))
                    except (aiohttp.ClientError, KeyError, TypeError):
                        continue
                await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    try:
        return await replay(urls, MODEL, keys, requests, timeout_s), ages
    finally:
        done.set()
        await sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--phase-s", type=float, default=120.0, help="length of each phase (two phases)")
    parser.add_argument("--window-s", type=float, default=60.0, help="windows the shares are checked over")
    parser.add_argument("--probe-s", type=float, default=25.0)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a client gives up after this")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--modes", default="fifo,priority,flow-lane,flow-lane-2")
    parser.add_argument("--quick", action="store_true", help="short phases (smoke run; numbers are noisy)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness.md")
    parser.add_argument("--raw", type=Path, default=None, help="also write every outcome here (JSON)")
    parser.add_argument("--report-only", type=Path, default=None, help="re-render a raw JSON file")
    args = parser.parse_args()
    if args.quick:
        args.phase_s, args.window_s, args.probe_s = 40.0, 20.0, 15.0
    if args.report_only is not None:
        raw = json.loads(args.report_only.read_text())
        report.write(raw, args.out)
        return
    specs = tenants(args.phase_s)
    prompts = PromptBuilder(args.seed)
    with tempfile.TemporaryDirectory(prefix="tokenway-fairness-") as tmp:
        workdir = Path(tmp)
        capacity = measure_capacity(workdir, args, prompts)
        requests = schedule(specs, capacity, seed=args.seed, prompts=prompts, salt=uuid.uuid4().hex)
        solo = [r for r in requests if r.tenant == "B" and r.at_s < args.phase_s]
        runs: dict[str, Any] = {"solo-B": run_mode("solo-B", workdir, solo, specs, args)}
        for name in args.modes.split(","):
            runs[name] = run_mode(name, workdir, requests, specs, args)
    raw = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "capacity_tokens_per_s": capacity,
        "reserve": RESERVE,
        "tenants": [
            {
                "name": s.name,
                "priority": s.priority,
                "weight": s.weight,
                "prompt_tokens": s.prompt_tokens,
                "phases": [vars_of(p) for p in s.phases],
            }
            for s in specs
        ],
        "runs": runs,
    }
    if args.raw is not None:
        args.raw.write_text(json.dumps(raw))
    report.write(raw, args.out)


def vars_of(phase: Phase) -> dict[str, float]:
    return {
        "start_s": phase.start_s,
        "end_s": phase.end_s,
        "capacity_share": phase.capacity_share,
        "mean_output_tokens": phase.mean_output_tokens,
    }
