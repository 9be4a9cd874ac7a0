"""KV tiers: routing with a host-DRAM tier below HBM, GPU-only vs constant vs physics tier credit.

    .venv/bin/python -m bench.kv_tiers                 # the full run (5 seeds, ~8 min on one core)
    .venv/bin/python -m bench.kv_tiers --seeds 1,2,3,4,5,6,7,8,9,10 --jobs 4   # the committed run
    .venv/bin/python -m bench.kv_tiers --quick         # a smoke run

A fleet of simulated `llama-3.1-8b@h100` engines whose HBM holds a fraction of the working set of a
long-context multi-turn workload (whole conversations of the Mooncake trace, 512-token blocks), each
with a host-DRAM offload tier (`sim/kv_cache.py`, `HostOffload`: HBM evictions land there, a DRAM hit is loaded
over PCIe instead of recomputed, KV events carry medium CPU). The engines (`sim.scheduler`,
`sim.kv_cache`, the roofline) run in process on one virtual clock: a discrete-event loop, so the
numbers carry no host noise and a run takes seconds. The gateway's router (`policies.routing`,
precise prefix index fed the engines' KV events as they happen, the gateway's in-flight accounting)
picks the engine for every request, with the same arrivals for every variant:

- `gpu-only`: the router sees HBM hits only (what an index that ignores offloaded blocks, or one
  sized for HBM alone, can know);
- `constant`: every tier seen, weighted 1.0 / 0.75 / 0.25 (HBM / DRAM / disk);
- `physics`: every tier seen, a lower-tier hit credited with the prefill time it saves minus its
  load time (`policies/routing/kv_tiers.py`).
- `flat` (reference): every tier seen at weight 1 (the precise index before tiers).
- `physics+store`: `physics` on a fleet that also shares a KV store (`sim/kv_cache.py`, `SharedStore`, the pool's
  `kv_store`): blocks are written there once computed (`--store-write evict`: on HBM eviction), any
  engine loads its blocks at the store's link after its own HBM and DRAM runs, and the router is fed
  the store's events, so a block in the store counts on every replica (credit by physics at the
  store's link).
- `approximate+store`: the same fleet and credit with no events at all: the approximate prefix index
  (what the gateway sent where) with its DRAM-sized offload LRU and the pool's store modelled from the
  prompts sent to the pool (`policies/routing/prefix_index.py`), for engines that publish no events.

Load: arrivals keep the trace's shape, compressed to `--load` x the fleet's capacity, measured per
seed as the throughput of an all-at-once burst under `gpu-only`. Each seed draws another subset of
conversations. Hit rate: prompt tokens the engines served from HBM, DRAM or the store over all prompt
tokens; oracle: at each dispatch, the best any engine could have served (HBM prefix plus its DRAM
continuation, then the store's, read from the engines and the store themselves).

Bound: the cold floor, per request its prefill on an idle engine (roofline, chunks of
`max_num_batched_tokens`) of the tokens after the longest prefix any earlier request of the seed
shared (an unbounded cache that loads for free); its p90 over requests is about the lowest p90 any
router could reach, so gpu-only p90 / that floor is the most any tier scoring could gain on a seed.

Writes bench/results/kv-tiers.md and kv-tiers.png. The trace: $TOKENWAY_TRACES (default
../shared/data/traces next to the repository) / mooncake/synthetic_trace.jsonl.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from backends.perf.presets import resolve_preset
from backends.perf.roofline import StepTimer, kv_bytes_per_token_per_device, step_cost
from backends.types import Endpoint, EndpointState, EndpointStats, LoadTicket
from bench.notes import with_plot
from bench.replay.workload import BLOCK_TOKENS, TraceRequest, load_mooncake, scaled_arrivals
from bench.traces import require, traces_dir
from policies.routing import build_router
from policies.routing.pipeline import ScoringRouter
from policies.routing.types import RouteRequest
from policies.types import Principal, RequestFacts
from sim.kv_cache import WRITE_ON_COMPUTE, HostOffload, KVCacheManager, KVEvent, SharedStore
from sim.scheduler import Request, Scheduler

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PRESET = "llama-3.1-8b@h100"
BLOCK = 16
PRINCIPAL = Principal(key_id="k", tenant="t", allowed_models=None, priority=0)
VARIANTS = ("gpu-only", "constant", "physics", "flat", "physics+store", "approximate+store")
STORE_SUFFIX = "+store"
APPROXIMATE = "approximate"  # a variant's credit part naming the approximate index (physics credit, no events)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    engines: int
    hbm_blocks: int
    dram_blocks: int
    dram_bandwidth: float  # bytes/s per device
    store_blocks: int = 0  # the shared store of the `+store` variants
    store_bandwidth: float = 10e9  # bytes/s per device
    store_latency_s: float = 1e-3
    store_write: str = "compute"  # when blocks reach the store (sim/kv_cache.py): on compute or on eviction
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192


@dataclass
class Engine:
    endpoint: Endpoint
    kv: KVCacheManager
    offload: HostOffload
    scheduler: Scheduler
    busy: bool = False
    pending: list[KVEvent] = field(default_factory=list)  # the running step's events, out at its end
    changed: list[Request] = field(default_factory=list)  # the running step's requests, told at its end
    seq: int = 0


@dataclass
class Outcome:
    variant: str
    seed: int
    ttft_s: list[float]
    prompt_tokens: int
    hit_tokens: int
    oracle_tokens: int
    loaded_tokens: int
    gpu_hit_tokens: int
    store_tokens: int = 0


def _block_ids(hash_id: int, cache: dict[int, list[int]]) -> list[int]:
    ids = cache.get(hash_id)
    if ids is None:
        rng = random.Random(hash_id * 2654435761)
        ids = cache[hash_id] = [rng.randrange(1000, 120_000) for _ in range(BLOCK_TOKENS)]
    return ids


def prompt_ids(req: TraceRequest, cache: dict[int, list[int]]) -> list[int]:
    ids: list[int] = []
    for h in req.hash_ids:
        ids.extend(_block_ids(h, cache))
    return ids[: req.input_tokens]


def _wire(events: Sequence[KVEvent]) -> list[KvEvent]:
    out: list[KvEvent] = []
    for e in events:
        if e.kind == "stored":
            out.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, BLOCK, e.medium))
        elif e.kind == "removed":
            out.append(BlockRemoved(e.block_hashes, e.medium))
        else:
            out.append(AllBlocksCleared())
    return out


def _true_hit_blocks(engine: Engine, req: Request) -> int:
    """What the engine could serve now without computing: its HBM prefix, then DRAM, then the shared
    store (no LRU touch)."""
    hits = len(engine.kv.computed_blocks(req))
    max_blocks = (req.num_tokens - 1) // BLOCK
    dram = engine.offload.blocks
    n = hits
    while n < max_blocks and req.block_hashes[n] in dram:
        n += 1
    store = engine.offload.store
    if store is not None:
        n += store.run(req.block_hashes, n, max_blocks, touch=False)
    return n


def simulate(
    variant: str,
    requests: Sequence[TraceRequest],
    arrivals: Sequence[float],
    spec: FleetSpec,
    seed: int,
    ids_cache: dict[int, list[int]],
) -> Outcome:
    preset = resolve_preset(PRESET)
    with_store = variant.endswith(STORE_SUFFIX)
    credit = variant.removesuffix(STORE_SUFFIX)
    tiers: dict[str, object] = {"credit": credit}
    mode = "precise"
    if credit == APPROXIMATE:  # no events: the index models HBM, DRAM and the store from what it sent
        mode, tiers = "approximate", {"credit": "physics", "offload_capacity_tokens": spec.dram_blocks * BLOCK}
    router: ScoringRouter = build_router({"seed": seed, "prefix_index": {"mode": mode}, "kv_tiers": tiers})
    bytes_per_block = BLOCK * kv_bytes_per_token_per_device(preset)
    store: SharedStore | None = None
    kv_store: dict[str, float] | None = None
    if with_store:
        store = SharedStore(
            spec.store_blocks, spec.store_bandwidth, spec.store_latency_s, bytes_per_block, spec.store_write
        )
        kv_store = {
            "capacity_tokens": spec.store_blocks * BLOCK,
            "bandwidth_gbps": spec.store_bandwidth / 1e9,
            "latency_ms": spec.store_latency_s * 1e3,
        }
    config = PoolConfig.model_validate(
        {
            "name": "p",
            "model": "m",
            "preset": PRESET,
            "endpoints": [{"url": f"http://e{i}"} for i in range(spec.engines)],
            "kv_store": kv_store,
        }
    )
    engines: list[Engine] = []
    store_seq = 0
    for i in range(spec.engines):
        kv = KVCacheManager(spec.hbm_blocks, BLOCK)
        offload = HostOffload(spec.dram_blocks, spec.dram_bandwidth, bytes_per_block).attach(kv)
        offload.store = store
        stats = EndpointStats(block_size=BLOCK, num_gpu_blocks=spec.hbm_blocks, scraped_at_s=0.0)
        endpoint = Endpoint(
            id=f"e{i}",
            pool="p",
            base_url=f"http://e{i}",
            engine="sim",
            served_model="m",
            state=EndpointState.READY,
            stats=stats,
        )
        engines.append(Engine(endpoint, kv, offload, Scheduler(kv, spec.max_num_seqs, spec.max_num_batched_tokens)))
    pool = Pool(config, endpoints=[e.endpoint for e in engines])
    step_time = StepTimer(preset)
    heap: list[tuple[float, int, int, int]] = []  # (time, order, kind 0 step-end / 1 arrival, index)
    order = 0
    for i, at in enumerate(arrivals):
        heapq.heappush(heap, (at, order, 1, i))
        order += 1
    tickets: dict[str, LoadTicket] = {}
    sim_requests: list[Request] = []
    oracle = 0
    prompt_total = 0

    def publish(engine: Engine, now: float) -> None:
        nonlocal store_seq
        if store is not None and store.events:
            store_seq += 1
            shared = KvEventBatch(seq=store_seq, ts=now, events=_wire(store.drain_events()), received_at_s=now)
            router.on_store_batch("p", shared)
        events = engine.pending + engine.kv.pool.drain_events()
        engine.pending = []
        if store is not None and store.write == WRITE_ON_COMPUTE:  # what the step computed, as LMCache stores it
            for e in events:
                if e.kind == "stored" and e.medium == "GPU":
                    store.put(e.block_hashes)
        for req in engine.changed:
            ticket = tickets.get(req.request_id)
            if ticket is not None:
                if req.num_output >= 1:
                    ticket.first_token(req.num_prompt + len(req.output_ids))
                if req.finished:
                    ticket.end()
        engine.changed = []
        if events:
            engine.seq += 1
            batch = KvEventBatch(seq=engine.seq, ts=now, events=_wire(events), received_at_s=now)
            router.on_kv_batch(engine.endpoint.id, batch)

    def start_step(index: int, now: float) -> None:
        nonlocal order
        engine = engines[index]
        s = engine.scheduler
        while True:
            step = s.schedule(now)
            if not step.empty:
                chunks = [(n, ctx) for _, n, ctx in step.prefills]
                end = now + step_time(chunks, len(step.decodes), step.decode_context_sum)
                changed = s.complete_step(step, end)
                engine.busy = True
                heapq.heappush(heap, (end, order, 0, index))
                order += 1
                # what the step reveals is delivered when it ends
                engine.pending = engine.kv.pool.drain_events()
                engine.changed = changed
                return
            if step.preempted:
                continue
            landing = s.next_pull_s()
            if landing is not None:
                engine.busy = True
                heapq.heappush(heap, (max(landing, now), order, 0, index))
                order += 1
                return
            engine.busy = False
            return

    while heap:
        now, _, kind, index = heapq.heappop(heap)
        if kind == 0:
            engine = engines[index]
            publish(engine, now)
            start_step(index, now)
            continue
        trace = requests[index]
        ids = prompt_ids(trace, ids_cache)
        for engine in engines:
            st = engine.endpoint.stats
            st.running = len(engine.scheduler.running)
            st.waiting = engine.scheduler.num_waiting
            st.kv_usage_ratio = engine.kv.usage
            st.scraped_at_s = now
        facts = RequestFacts(
            request_id=f"r{index}",
            api="chat",
            body={},
            requested_model="m",
            model="m",
            principal=PRINCIPAL,
            prompt_tokens=len(ids),
            prompt_token_ids=ids,
            max_tokens=trace.output_tokens,
        )
        route_request = RouteRequest(facts)
        decision = router.route(route_request, pool, now)
        assert decision is not None
        router.on_dispatch(route_request, decision)
        chosen = next(i for i, e in enumerate(engines) if e.endpoint is decision.endpoint)
        req = Request(facts.request_id, ids, [1] * trace.output_tokens, "length", now, trace.output_tokens)
        oracle += max(_true_hit_blocks(e, req) for e in engines) * BLOCK
        prompt_total += len(ids)
        tickets[req.request_id] = decision.endpoint.inflight.begin(decision.uncached_prefill_tokens(len(ids)))
        engines[chosen].scheduler.add(req)
        sim_requests.append(req)
        if not engines[chosen].busy:
            start_step(chosen, now)

    unfinished = [r for r in sim_requests if r.first_token_s is None]
    if unfinished:
        states = [(len(e.scheduler.waiting), len(e.scheduler.running), e.kv.pool.num_free) for e in engines]
        raise RuntimeError(f"{len(unfinished)} requests never started; engines (waiting, running, free) {states}")
    hit = sum(min(r.num_cached_tokens or 0, r.num_prompt) for r in sim_requests)
    loaded = sum(e.offload.stats.loaded_blocks for e in engines) * BLOCK
    return Outcome(
        variant=variant,
        seed=seed,
        ttft_s=[(r.first_token_s or 0.0) - r.arrival_s for r in sim_requests],
        prompt_tokens=prompt_total,
        hit_tokens=hit,
        oracle_tokens=min(oracle, prompt_total),
        loaded_tokens=loaded,
        gpu_hit_tokens=hit - loaded - (store.stats.loaded_blocks * BLOCK if store is not None else 0),
        store_tokens=store.stats.loaded_blocks * BLOCK if store is not None else 0,
    )


def cold_floor(requests: Sequence[TraceRequest], spec: FleetSpec) -> list[float]:
    """Per request, its TTFT with no queue and an unbounded cache that loads for free (module doc), s."""
    preset = resolve_preset(PRESET)
    chunk = spec.max_num_batched_tokens
    seen: set[int] = set()
    out: list[float] = []
    for r in requests:
        shared = 0
        while shared < len(r.hash_ids) and r.hash_ids[shared] in seen:
            shared += 1
        cached = min(shared * BLOCK_TOKENS, r.input_tokens - 1) // BLOCK * BLOCK
        out.append(
            sum(
                step_cost(preset, [(min(chunk, r.input_tokens - done), done)]).total_s
                for done in range(cached, r.input_tokens, chunk)
            )
        )
        seen.update(r.hash_ids)
    return out


def capacity(requests: Sequence[TraceRequest], spec: FleetSpec, seed: int, ids_cache: dict[int, list[int]]) -> float:
    """Requests per simulated second the fleet completes when everything arrives at once (gpu-only)."""
    burst = simulate("gpu-only", requests, [0.0] * len(requests), spec, seed, ids_cache)
    return len(requests) / max(burst.ttft_s)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=Path, default=None, help="the traces folder ($TOKENWAY_TRACES)")
    p.add_argument("--requests", type=int, default=300, help="about this many per seed (whole conversations)")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--hbm-tokens", type=int, default=80_000, help="HBM KV capacity per engine (tokens)")
    p.add_argument("--dram-tokens", type=int, default=400_000, help="host-DRAM tier per engine (tokens)")
    p.add_argument("--dram-gbps", type=float, default=25.0, help="PCIe bandwidth per device, GB/s")
    p.add_argument("--store-tokens", type=int, default=2_000_000, help="the shared store of `+store` (tokens)")
    p.add_argument("--store-gbps", type=float, default=10.0, help="the store's link per device, GB/s")
    p.add_argument("--store-latency-ms", type=float, default=1.0, help="the store's fixed cost per load, ms")
    p.add_argument("--store-write", choices=("compute", "evict"), default="compute", help="when blocks reach it")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--max-input", type=int, default=64_000, help="drop longer prompts (must fit HBM)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (results do not change)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "kv-tiers.md")
    return p


def _seed_requests(path: Path, requests: int, max_input: int, seed: int) -> list[TraceRequest]:
    out = load_mooncake(path, requests, seed, max_input + 4096, max_output_tokens=512)
    return [r for r in out if r.input_tokens <= max_input]


def _seed_bounds(task: tuple[Path, int, int, int, FleetSpec]) -> tuple[float, float]:
    """A seed's burst capacity (req/s) and the p90 of its cold floor (s)."""
    path, requests, max_input, seed, spec = task
    trace = _seed_requests(path, requests, max_input, seed)
    return capacity(trace, spec, seed, {}), pct(cold_floor(trace, spec), 0.9)


def _variant_run(task: tuple[Path, int, int, int, FleetSpec, str, float]) -> Outcome:
    """One (seed, variant) run at `rate` req/s; a process of its own under `--jobs` (the clock is
    simulated, so the numbers do not depend on how runs share the host)."""
    path, requests, max_input, seed, spec, variant, rate = task
    trace = _seed_requests(path, requests, max_input, seed)
    return simulate(variant, trace, scaled_arrivals(trace, rate), spec, seed, {})


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    traces = args.traces or traces_dir()
    path = require(traces / "mooncake" / "synthetic_trace.jsonl")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, args.requests = seeds[:1], 80
    spec = FleetSpec(
        engines=args.engines,
        hbm_blocks=args.hbm_tokens // BLOCK,
        dram_blocks=args.dram_tokens // BLOCK,
        dram_bandwidth=args.dram_gbps * 1e9,
        store_blocks=args.store_tokens // BLOCK,
        store_bandwidth=args.store_gbps * 1e9,
        store_latency_s=args.store_latency_ms / 1e3,
        store_write=args.store_write,
    )
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rates: dict[int, float] = {}
    floors: dict[int, float] = {}  # seed -> p90 of the cold floor
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else nullcontext() as pool:
        run = pool.map if pool is not None else map
        seed_tasks = [(path, args.requests, args.max_input, seed, spec) for seed in seeds]
        for seed, (cap, floor) in zip(seeds, run(_seed_bounds, seed_tasks), strict=True):
            rates[seed], floors[seed] = cap, floor
        tasks = [
            (path, args.requests, args.max_input, seed, spec, variant, args.load * rates[seed])
            for seed in seeds
            for variant in variants
        ]
        for (_, _, _, seed, _, variant, _), out in zip(tasks, run(_variant_run, tasks), strict=True):
            outcomes.append(out)
            print(
                f"seed {seed} {variant:9s} p50 {pct(out.ttft_s, 0.5):6.3f}s p90 {pct(out.ttft_s, 0.9):6.3f}s "
                f"hit {out.hit_tokens / out.prompt_tokens:5.1%} oracle {out.oracle_tokens / out.prompt_tokens:5.1%}",
                file=sys.stderr,
            )
    elapsed = time.perf_counter() - started
    write_report(args, spec, outcomes, rates, floors, elapsed)


def write_report(
    args: argparse.Namespace,
    spec: FleetSpec,
    outcomes: list[Outcome],
    rates: dict[int, float],
    floors: dict[int, float],
    elapsed: float,
) -> None:
    from bench.kv_tiers.report import render

    args.out.parent.mkdir(parents=True, exist_ok=True)
    text, plot = render(args, spec, outcomes, rates, floors, elapsed)
    args.out.write_text(with_plot(text, args.out, "p90 TTFT and hit rate per variant"))
    plot(args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
