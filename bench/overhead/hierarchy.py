"""What the spend hierarchy costs admission: today's three buckets against the same three plus the
budgets of an organisation, a team, a project (tenant), a key and a tag, per admitted and settled
request, with the counters in memory and in Redis.

    .venv/bin/python -m bench.overhead.hierarchy [--rounds 5] [--requests 20000] [--concurrency 32]

Admission runs in this process (the gateway's own `Admission`, its stores and plans: nothing is
mocked, the HTTP walk is left out so the difference is not diluted by it); each round runs every
variant once, interleaved, and reports CPU µs per request of this process (`time.process_time`:
less sensitive to the 2-core host's other load than wall time) and, for Redis, of the redis-server
(from /proc), and the commands the scripts run per request (`INFO commandstats`). The target (issue
45): the hierarchy costs at most 1.15x the three buckets' CPU. Writes bench/results/overhead-hierarchy.md
and .png, with the hand-written reading of bench/results/overhead-hierarchy.notes.md (`bench/notes.py`);
where in the scripts Redis's CPU goes: `python -m bench.overhead.script_stages`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis as redis_client

from bench.limiter.common import RedisServer
from bench.notes import plot_line, section
from bench.overhead.run import RESULTS, cpu_seconds
from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.memory_store import MemoryStore
from policies.limits.redis_store import RedisStore
from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig
from policies.types import RequestFacts, RequestSubjects, Usage

KEY = "sk-bench-hierarchy"
WARM = 200  # admit + settle pairs before the measured ones
THREE = [{"scope": "key", "rpm": 10**9, "tpm": 10**12}, {"scope": "tenant", "tpm": 10**12}]
HIERARCHY_BUDGETS = [
    {"scope": "org", "usd_per_month": 1e9},
    {"scope": "team", "usd_per_month": 1e9},
    {"scope": "tenant", "usd_per_day": 1e9},
    {"scope": "key", "usd_per_day": 1e9},
    {"scope": "tag", "match": {"tag": "feature-x"}, "usd_per_day": 1e9},
]


def policy(hierarchy: bool) -> Policy:
    doc: dict[str, Any] = {
        "tenants": {"bench": {"team": "search"} if hierarchy else {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {"m": {"default_max_tokens": 64, "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}}},
        "limits": THREE,
    }
    if hierarchy:
        doc["orgs"] = {"acme": {}}
        doc["teams"] = {"search": {"org": "acme"}}
        doc["budgets"] = HIERARCHY_BUDGETS
    else:
        doc["admission"] = {"track_key_spend": False}
    return Policy(PoliciesConfig.model_validate(doc))


@dataclasses.dataclass
class Sample:
    variant: str
    store: str
    round: int
    cpu_us: float
    redis_cpu_us: float | None
    counters: int
    redis_commands: float | None = None  # commands the scripts ran per admit + settle (INFO commandstats)


async def run_variant(hierarchy: bool, redis_url: str | None, requests: int, concurrency: int) -> tuple[float, int]:
    """CPU seconds of this process for `requests` admit + settle, and the plan's counters."""
    p = policy(hierarchy)
    store: Any = MemoryStore() if redis_url is None else FailoverStore(RedisStore.from_url(redis_url, timeout_s=5.0))
    admission = Admission(p, store)
    principal = p.authenticate(KEY)
    assert principal is not None
    subjects = RequestSubjects(tags=("feature-x",)) if hierarchy else RequestSubjects()
    facts = RequestFacts(
        request_id="r",
        api="chat",
        body={},
        requested_model="m",
        model="m",
        principal=principal,
        prompt_tokens=30,
        max_tokens=16,
        output_reservation=16,
        subjects=subjects,
    )
    plan = p.admission_plan(principal, "m", subjects)
    usage = Usage(prompt_tokens=30, completion_tokens=10)

    async def worker(n: int) -> None:
        for _ in range(n):
            ticket = await admission.admit(facts, "m")
            assert isinstance(ticket, Admitted), ticket
            admission.settle_soon(ticket, usage, model="m")

    for _ in range(WARM):  # warm: plans compiled, scripts loaded, connections open
        ticket = await admission.admit(facts, "m")
        assert isinstance(ticket, Admitted)
        admission.settle_soon(ticket, usage, model="m")
    await admission.drain()
    started = time.process_time()
    share, extra = divmod(requests, concurrency)
    await asyncio.gather(*(worker(share + (1 if i < extra else 0)) for i in range(concurrency)))
    await admission.drain()
    spent = time.process_time() - started
    await admission.close()
    return spent, len(plan.buckets) + len(plan.budgets) + len(plan.leases)


def script_commands(client: redis_client.Redis) -> int:
    """Commands run so far, not counting the script calls themselves and this bench's own."""
    stats: dict[str, Any] = client.info("commandstats")
    skip = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_info", "cmdstat_script", "cmdstat_config", "cmdstat_ping")
    return sum(int(v["calls"]) for k, v in stats.items() if not k.startswith(skip) and k != "cmdstat_hello")


def measure(rounds: int, requests: int, concurrency: int) -> tuple[list[Sample], str]:
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        client = redis_client.Redis(host="127.0.0.1", port=redis.port)
        try:
            for r in range(rounds):
                order = [(h, s) for h in (False, True) for s in ("memory", "redis")]
                if r % 2:
                    order.reverse()
                for hierarchy, store in order:
                    url = redis.url if store == "redis" else None
                    redis_before = cpu_seconds(redis.proc.pid)
                    commands_before = script_commands(client) if url else 0
                    spent, counters = asyncio.run(run_variant(hierarchy, url, requests, concurrency))
                    redis_spent = cpu_seconds(redis.proc.pid) - redis_before
                    commands = (script_commands(client) - commands_before) / (requests + WARM) if url else None
                    samples.append(
                        Sample(
                            "hierarchy" if hierarchy else "three buckets",
                            store,
                            r,
                            spent / requests * 1e6,
                            redis_spent / requests * 1e6 if url else None,
                            counters,
                            commands,
                        )
                    )
            version = redis.version
        finally:
            redis.stop()
    return samples, version


def ratios(samples: list[Sample], store: str, field: str) -> list[float]:
    out = []
    for r in sorted({s.round for s in samples}):
        base = next(s for s in samples if s.round == r and s.store == store and s.variant == "three buckets")
        new = next(s for s in samples if s.round == r and s.store == store and s.variant == "hierarchy")
        a, b = getattr(new, field), getattr(base, field)
        if a is not None and b:
            out.append(a / b)
    return out


def write(samples: list[Sample], args: argparse.Namespace, version: str, took_s: float) -> Path:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Admission with the spend hierarchy: org + team + project + key + tag budgets vs three buckets",
        "",
        f"Generated by `python -m bench.overhead.hierarchy` on {now} in {took_s / 60:.1f} min. "
        f"{args.requests:,} admit + settle per variant and round, {args.concurrency} concurrent, "
        f"{args.rounds} rounds with the variants interleaved (alternating order); Redis {version}, private, "
        "on the same host. `three buckets`: key rpm + key tpm + tenant tpm (the `bench/overhead` policy). "
        "`hierarchy`: the same three plus budgets of the organisation, the team, the project (tenant), the "
        "key and a tag the request carries, in the same atomic reservation. CPU is this process's "
        "(`time.process_time`) per request, and the redis-server's for the Redis store; Redis commands are "
        "those the scripts run (`INFO commandstats`, the EVALSHAs themselves left out) per admit + settle. "
        "Both variants run the same code: the three buckets are today's baseline re-measured in the same "
        "rounds, with every cut made for the hierarchy applied to them too. "
        f"Host load average (1 min) {os.getloadavg()[0]:.1f} at the end, on 2 cores shared with other work.",
        "",
        "Target (issue 45): the hierarchy's CPU per request at most 1.15x the three buckets'. This table is "
        "admission alone (the strictest reading: the HTTP walk around it is left out); the whole request through "
        "`tokenway serve` is measured by `python -m bench.overhead.store`, whose `+ hierarchy` variants run the "
        "same policy beside the three-bucket ones in the same rounds "
        "([overhead-store-hierarchy.md](overhead-store-hierarchy.md), `--out`).",
        "",
        "| store | variant | counters | CPU µs / req (median) | Redis CPU µs / req (median) | "
        "Redis commands / req | hierarchy / three (median, min-max of rounds) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for store in ("memory", "redis"):
        for variant in ("three buckets", "hierarchy"):
            rows = [s for s in samples if s.store == store and s.variant == variant]
            cpu = statistics.median(s.cpu_us for s in rows)
            redis_values = [s.redis_cpu_us for s in rows if s.redis_cpu_us is not None]
            redis_cpu = f"{statistics.median(redis_values):.1f}" if redis_values else "-"
            ratio = ""
            if variant == "hierarchy":
                rs = ratios(samples, store, "cpu_us")
                ratio = f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
                if redis_values:
                    rr = ratios(samples, store, "redis_cpu_us")
                    ratio += f"; Redis {statistics.median(rr):.2f} ({min(rr):.2f}-{max(rr):.2f})"
            counts = [s.redis_commands for s in rows if s.redis_commands is not None]
            commands = f"{statistics.median(counts):.1f}" if counts else "-"
            lines.append(
                f"| {store} | {variant} | {rows[0].counters} | {cpu:.1f} | {redis_cpu} | {commands} | {ratio} |"
            )
    lines += ["", "Every round:", "", "| round | store | variant | CPU µs / req | Redis CPU µs / req |"]
    lines.append("| ---: | --- | --- | ---: | ---: |")
    for s in samples:
        redis_cpu = f"{s.redis_cpu_us:.1f}" if s.redis_cpu_us is not None else "-"
        lines.append(f"| {s.round} | {s.store} | {s.variant} | {s.cpu_us:.1f} | {redis_cpu} |")
    out = RESULTS / "overhead-hierarchy.md"
    lines += ["", plot_line(out, "CPU per request, hierarchy against three buckets"), "", *section(out)]
    out.write_text("\n".join(lines).rstrip("\n") + "\n")
    plot(samples, RESULTS / "overhead-hierarchy.png")
    return out


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values, errors = [], [], []
    for store in ("memory", "redis"):
        for variant in ("three buckets", "hierarchy"):
            cpu = [s.cpu_us + (s.redis_cpu_us or 0.0) for s in samples if s.store == store and s.variant == variant]
            labels.append(f"{store}\n{variant}")
            values.append(statistics.median(cpu))
            errors.append((statistics.median(cpu) - min(cpu), max(cpu) - statistics.median(cpu)))
    ax.bar(labels, values, yerr=list(zip(*errors, strict=True)), color=["#888", "#36c", "#888", "#36c"], capsize=4)
    ax.set_ylabel("CPU µs per admitted request (gateway + Redis)")
    ax.set_title("Admission: spend hierarchy vs three buckets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    started = time.monotonic()
    samples, version = measure(args.rounds, args.requests, args.concurrency)
    out = write(samples, args, version, time.monotonic() - started)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
