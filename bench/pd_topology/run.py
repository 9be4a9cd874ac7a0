"""PD pairing across a two-rack topology: topology-blind vs topology-aware, p90 TTFT.

    .venv/bin/python -m bench.pd_topology              # the full run (5 seeds; --jobs N: in parallel)
    .venv/bin/python -m bench.pd_topology --quick      # a smoke run

A disaggregated pool of simulated `llama-3.1-8b@h100` engines in two racks, each rack holding
`--prefill-per-rack` prefill and `--decode-per-rack` decode replicas (one node each). The engines
(`sim.scheduler`, `sim.kv_cache`, the roofline) run in process on one virtual clock: a discrete-event
loop, so the numbers carry no host noise. The gateway's router (`policies.routing`) chooses the decode
endpoint and the prefill endpoint of every request; the prefill leg runs on the prefill engine (one
token, its blocks pinned), then the decode engine admits the decode leg, reserves its blocks and pulls
the KV over the link between the two replicas:

    transfer_s = latency_link + tokens x kv_bytes_per_token_per_device / bandwidth_link

(tokens: the prompt less what the decode engine already caches), one transfer at a time per sending
replica's NIC (a later one queues behind it). Links, `--links RACK:SPINE` GB/s per device, each pair
a run of its own; defaults: 50:5 (one 400 Gb/s NIC per GPU, a spine ten times slower), 25:2.5 (a
200 Gb/s NIC, again ten times), 50:2.5 (a 400 Gb/s NIC, a spine twenty times slower).
The router is told the same link classes (`routing.pd.topology.links`), so it prices what the
simulator charges:

- `blind`: `pd.topology.aware: false` (the pipelines choose decode and prefill endpoints on their own);
- `aware`: the pair's cost includes the transfer over its link (`policies/routing/pd.py`);
- `no-spine` (a bound, not a router): `aware` on a fabric whose cross-rack link is as fast as the
  rack's, so no pair pays the spine. It is the p90 any pairing could reach on the spec's fabric with the
  same prefill choices, so blind / no-spine is the most a pairing policy can gain there.

Also reported per seed: the no-queue floor, the p90 over requests of their prefill alone on an idle
replica (the roofline, chunks of `max_num_batched_tokens`) plus the transfer over the rack's link:
what TTFT would be with no queueing anywhere.

Workload: synthetic, seeded: Poisson arrivals, prompts log-normal around `--prompt-median` tokens
(1k to 16k, no shared prefixes, so every request is disaggregated), outputs 32 to 256 tokens; the
arrival rate is `--load` x the prefill replicas' throughput on the mean prompt (roofline). Writes
bench/results/pd-topology.md and pd-topology.png; needs no trace.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.perf.presets import resolve_preset
from backends.perf.roofline import StepTimer, kv_bytes_per_token_per_device, step_cost
from backends.types import Endpoint, EndpointState, EndpointStats, LoadTicket, Role, Topology, link_class
from bench.notes import with_plot
from policies.routing import build_router
from policies.routing.pipeline import ScoringRouter
from policies.routing.types import RouteRequest
from policies.types import Principal, RequestFacts
from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PRESET = "llama-3.1-8b@h100"
BLOCK = 16
PRINCIPAL = Principal(key_id="k", tenant="t", allowed_models=None, priority=0)
VARIANTS = ("blind", "aware", "no-spine")
NO_SPINE = "no-spine"


@dataclass(frozen=True, slots=True)
class Spec:
    racks: int = 2
    prefill_per_rack: int = 2
    decode_per_rack: int = 2
    rack_gbps: float = 50.0
    rack_latency_ms: float = 0.05
    spine_gbps: float = 5.0
    spine_latency_ms: float = 0.2
    hbm_tokens: int = 400_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def without_spine(self) -> Spec:
        """The same fleet with the cross-rack link as fast as the rack's (the `no-spine` bound)."""
        return replace(self, spine_gbps=self.rack_gbps, spine_latency_ms=self.rack_latency_ms)

    @property
    def label(self) -> str:
        return f"{self.rack_gbps:g}/{self.spine_gbps:g}"

    def links(self) -> dict[str, dict[str, float]]:
        """`routing.pd.topology.links` as the simulator charges them (same node is never used here)."""
        rack = {"bandwidth_gbps": self.rack_gbps, "latency_ms": self.rack_latency_ms}
        spine = {"bandwidth_gbps": self.spine_gbps, "latency_ms": self.spine_latency_ms}
        return {"same_rack": rack, "cross_rack": spine, "cross_zone": spine}


@dataclass(frozen=True, slots=True)
class Job:
    prompt_ids: list[int]
    output_tokens: int


@dataclass
class Engine:
    endpoint: Endpoint
    kv: KVCacheManager
    scheduler: Scheduler
    stepping: bool = False  # a step runs (ends at a heap event)
    epoch: int = 0  # wake-ups of older epochs are stale
    nic_free_s: float = 0.0  # when this replica's NIC is free to send the next transfer
    changed: list[Request] = field(default_factory=list)


@dataclass
class Leg:
    """One request as the gateway sees it: its legs, tickets and the pair the router chose."""

    job: Job
    arrival_s: float
    decode: int
    prefill: int | None
    decode_ticket: LoadTicket
    prefill_ticket: LoadTicket | None = None
    decode_req: Request | None = None
    transfer_s: float = 0.0


@dataclass
class Outcome:
    variant: str
    links: str  # "rack/spine" GB/s, e.g. "50/5"
    seed: int
    ttft_s: list[float]
    cross_rack: int
    disaggregated: int
    transfer_s: float  # mean transfer time of disaggregated requests (with NIC queueing)


def workload(seed: int, n: int, prompt_median: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        tokens = int(min(max(rng.lognormvariate(math.log(prompt_median), 0.6), 1024), 16_384))
        jobs.append(Job([rng.randrange(1000, 120_000) for _ in range(tokens)], rng.randint(32, 256)))
    return jobs


def arrival_rate(jobs: Sequence[Job], spec: Spec, load: float) -> float:
    """Requests/s at `load` x the prefill replicas' throughput on the mean prompt (full chunks)."""
    preset = resolve_preset(PRESET)
    chunk = spec.max_num_batched_tokens
    tokens_per_s = chunk / step_cost(preset, [(chunk, 0)]).total_s
    mean_prompt = sum(len(j.prompt_ids) for j in jobs) / len(jobs)
    return load * spec.racks * spec.prefill_per_rack * tokens_per_s / mean_prompt


def simulate(variant: str, jobs: Sequence[Job], arrivals: Sequence[float], spec: Spec, seed: int) -> Outcome:
    label = spec.label
    if variant == NO_SPINE:
        spec = spec.without_spine()
    preset = resolve_preset(PRESET)
    kv_bytes = kv_bytes_per_token_per_device(preset)
    router: ScoringRouter = build_router(
        {"seed": seed, "pd": {"topology": {"aware": variant != "blind", "links": spec.links()}}}
    )
    links = {
        "same_rack": (spec.rack_gbps * 1e9, spec.rack_latency_ms / 1e3),
        "cross_rack": (spec.spine_gbps * 1e9, spec.spine_latency_ms / 1e3),
    }
    engines: list[Engine] = []
    for rack in range(spec.racks):
        for role, count in ((Role.PREFILL, spec.prefill_per_rack), (Role.DECODE, spec.decode_per_rack)):
            for i in range(count):
                name = f"{role.value}-r{rack}-{i}"
                kv = KVCacheManager(spec.hbm_tokens // BLOCK, BLOCK)
                endpoint = Endpoint(
                    id=name,
                    pool="pd",
                    base_url=f"http://{name}",
                    engine="sim",
                    served_model="m",
                    role=role,
                    state=EndpointState.READY,
                    stats=EndpointStats(block_size=BLOCK, num_gpu_blocks=spec.hbm_tokens // BLOCK),
                    topology=Topology(node=name, rack=f"r{rack}", zone="z"),
                )
                engines.append(Engine(endpoint, kv, Scheduler(kv, spec.max_num_seqs, spec.max_num_batched_tokens)))
    config = PoolConfig.model_validate(
        {
            "name": "pd",
            "model": "m",
            "preset": PRESET,
            "endpoints": [{"url": e.endpoint.base_url, "role": e.endpoint.role.value} for e in engines],
        }
    )
    pool = Pool(config, endpoints=[e.endpoint for e in engines])
    by_endpoint = {id(e.endpoint): i for i, e in enumerate(engines)}
    step_time = StepTimer(preset)
    heap: list[tuple[float, int, int, int, int]] = []  # (time, order, kind, engine or job, epoch)
    order = 0
    for i, at in enumerate(arrivals):
        heapq.heappush(heap, (at, order, 1, i, 0))
        order += 1
    legs: dict[str, Leg] = {}  # by request id ("r<i>"; the prefill leg is "r<i>/p")
    ttft: list[float] = []
    cross = disagg = 0
    transfers: list[float] = []

    def wake(index: int, at: float) -> None:
        nonlocal order
        heapq.heappush(heap, (at, order, 0, index, engines[index].epoch))
        order += 1

    def start_step(index: int, now: float) -> None:
        nonlocal cross, order
        engine = engines[index]
        engine.epoch += 1
        s = engine.scheduler
        while True:
            step = s.schedule(now)
            for req in step.started_pulls:  # decode legs admitted: their KV crosses the link now
                leg = legs[req.request_id]
                assert leg.prefill is not None
                source = engines[leg.prefill]
                link = link_class(source.endpoint.topology, engine.endpoint.topology)
                assert link is not None
                bandwidth, latency = links[link]
                start = max(now, source.nic_free_s)
                done = start + latency + (req.num_prompt - req.num_computed) * kv_bytes / bandwidth
                source.nic_free_s = done
                s.finish_pull(req, done, True)
                leg.transfer_s = done - now
                transfers.append(leg.transfer_s)
                cross += link != "same_rack"
                heapq.heappush(heap, (done, order, 2, leg.prefill, int(req.request_id[1:])))
                order += 1
            if not step.empty:
                chunks = [(n, ctx) for _, n, ctx in step.prefills]
                end = now + step_time(chunks, len(step.decodes), step.decode_context_sum)
                engine.changed = s.complete_step(step, end)
                engine.stepping = True
                wake(index, end)
                return
            if step.preempted:
                continue
            engine.stepping = False
            landing = s.next_pull_s()
            if landing is not None:
                wake(index, max(landing, now))
            return

    def add(index: int, req: Request, now: float) -> None:
        engines[index].scheduler.add(req)
        if not engines[index].stepping:
            start_step(index, now)

    def step_ended(index: int, now: float) -> None:
        engine = engines[index]
        changed, engine.changed = engine.changed, []
        for req in changed:
            if req.request_id.endswith("/p"):  # a prefill leg: its one token means its KV is ready
                leg = legs[req.request_id[:-2]]
                if req.num_output >= 1 and leg.decode_req is None:
                    assert leg.prefill_ticket is not None
                    leg.prefill_ticket.end()
                    rid = req.request_id[:-2]
                    out = [1] * leg.job.output_tokens
                    leg.decode_req = Request(
                        rid, leg.job.prompt_ids, out, "length", leg.arrival_s, len(out), remote_prefill={"p": 1}
                    )
                    add(leg.decode, leg.decode_req, now)
                continue
            leg = legs[req.request_id]
            if req.num_output >= 1 and req.first_token_s is not None and not leg.decode_ticket.prefilled:
                leg.decode_ticket.first_token(req.num_prompt + len(req.output_ids))
                ttft.append(req.first_token_s - leg.arrival_s)
            if req.finished:
                leg.decode_ticket.end()
        start_step(index, now)

    while heap:
        now, _, kind, index, tag = heapq.heappop(heap)
        if kind == 0:
            if tag == engines[index].epoch:
                step_ended(index, now)
            continue
        if kind == 2:  # a transfer landed: the prefill leg's pinned blocks are free
            engines[index].scheduler.release_pin(f"r{tag}/p", now)
            continue
        job = jobs[index]
        for engine in engines:
            st = engine.endpoint.stats
            st.running = len(engine.scheduler.running)
            st.waiting = engine.scheduler.num_waiting
            st.kv_usage_ratio = engine.kv.usage
            st.scraped_at_s = now
        rid = f"r{index}"
        facts = RequestFacts(
            request_id=rid,
            api="chat",
            body={},
            requested_model="m",
            model="m",
            principal=PRINCIPAL,
            prompt_tokens=len(job.prompt_ids),
            prompt_token_ids=job.prompt_ids,
            max_tokens=job.output_tokens,
        )
        route_request = RouteRequest(facts)
        decision = router.route(route_request, pool, now)
        assert decision is not None
        router.on_dispatch(route_request, decision)
        d = by_endpoint[id(decision.endpoint)]
        out = [1] * job.output_tokens
        if decision.prefill_endpoint is None:
            ticket = decision.endpoint.inflight.begin(decision.uncached_prefill_tokens(len(job.prompt_ids)))
            leg = legs[rid] = Leg(job, now, d, None, ticket)
            leg.decode_req = Request(rid, job.prompt_ids, out, "length", now, len(out))
            add(d, leg.decode_req, now)
            continue
        disagg += 1
        p = by_endpoint[id(decision.prefill_endpoint)]
        leg = legs[rid] = Leg(job, now, d, p, decision.endpoint.inflight.begin(0))
        leg.prefill_ticket = decision.prefill_endpoint.inflight.begin(
            decision.uncached_prefill_tokens(len(job.prompt_ids))
        )
        add(p, Request(f"{rid}/p", job.prompt_ids, [1], "length", now, 1, remote_decode=True), now)

    if len(ttft) != len(jobs):
        raise RuntimeError(f"{len(jobs) - len(ttft)} requests never produced a first token")
    mean_transfer = sum(transfers) / len(transfers) if transfers else 0.0
    return Outcome(variant, label, seed, ttft, cross, disagg, mean_transfer)


def no_queue_floor(jobs: Sequence[Job], spec: Spec) -> list[float]:
    """Per request, TTFT with no queueing anywhere: its prefill alone on an idle replica (chunks of
    `max_num_batched_tokens`, the roofline) plus its KV's transfer over the rack's link (s)."""
    preset = resolve_preset(PRESET)
    kv_bytes = kv_bytes_per_token_per_device(preset)
    chunk = spec.max_num_batched_tokens
    out = []
    for job in jobs:
        n = len(job.prompt_ids)
        prefill = sum(step_cost(preset, [(min(chunk, n - done), done)]).total_s for done in range(0, n, chunk))
        out.append(prefill + spec.rack_latency_ms / 1e3 + n * kv_bytes / (spec.rack_gbps * 1e9))
    return out


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=600, help="per seed")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--load", type=float, default=0.7, help="x the prefill replicas' throughput")
    p.add_argument("--prompt-median", type=int, default=4096)
    p.add_argument("--prefill-per-rack", type=int, default=2)
    p.add_argument("--decode-per-rack", type=int, default=2)
    p.add_argument(
        "--links",
        default="50:5,25:2.5,50:2.5",
        help="comma-separated RACK:SPINE pairs, GB/s per device of the same-rack and cross-rack links",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (results do not change)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "pd-topology.md")
    return p


def _seed_workload(
    seed: int, requests: int, prompt_median: int, spec: Spec, load: float
) -> tuple[list[Job], float, list[float]]:
    """A seed's jobs, arrival rate and arrival times (the same for every variant and link)."""
    jobs = workload(seed, requests, prompt_median)
    rate = arrival_rate(jobs, spec, load)
    rng = random.Random(seed + 10_000)
    at, arrivals = 0.0, []
    for _ in jobs:
        at += rng.expovariate(rate)
        arrivals.append(at)
    return jobs, rate, arrivals


def _run_task(task: tuple[int, int, int, float, Spec, Spec, str]) -> Outcome:
    """One (seed, links, variant) run; a process of its own under `--jobs` (the clock is simulated, so
    the numbers do not depend on how runs share the host)."""
    seed, requests, prompt_median, load, rate_spec, spec, variant = task
    jobs, _, arrivals = _seed_workload(seed, requests, prompt_median, rate_spec, load)
    return simulate(variant, jobs, arrivals, spec, seed)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, args.requests = seeds[:1], 150
    specs = [
        Spec(
            prefill_per_rack=args.prefill_per_rack,
            decode_per_rack=args.decode_per_rack,
            rack_gbps=float(rack),
            spine_gbps=float(spine),
        )
        for rack, spine in (pair.split(":") for pair in args.links.split(",") if pair)
    ]
    rates: dict[int, float] = {}
    floors: dict[tuple[int, str], float] = {}  # (seed, links) -> p90 of the no-queue floor
    started = time.perf_counter()
    for seed in seeds:
        jobs, rates[seed], _ = _seed_workload(seed, args.requests, args.prompt_median, specs[0], args.load)
        for spec in specs:
            floors[seed, spec.label] = pct(no_queue_floor(jobs, spec), 0.9)
    tasks = [
        (seed, args.requests, args.prompt_median, args.load, specs[0], spec, variant)
        for seed in seeds
        for spec in specs
        for variant in VARIANTS
    ]
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else nullcontext() as pool:
        runs = pool.map(_run_task, tasks) if pool is not None else map(_run_task, tasks)
        for (seed, *_, spec, variant), out in zip(tasks, runs, strict=True):
            outcomes.append(out)
            print(
                f"seed {seed} {spec.label:8s} {variant:8s} p50 {pct(out.ttft_s, 0.5):6.3f}s "
                f"p90 {pct(out.ttft_s, 0.9):6.3f}s "
                f"cross-rack {out.cross_rack / max(out.disaggregated, 1):5.1%} transfer {out.transfer_s * 1e3:6.1f} ms",
                file=sys.stderr,
            )
    elapsed = time.perf_counter() - started
    from bench.pd_topology.report import render

    args.out.parent.mkdir(parents=True, exist_ok=True)
    text, plot = render(args, specs, outcomes, rates, floors, elapsed)
    args.out.write_text(with_plot(text, args.out, "p90 TTFT, blind vs aware pairing"))
    plot(args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
