"""Micro-benchmark of one routing decision: µs per `route()` (and `on_dispatch()`) for 8 endpoints.

Not a test (docs/architecture.md, "Tests": tests never assert timings). Prompts are 4k tokens with realistic sharing:
a pool of 32 long "system prompts" (3k tokens) plus a unique 1k-token tail, so the index holds many
prefixes and lookups walk long matches. Every request is a fresh `RequestFacts`, so the numbers
include hashing the prompt (once per request, reused across candidates and by `on_dispatch`).

    .venv/bin/python -m bench.replay.route_microbench [--requests 5000] [--prompt-tokens 4096]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import OrderedDict
from typing import Any

from backends.block_hash import hash_blocks
from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.kv_events import BlockRemoved, BlockStored, KvEvent, KvEventBatch
from backends.types import Endpoint, EndpointState, EndpointStats
from policies.routing import build_router
from policies.routing.types import RouteRequest
from policies.types import Principal, RequestFacts

PRINCIPAL = Principal(key_id="k", tenant="t", allowed_models=None, priority=0)


def make_pool(n: int, engine: str) -> Pool:
    eps = [
        Endpoint(
            id=f"e{i}",
            pool="p",
            base_url=f"http://e{i}",
            engine=engine,
            served_model="m",
            state=EndpointState.READY,
            stats=EndpointStats(block_size=16, num_gpu_blocks=30_000, scraped_at_s=1.0),
        )
        for i in range(n)
    ]
    config = PoolConfig(name="p", model="m", endpoints=[StaticEndpointConfig(url=e.base_url) for e in eps])
    return Pool(config, endpoints=eps)


class EngineCache:
    """An engine's prefix cache reduced to what its events say: new blocks stored, LRU evictions."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, ids: list[int]) -> list[KvEvent]:
        hashes = hash_blocks(ids, 16)
        first_new = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        events: list[KvEvent] = []
        if first_new < len(hashes):
            parent = hashes[first_new - 1] if first_new else None
            events.append(BlockStored(hashes[first_new:], parent, ids[first_new * 16 : len(hashes) * 16], 16, "GPU"))
        evicted = []
        while len(self.blocks) > self.capacity_blocks:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(evicted, "GPU"))
        return events


def prompts(count: int, prompt_tokens: int, rng: random.Random) -> list[list[int]]:
    shared = [[rng.randrange(100_000) for _ in range(prompt_tokens * 3 // 4)] for _ in range(32)]
    tail = prompt_tokens - len(shared[0])
    return [rng.choice(shared) + [rng.randrange(100_000) for _ in range(tail)] for _ in range(count)]


def run(mode: str, engine: str, requests: int, prompt_tokens: int, endpoints: int) -> dict[str, Any]:
    rng = random.Random(1)
    router = build_router({"seed": 1, "prefix_index": {"mode": mode}})
    pool = make_pool(endpoints, engine)
    all_ids = prompts(requests, prompt_tokens, rng)
    route_us: list[float] = []
    dispatch_us: list[float] = []
    event_us: list[float] = []
    engines = {e.id: EngineCache(30_000) for e in pool.endpoints}
    gc.collect()
    gc.freeze()  # the prompts are long-lived setup, not garbage the router made
    for i, ids in enumerate(all_ids):
        facts = RequestFacts(
            request_id=f"r{i}",
            api="chat",
            body={},
            requested_model="m",
            model="m",
            principal=PRINCIPAL,
            prompt_tokens=len(ids),
            prompt_token_ids=ids,
        )
        request = RouteRequest(facts)
        t0 = time.perf_counter()
        decision = router.route(request, pool, 2.0)
        t1 = time.perf_counter()
        assert decision is not None
        router.on_dispatch(request, decision)
        t2 = time.perf_counter()
        route_us.append((t1 - t0) * 1e6)
        dispatch_us.append((t2 - t1) * 1e6)
        if mode == "precise":  # the engine reports what it cached and evicted, as vLLM's events would
            events = engines[decision.endpoint.id].serve(ids)
            t3 = time.perf_counter()
            router.on_kv_batch(decision.endpoint.id, KvEventBatch(seq=i, ts=0.0, events=events, received_at_s=2.0))
            event_us.append((time.perf_counter() - t3) * 1e6)
    warm = route_us[len(route_us) // 5 :]
    return {
        "mode": f"{mode} ({engine})" if mode == "precise" else mode,
        "route_p50_us": statistics.median(warm),
        "route_p99_us": statistics.quantiles(warm, n=100)[98],
        "dispatch_p50_us": statistics.median(dispatch_us[len(dispatch_us) // 5 :]),
        "index_mib": router.index.memory_bytes() / 2**20,
        "event_p50_us": statistics.median(event_us) if event_us else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--endpoints", type=int, default=8)
    args = parser.parse_args()
    print(f"{args.endpoints} endpoints, {args.prompt_tokens}-token prompts, {args.requests} requests")
    print(f"{'index':22s} {'route p50':>10s} {'route p99':>10s} {'dispatch p50':>13s} {'event p50':>10s} {'MiB':>6s}")
    for mode, engine in (("off", "sim"), ("approximate", "sim"), ("precise", "sim"), ("precise", "vllm")):
        r = run(mode, engine, args.requests, args.prompt_tokens, args.endpoints)
        print(
            f"{r['mode']:22s} {r['route_p50_us']:8.1f}µs {r['route_p99_us']:8.1f}µs "
            f"{r['dispatch_p50_us']:11.1f}µs {r['event_p50_us']:8.1f}µs {r['index_mib']:6.1f}"
        )


if __name__ == "__main__":
    main()
