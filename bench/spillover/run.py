"""Spill-over, side by side: a bursty stretch of Azure's conversation trace on a self-hosted pool
sized for its mean, with and without a hosted overflow pool, against everything on the hosted API.

    .venv/bin/python -m bench.spillover [--window-s 60] [--windows 2] [--headroom 1.5] [--seqs N] [--quick]

Per window of the trace (a different stretch each: the repeats), three fresh gateways replay the
same arrivals (their own lengths, prompts capped at 3072 and answers at 256 tokens, streamed):

    self-hosted   one simulated H100 replica of Llama-3.1-8B (`python -m sim`, real time) sized for
                  the window's mean: `max_num_seqs` = --headroom x its mean offered concurrency (Little's
                  law: arrivals/s x a request's time alone on the replica, 20 ms + 7.5 ms per output
                  token as the sim serves one; the headroom pays for the batch's slow-down), so the
                  mean fits and the bursts queue (or --seqs, fixed)
    all-hosted    an Anthropic stand-in only (`python -m sim.hosted anthropic`) with a hosted API's
                  latency (TTFT 700 ms, 12 ms per output token)
    spill-over    both: the hosted pool is `overflow: true`, a request that waited over
                  `spill.max_wait_ms` (300) for the self-hosted pool goes there

and, on request (`--variants spill-over,spill-priced --out spillover-priced`: the default report
stays the default policy's):

    spill-priced  spill-over, plus `spill.usd_per_wait_second` (--usd-per-wait-s, $0.01: $36 an hour
                  of a user's waiting) with the hosted pool's own price (`pool_prices`) and the
                  self-hosted pool's at 0 (its GPU is paid by the hour): a request also spills as soon
                  as its predicted wait is worth more than the hosted pool's price for its tokens

SLO: TTFT <= 2 s and TPOT <= 60 ms at the client, answered in full. Money: the hosted pool at
Claude Sonnet 4.5's list price ($3 input, $15 output per Mtok: docs.anthropic.com, "Pricing"),
the self-hosted replica at an assumed $2.50 per GPU-hour for the window's wall time (the sim runs
in real time); $/Mtok = both over the trace's prompt and output tokens of the requests answered. Which pool served each
request and why it spilled come from the gateway's ledger (`pool`, `extra.spill`).

The trace is read from $TOKENWAY_TRACES/azure_llm_2023/AzureLLMInferenceTrace_conv.csv (default:
`shared/data/traces` beside the checkout, bench/traces.py); a missing trace stops the bench naming its path.
Results: bench/results/spillover.md and .png (report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.autoscale.client import Outcome, bodies, replay
from bench.autoscale.report import met
from bench.autoscale.workload import Arrival
from bench.replay.workload import load_azure
from bench.spillover import report
from bench.traces import require, traces_dir
from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.sim.hosted.standin import standin
from tests.support.procs import Gateway, free_port, start_gateway

RESULTS = Path(__file__).resolve().parents[1] / "results"
KEY = "sk-bench-spillover"
MODEL = "chat"
TRACE = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
MAX_PROMPT, MAX_OUTPUT = 3072, 256
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.060
HOSTED_TTFT_MS, HOSTED_TPOT_MS = 700.0, 12.0
PRICE_IN, PRICE_OUT = 3.0, 15.0  # USD per Mtok, the hosted pool's
GPU_HOUR_USD = 2.50  # assumed cost of the self-hosted replica's GPU
SPILL_WAIT_MS = 300.0
ALONE_S, ALONE_TPOT_S = 0.020, 0.0075  # one request alone on the simulated replica
VARIANTS = ("self-hosted", "all-hosted", "spill-over")  # the default report; "spill-priced" on request


def trace_path() -> Path:
    return require(traces_dir() / TRACE)


def window(start_row: int, seconds: float) -> list[Arrival]:
    """The trace's arrivals from `start_row` for `seconds`, at their own times."""
    rows = load_azure(trace_path(), 4000, start_row, max_total_tokens=1 << 30)
    return [
        Arrival(r.index, r.arrival_s, MODEL, min(r.input_tokens, MAX_PROMPT), min(r.output_tokens, MAX_OUTPUT))
        for r in rows
        if r.arrival_s < seconds
    ]


def mean_seqs(arrivals: list[Arrival], seconds: float, headroom: float) -> int:
    """Slots for the window's mean load: its offered concurrency (Little's law) times `headroom`."""
    busy_s = sum(ALONE_S + ALONE_TPOT_S * a.output_tokens for a in arrivals)
    return max(1, math.ceil(headroom * busy_s / seconds))


def owned_pool(seqs: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": "owned", "model": MODEL, "engine": "sim", "preset": "llama-3.1-8b@h100", "devices": [0],
        "max_num_seqs": seqs, "max_model_len": 8192, "ready_timeout_s": 120, "replicas": 1, **extra,
    }  # fmt: skip


def hosted_pool(url: str, overflow: bool) -> dict[str, Any]:
    return {
        "name": "hosted", "model": MODEL, "engine": "anthropic", "served_model_name": "claude-sonnet-4-5-20250929",
        "api_key_env": "TW_BENCH_ANTHROPIC_KEY", "endpoints": [{"url": url}], "allow_dropped_fields": True,
        "overflow": overflow, "max_num_seqs": 1024,
    }  # fmt: skip


def policies(usd_per_wait_s: float | None = None) -> dict[str, Any]:
    price = {"input_per_mtok": PRICE_IN, "output_per_mtok": PRICE_OUT}
    model: dict[str, Any] = {"default_max_tokens": MAX_OUTPUT, "price": price}
    spill: dict[str, Any] = {"max_wait_ms": SPILL_WAIT_MS}
    if usd_per_wait_s is not None:  # spill-priced: the owned pool at 0 per token, the hosted at its list price
        model = {"default_max_tokens": MAX_OUTPUT, "price": {}, "pool_prices": {"hosted": price}}
        spill["usd_per_wait_second"] = usd_per_wait_s
    return {
        "tenants": {"bench": {"spill": {"allowed": True}}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {MODEL: model},
        "spill": spill,
        "flow_control": {"bands": {"normal": {"max_queue_ms": 30_000}}},
    }


def gateway(workdir: Path, pools: list[dict[str, Any]], usd_per_wait_s: float | None = None) -> Gateway:
    ports = {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base")}
    return start_gateway(
        workdir,
        pools=pools,
        policies=policies(usd_per_wait_s),
        backends={"devices": [0], "log_dir": str(workdir / "logs"), "run_dir": str(workdir / "run"), **ports},
        predictor={"enabled": False},
        ledger={"dir": str(workdir / "usage"), "commit_interval_ms": 50},
        flow_control={"saturation": {"max_engine_waiting": 0}},
        ready_timeout_s=180,
    )


@dataclass(slots=True)
class Run:
    variant: str
    window: int
    wall_s: float
    outcomes: list[Outcome]
    ledger: list[dict[str, Any]]


async def run_variant(
    variant: str, index: int, arrivals: list[Arrival], seqs: int, workdir: Path, usd_per_wait_s: float = 0.01
) -> Run:
    os.environ["TW_BENCH_ANTHROPIC_KEY"] = "test-key"
    flags = ["--ttft-ms", str(HOSTED_TTFT_MS), "--tpot-ms", str(HOSTED_TPOT_MS), "--max-output-tokens", "100000"]
    with standin("anthropic", *flags) as hosted:
        pools = {
            "self-hosted": [owned_pool(seqs)],
            "all-hosted": [hosted_pool(hosted.url, overflow=False)],
            "spill-over": [owned_pool(seqs), hosted_pool(hosted.url, overflow=True)],
            "spill-priced": [owned_pool(seqs), hosted_pool(hosted.url, overflow=True)],
        }[variant]
        gw = gateway(workdir / f"{variant}-{index}", pools, usd_per_wait_s if variant == "spill-priced" else None)
        try:
            payloads = bodies(arrivals, salt=f"{variant}-{index}")
            started = time.perf_counter()
            outcomes = await replay(gw.url, KEY, arrivals, payloads, timeout_s=120.0)
            wall_s = time.perf_counter() - started
            await asyncio.sleep(1.0)  # the last ledger lines
        finally:
            gw.stop()
    ledger = list(iter_entries(workdir / f"{variant}-{index}" / "usage"))
    return Run(variant, index, wall_s, outcomes, ledger)


def summarise(run: Run, seqs: int) -> dict[str, Any]:
    """One run's figures. Tokens are the trace's (prompt + output of each answered request), the same
    measure for every variant: providers count a prompt with their own tokenizer (the stand-in, as
    Anthropic's, counts more than Llama's), which prices the hosted part but must not move the
    denominator. The hosted $ are what the provider billed (the ledger's counts at its price)."""
    served = [o for o in run.outcomes if o.served]
    attained = sum(1 for o in run.outcomes if met(o, SLO_TTFT_S, SLO_TPOT_S))
    tokens = sum(o.prompt_tokens + o.output_tokens for o in served)
    spilled_tokens = sum(o.prompt_tokens + o.output_tokens for o in served if o.endpoint.startswith("hosted/"))
    hosted_usd = 0.0
    spilled = 0
    for entry in run.ledger:
        if entry.get("pool") == "hosted":
            hosted_usd += (
                int(entry["input_tokens"] or 0) * PRICE_IN + int(entry["output_tokens"] or 0) * PRICE_OUT
            ) / 1e6
        if (entry.get("extra") or {}).get("spill"):
            spilled += 1
    owned_usd = GPU_HOUR_USD * run.wall_s / 3600.0 if run.variant != "all-hosted" else 0.0
    total_usd = owned_usd + hosted_usd
    return {
        "variant": run.variant,
        "window": run.window,
        "requests": len(run.outcomes),
        "served": len(served),
        "slo_attainment": attained / len(run.outcomes) if run.outcomes else 0.0,
        "ttft_p99_s": report.percentile([o.ttft_s for o in served if o.ttft_s is not None], 0.99),
        "tokens": tokens,
        "hosted_token_share": spilled_tokens / tokens if tokens else 0.0,
        "spilled_requests": spilled,
        "owned_usd": owned_usd,
        "hosted_usd": hosted_usd,
        "usd_per_mtok": total_usd / tokens * 1e6 if tokens else None,
        "wall_s": run.wall_s,
        "seqs": seqs,
    }


async def main_async(args: argparse.Namespace) -> None:
    starts = [0, 6000, 12000][: args.windows]
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[tuple[float, str, bool]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-spillover-") as tmp:
        for index, start in enumerate(starts):
            arrivals = window(start, args.window_s)
            seqs = args.seqs or mean_seqs(arrivals, args.window_s, args.headroom)
            for variant in args.variants.split(","):
                run = await run_variant(variant, index, arrivals, seqs, Path(tmp), args.usd_per_wait_s)
                row = summarise(run, seqs)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if index == 0:
                    timelines[variant] = [(o.sent_s, variant, met(o, SLO_TTFT_S, SLO_TPOT_S)) for o in run.outcomes]
                    if variant == "spill-over" or (variant == "spill-priced" and "spill-over" not in timelines):
                        timelines["spill-pools"] = [
                            (float(e["started"]), str(e.get("pool") or ""), bool((e.get("extra") or {}).get("spill")))
                            for e in run.ledger
                        ]
    meta = {
        "window_s": args.window_s,
        "windows": len(starts),
        "trace_rows": starts,
        "seqs": sorted({r["seqs"] for r in rows}),
        "headroom": args.headroom,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "hosted": {"ttft_ms": HOSTED_TTFT_MS, "tpot_ms": HOSTED_TPOT_MS, "in": PRICE_IN, "out": PRICE_OUT},
        "gpu_hour_usd": GPU_HOUR_USD,
        "spill_wait_ms": SPILL_WAIT_MS,
        "usd_per_wait_s": args.usd_per_wait_s if "spill-priced" in args.variants.split(",") else None,
        "host_cpus": os.cpu_count(),
    }
    report.write(RESULTS, args.out, rows, timelines, meta)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spillover")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--windows", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--seqs", type=int, default=0, help="the self-hosted replica's max_num_seqs (0: sized)")
    parser.add_argument("--headroom", type=float, default=1.5, help="slots per unit of mean offered concurrency")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join((*VARIANTS, 'spill-priced'))}")
    parser.add_argument("--usd-per-wait-s", type=float, default=0.01, help="spill-priced: spill.usd_per_wait_second")
    parser.add_argument("--out", default="spillover", help="the report's name under bench/results")
    parser.add_argument("--quick", action="store_true", help="one 20 s window (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.window_s, args.windows = 20.0, 1
    asyncio.run(main_async(args))
