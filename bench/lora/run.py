"""bench/lora: routing LoRA traffic over replicas of one base model (issue 43).

In process, in simulated time: four replicas, each the simulated engine's own scheduler, paged KV
cache, roofline step timer (`llama-3.1-8b@h100`) and LoRA slots (`sim/lora.py`: `max_loras` 8, LRU,
a load stalls the batch for size / bandwidth), driven by the gateway's real routers
(`policies.routing.build_router`) with the engine metrics they read refreshed every 250 ms of
simulated time, as the gateway scrapes them. No processes or sockets: a run of thousands of requests
takes seconds, so several loads and seeds fit one run.

Workload: 200 adapters, popularity Zipf(1.1); Poisson arrivals; prompts of 256-1024 unique tokens
(no prefix sharing: the comparison is about adapters), 64 output tokens. SLO: TTFT <= 1 s.

    .venv/bin/python -m bench.lora [--quick]

Writes bench/results/lora.md and lora.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.config import PoolConfig
from backends.fleet import LoraAdapter, Pool
from backends.perf.presets import resolve_preset
from backends.perf.roofline import StepTimer
from backends.types import Endpoint, EndpointState, EndpointStats, LoadTicket, Role
from policies.routing.pipeline import build_router
from policies.routing.types import Router, RouteRequest
from policies.types import Principal, RequestFacts
from sim.kv_cache import KVCacheManager
from sim.lora import LoraSlots, batch_adapters
from sim.scheduler import Request, Scheduler

REPLICAS = 4
MAX_LORAS = 8
ADAPTERS = 200
ZIPF_S = 1.1
SLO_TTFT_S = 1.0
OUTPUT_TOKENS = 64
SCRAPE_S = 0.25
ADAPTER_BYTES = 64 * 1024 * 1024
PRESET = "llama-3.1-8b@h100"
PRINCIPAL = Principal(key_id="bench", tenant="bench", allowed_models=None, priority=0)

_LLM_D = {
    "filters": [],
    "scorers": [
        {"type": "lora-affinity", "weight": 1.0, "params": {"load_cost_s": 0.0, "track_dispatches": False}},
        {"type": "queue-depth", "weight": 1.0},
        {"type": "kv-usage", "weight": 1.0},
    ],
    "picker": {"type": "max-score"},
}
_TOKENWAY = {
    "filters": [{"type": "lora-slots"}],
    "scorers": [
        {"type": "lora-affinity", "weight": 4.0},
        {"type": "queue-depth", "weight": 1.0},
        {"type": "inflight-tokens", "weight": 1.0},
    ],
    "picker": {"type": "max-score"},
}
ROUTERS: dict[str, dict[str, Any]] = {
    "round-robin": {"router": "round-robin"},
    "least-load": {"router": "least-inflight"},
    "llm-d adapter affinity": _LLM_D,
    "tokenway": _TOKENWAY,
}


@dataclass
class Replica:
    endpoint: Endpoint
    scheduler: Scheduler
    lora: LoraSlots
    timer: StepTimer
    busy_until: float = 0.0
    tickets: dict[str, LoadTicket] = field(default_factory=dict)


@dataclass
class RunResult:
    router: str
    rate: float
    seed: int
    requests: int
    attainment: float
    loads_per_min: float
    p90_ttft_s: float


def _replicas() -> list[Replica]:
    preset = resolve_preset(PRESET)
    out = []
    for i in range(REPLICAS):
        kv = KVCacheManager(28_000, 16)
        scheduler = Scheduler(kv, max_num_seqs=256, max_num_batched_tokens=8192)
        lora = LoraSlots(MAX_LORAS)
        scheduler.lora = lora
        endpoint = Endpoint(
            id=f"r{i}", pool="lora", base_url=f"http://r{i}", engine="sim", served_model="base", role=Role.BOTH
        )
        endpoint.state = EndpointState.READY
        out.append(Replica(endpoint, scheduler, lora, StepTimer(preset)))
    return out


def _scrape(replicas: Sequence[Replica], now: float) -> None:
    for r in replicas:
        s = r.scheduler
        r.endpoint.stats = EndpointStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage_ratio=s.kv.usage,
            block_size=16,
            num_gpu_blocks=28_000,
            running_loras=frozenset(q.lora_name for q in s.running if q.lora_name),
            waiting_loras=frozenset(q.lora_name for q in s.waiting if q.lora_name),
            max_loras=MAX_LORAS,
            scraped_at_s=now,
        )


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def run_one(router_name: str, rate: float, seed: int, duration_s: float) -> RunResult:
    rng = random.Random(seed)
    adapters = [LoraAdapter(f"lora-{k:03d}", "base", f"s3://adapters/{k}", ADAPTER_BYTES) for k in range(ADAPTERS)]
    weights = _zipf_weights(ADAPTERS, ZIPF_S)
    replicas = _replicas()
    for r in replicas:
        for a in adapters:
            r.lora.register(a.name, a.source, a.size_bytes)
    pool = Pool(PoolConfig.model_validate({"name": "lora", "model": "base", "engine": "sim", "replicas": REPLICAS}))
    pool.endpoints = [r.endpoint for r in replicas]
    router: Router = build_router(
        {"default": ROUTERS[router_name], "prefix_index": {"mode": "off"}, "max_stats_age_s": 10.0},
        rng=random.Random(seed),
    )
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        arrivals.append(t)
    ttfts: dict[str, float] = {}
    pending: dict[str, Request] = {}
    by_id = {r.endpoint.id: r for r in replicas}
    next_scrape = 0.0
    i = 0
    now = 0.0
    _scrape(replicas, 0.0)
    while i < len(arrivals) or any(r.scheduler.running or r.scheduler.waiting for r in replicas):
        next_arrival = arrivals[i] if i < len(arrivals) else float("inf")
        busy = [r for r in replicas if r.scheduler.running or r.scheduler.waiting]
        next_step = min((max(r.busy_until, now) for r in busy), default=float("inf"))
        now = min(next_arrival, next_step, next_scrape)
        if now == next_scrape:
            _scrape(replicas, now)
            next_scrape += SCRAPE_S
            continue
        if now == next_arrival:
            i += 1
            adapter = rng.choices(adapters, weights)[0]
            n = rng.randint(256, 1024)
            ids = [rng.randrange(1, 100_000) for _ in range(n)]
            rid = f"q{i}"
            facts = RequestFacts(
                request_id=rid,
                api="chat",
                body={"model": adapter.name},
                requested_model=adapter.name,
                model=adapter.name,
                principal=PRINCIPAL,
                prompt_tokens=n,
                prompt_token_ids=ids,
                max_tokens=OUTPUT_TOKENS,
                output_reservation=OUTPUT_TOKENS,
            )
            request = RouteRequest(facts)
            request.use_adapter(adapter)
            decision = router.route(request, pool, now)
            assert decision is not None
            router.on_dispatch(request, decision)
            replica = by_id[decision.endpoint.id]
            req = Request(rid, ids, [7] * OUTPUT_TOKENS, "length", now, OUTPUT_TOKENS, lora_name=adapter.name)
            replica.scheduler.add(req)
            replica.tickets[rid] = replica.endpoint.inflight.begin(n)
            pending[rid] = req
            replica.busy_until = max(replica.busy_until, now)
            continue
        for r in busy:
            if max(r.busy_until, now) > now:
                continue
            step = r.scheduler.schedule(now)
            if not step.prefills and not step.decodes:
                r.busy_until = now + 0.001
                continue
            chunks = [(n, ctx) for _, n, ctx in step.prefills]
            duration = r.timer(chunks, len(step.decodes), step.decode_context_sum)
            duration += r.lora.step_cost_s(batch_adapters(step.prefills, step.decodes))
            end = now + duration
            for req in r.scheduler.complete_step(step, end):
                if req.first_token_s is not None and req.request_id not in ttfts:
                    ttfts[req.request_id] = req.first_token_s - req.arrival_s
                    ticket = r.tickets.get(req.request_id)
                    if ticket is not None:
                        ticket.first_token(req.num_prompt + OUTPUT_TOKENS)
                if req.finished:
                    ticket = r.tickets.pop(req.request_id, None)
                    if ticket is not None:
                        ticket.end()
                    pending.pop(req.request_id, None)
            r.scheduler.stats.clear()
            r.busy_until = end
    values = sorted(ttfts.values())
    met = sum(1 for v in values if v <= SLO_TTFT_S)
    loads = sum(r.lora.loads for r in replicas)
    return RunResult(
        router_name,
        rate,
        seed,
        len(values),
        met / len(values) if values else 0.0,
        loads / (duration_s / 60.0),
        values[int(0.9 * (len(values) - 1))] if values else 0.0,
    )


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def report(results: Sequence[RunResult], rates: Sequence[float], seeds: int, duration_s: float, wall_s: float) -> str:
    lines = [
        "# bench/lora: adapter-aware routing",
        "",
        f"{ADAPTERS} LoRA adapters, popularity Zipf({ZIPF_S}), on {REPLICAS} simulated replicas of one base model "
        f"({PRESET}, `max_loras` {MAX_LORAS}, adapters of {ADAPTER_BYTES // 2**20} MB loading at 1 GB/s + 20 ms, "
        f"stalling the batch). Poisson arrivals, prompts 256-1024 unique tokens, {OUTPUT_TOKENS} output tokens; "
        f"SLO: TTFT <= {SLO_TTFT_S:g} s. {duration_s:g} simulated s per run, {seeds} seeds per cell "
        f"(mean ± sd over seeds). In process: the gateway's routers over the simulated engine's scheduler, KV "
        f"cache, step timer and LoRA slots in simulated time, metrics refreshed every {SCRAPE_S * 1000:g} ms "
        f"(`bench/lora/run.py`); wall time {wall_s:.0f} s.",
        "",
        "| load (req/s) | router | SLO attainment | adapter loads / min | p90 TTFT (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rate in rates:
        for name in ROUTERS:
            cell = [r for r in results if r.rate == rate and r.router == name]
            att, att_sd = _mean_sd([r.attainment for r in cell])
            loads, loads_sd = _mean_sd([r.loads_per_min for r in cell])
            p90, p90_sd = _mean_sd([r.p90_ttft_s for r in cell])
            lines.append(
                f"| {rate:g} | {name} | {att * 100:.1f} % ± {att_sd * 100:.1f} | {loads:.0f} ± {loads_sd:.0f} "
                f"| {p90:.2f} ± {p90_sd:.2f} |"
            )
    lines += ["", "## Target", ""]
    target = None
    for rate in rates:
        rr = [r.attainment for r in results if r.rate == rate and r.router == "round-robin"]
        if statistics.fmean(rr) < 0.8:
            target = rate
            break
    if target is None:
        lines.append("Round-robin stayed at or above 80 % attainment at every load run: raise the loads.")
    else:
        tw = [r for r in results if r.rate == target and r.router == "tokenway"]
        rr_cell = [r for r in results if r.rate == target and r.router == "round-robin"]
        att = statistics.fmean(r.attainment for r in tw)
        ratio = statistics.fmean(r.loads_per_min for r in tw) / max(
            statistics.fmean(r.loads_per_min for r in rr_cell), 1e-9
        )
        ok = att >= 0.95 and ratio <= 0.5
        lines.append(
            f"At {target:g} req/s, the first load where round-robin falls under 80 % "
            f"({statistics.fmean(r.attainment for r in rr_cell) * 100:.1f} %): tokenway {att * 100:.1f} % attainment "
            f"(target >= 95 %) with {ratio * 100:.0f} % of round-robin's adapter loads (target <= 50 %): "
            f"**{'met' if ok else 'not met'}**."
        )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[RunResult], rates: Sequence[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ROUTERS:
        att = [statistics.fmean(r.attainment for r in results if r.rate == x and r.router == name) * 100 for x in rates]
        loads = [statistics.fmean(r.loads_per_min for r in results if r.rate == x and r.router == name) for x in rates]
        left.plot(rates, att, marker="o", label=name)
        right.plot(rates, loads, marker="o", label=name)
    left.set(xlabel="load (req/s)", ylabel=f"SLO attainment (%), TTFT <= {SLO_TTFT_S:g} s", title="SLO attainment")
    right.set(xlabel="load (req/s)", ylabel="adapter loads per minute", title="adapter loads")
    left.axhline(95, color="grey", linestyle=":")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[20.0, 30.0, 40.0, 50.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="one seed, 20 s, two loads")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rates, seeds, duration = args.rates, args.seeds, args.duration_s
    if args.quick:
        rates, seeds, duration = rates[:2], 1, 20.0
    started = time.monotonic()
    results = [run_one(name, rate, seed, duration) for rate in rates for name in ROUTERS for seed in range(seeds)]
    wall = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(results, rates, seeds, duration, wall)
    (args.out / "lora.md").write_text(text + "\n![SLO attainment and adapter loads](lora.png)\n")
    plot(results, rates, args.out / "lora.png")
    print(text)
    return 0
