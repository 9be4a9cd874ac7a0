"""(b) Cost: the limiter's added latency per request, memory store vs Redis, with 3 and 6 buckets.

One process, one request at a time (so the numbers are the limiter's own cost, not queueing): admit
is on the request's critical path, settle runs after the response. A Redis PING over the same
connection is measured alongside as the floor of any Redis-backed limiter (one round trip). A second
pass keeps 64 requests in flight to show sustainable admissions per second from one event loop, with
the auto-pipelining on (the default) and off (one write per script call), interleaved over 7 rounds
(medians reported) so that both see the same background load.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.limiter.common import BUCKETS_3, BUCKETS_6, KEY, RedisServer, policy_doc
from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.redis_store import RedisStore
from policies.policy import Policy
from policies.schema import PoliciesConfig
from policies.types import RequestFacts, Usage

ROUNDS = 7


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _facts(policy: Policy) -> RequestFacts:
    who = policy.authenticate(KEY)
    assert who is not None
    return RequestFacts(
        request_id="b",
        api="chat",
        body={},
        requested_model="m",
        model="m",
        principal=who,
        prompt_tokens=500,
        max_tokens=256,
        output_reservation=256,
    )


async def sequential(admission: Admission, facts: RequestFacts, iterations: int) -> dict[str, float]:
    usage = Usage(500, 100)
    admit_us: list[float] = []
    settle_us: list[float] = []
    for i in range(iterations + iterations // 10):
        t0 = time.perf_counter_ns()
        ticket = await admission.admit(facts, "m")
        t1 = time.perf_counter_ns()
        assert isinstance(ticket, Admitted), ticket
        await admission.settle(ticket, usage, model="m")
        t2 = time.perf_counter_ns()
        if i >= iterations // 10:  # the first tenth warms up
            admit_us.append((t1 - t0) / 1000)
            settle_us.append((t2 - t1) / 1000)
    return {
        "admit_p50_us": _pct(admit_us, 0.5),
        "admit_p99_us": _pct(admit_us, 0.99),
        "settle_p50_us": _pct(settle_us, 0.5),
        "settle_p99_us": _pct(settle_us, 0.99),
        "total_mean_us": statistics.fmean(a + s for a, s in zip(admit_us, settle_us, strict=True)),
    }


async def concurrent(admission: Admission, facts: RequestFacts, requests: int, in_flight: int = 64) -> float:
    usage = Usage(500, 100)
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            ticket = await admission.admit(facts, "m")
            assert isinstance(ticket, Admitted)
            await admission.settle(ticket, usage, model="m")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return requests / (time.perf_counter() - t0)


async def ping_p50_us(store: FailoverStore, iterations: int = 2000) -> float:
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        await store.redis.client.ping()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return _pct(samples, 0.5)


async def script_us(store: FailoverStore) -> dict[str, float]:
    """Server-side time per script call (Redis's own accounting: INFO commandstats)."""
    stats = await store.redis.client.info("commandstats")
    calls = stats.get("cmdstat_evalsha", {})
    total_us, count = float(calls.get("usec", 0)), int(calls.get("calls", 0))
    return {"redis_script_us": total_us / count if count else 0.0}


async def measure(url: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, limits in (("3 buckets", BUCKETS_3), ("6 buckets", BUCKETS_6)):
        policy = Policy(PoliciesConfig.model_validate(policy_doc(limits)))
        facts = _facts(policy)
        buckets = len(policy.admission_plan(facts.principal, "m").buckets)
        memory = Admission(policy, MemoryStore())
        rows.append(
            {
                "store": "memory",
                "buckets": buckets,
                "label": label,
                **await sequential(memory, facts, 50_000),
                "throughput_rps": await concurrent(memory, facts, 100_000),
            }
        )
        store = FailoverStore(RedisStore.from_url(url, prefix=f"bench-latency-{buckets}", timeout_s=1.0))
        shared = Admission(policy, store)
        await store.redis.client.config_resetstat()
        row = {
            "store": "redis",
            "buckets": buckets,
            "label": label,
            **await sequential(shared, facts, 10_000),
            "ping_p50_us": await ping_p50_us(store),
            **await script_us(store),
        }
        unbatched = FailoverStore(
            RedisStore.from_url(url, prefix=f"bench-latency-{buckets}", timeout_s=1.0, batch=False)
        )
        baseline = Admission(policy, unbatched)
        piped: list[float] = []
        plain: list[float] = []
        for _ in range(ROUNDS):  # interleaved, so both see the same background load
            piped.append(await concurrent(shared, facts, 4000))
            plain.append(await concurrent(baseline, facts, 4000))
        row["throughput_rps"] = statistics.median(piped)
        row["unbatched_throughput_rps"] = statistics.median(plain)
        await shared.close()
        await baseline.close()
        rows.append(row)
    return rows


def main() -> tuple[list[dict[str, Any]], str]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            return uvloop.run(measure(server.url)), server.version
        finally:
            server.stop()


if __name__ == "__main__":
    found, version = main()
    print("redis", version, file=sys.stderr)
    for r in found:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()})
