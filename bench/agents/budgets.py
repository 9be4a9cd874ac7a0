"""Run budgets across two gateway replicas: does any agent run spend past its cap (issue 44)?

    .venv/bin/python -m bench.agents.budgets [--seeds 1,2,3] [--programs 48] [--width 20] [--quick]

The fairness part of this benchmark (`python -m bench.agents`) measures time; this part measures
money. A run's caps (`usd_per_run`, `tokens_per_run`, `calls_per_run`, docs/agents.md "Run budgets")
are reserved and settled in one atomic step in Redis, so parallel turns of one run spread over two
gateways should never spend past them. The e2e test shows it for one run of 20 calls; here many runs
race at once, each over both replicas, and the spend is read back three ways.

1. A private redis-server (no persistence, its own port), one simulated engine process (two
   Llama-3.1-8B@H100 engines), two `tokenway serve` processes sharing the Redis (`state: redis`,
   `fail_closed`), each writing its own ledger files into one folder.
2. Three tenants, one per cap: `usd` runs are capped by `usd_per_run`, `tokens` runs by
   `tokens_per_run`, `calls` runs by `calls_per_run` (each cap about two and a half turns' worth,
   so the boundary falls inside a turn); a generous rule of every kind for every run keeps all three
   counters of every run, whatever binds it.
3. Per seed (a round), `--programs` runs (a third per tenant), each a τ²-bench retail session
   (workload.py: the trace's prompt and completion lengths) replayed `--width` calls per turn, all
   at once, the calls of a turn alternating between the two gateways; runs start within
   `--stagger-s` of each other so many race at once. A run plays all its turns (at most `--turns`)
   whatever it is answered: calls after its cap must keep being refused, on either replica.
4. Per run, after every round: what the gateways' counters hold (`GET /v1/key?program=`, asked of
   the replica the run's first call did not go to), what the ledger's records of the run add up to
   (read after the gateways stop), and what the client was told (the 200s' `x-tokenway-cost-usd`
   and `usage`). Overshoot = the larger of counter and ledger less the cap; target 0 for every run.

Written to bench/results/agents-run-budgets.md and .png (budgets_report.py); `--raw F` keeps every
run's numbers, `--report-only F` re-renders them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.agents import budgets_report
from bench.agents.workload import Session, load_sessions
from bench.replay.workload import PromptBuilder, TraceRequest
from bench.traces import TRACES, require
from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.support.procs import (
    Gateway,
    free_port,
    redis_argv,
    spawn,
    start_gateway,
    start_sim,
    static_pool,
    stop_process,
    wait_redis,
)

MODEL = "llama-3.1-8b"
PRESET = "llama-3.1-8b@h100"
ENGINES = 2
MAX_NUM_SEQS = 64
RESULTS = Path(__file__).resolve().parents[1] / "results"
TRACE = TRACES / "exgentic_tau2_retail_10"
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 4.0}
# One tenant per cap, each about two and a half turns of 20 calls (a turn of ~5.4K-token prompts and
# ~100-token answers: ~110K tokens, ~$0.12), so the cap runs out inside a turn of parallel calls.
CAPS: dict[str, tuple[str, float]] = {
    "usd": ("usd_per_run", 0.30),
    "tokens": ("tokens_per_run", 270_000),
    "calls": ("calls_per_run", 50),
}
LOOSE: dict[str, float] = {"usd_per_run": 1_000.0, "tokens_per_run": 1e12, "calls_per_run": 1e9}


def key_of(tenant: str) -> str:
    return f"sk-bench-runbudget-{tenant}"


def policy() -> dict[str, Any]:
    """Every run has all three caps (the loose rule) and its tenant's tight one: the tight one binds,
    the loose ones keep the run's other counters so every run's spend can be read back."""
    usd_cap = CAPS["usd"][1]
    return {
        "tenants": {tenant: {} for tenant in CAPS},
        "keys": [{"id": f"k-{t}", "tenant": t, "sha256": hash_key(key_of(t))} for t in CAPS],
        "models": {MODEL: {"context_length": 32768, "price": dict(PRICE)}},
        "budgets": [
            {"scope": "program", "usd_per_run": LOOSE["usd_per_run"]},
            {"scope": "program", "match": {"tenant": "usd"}, "usd_per_run": usd_cap},
        ],
        "limits": [
            {
                "scope": "program",
                "calls_per_run": int(LOOSE["calls_per_run"]),
                "tokens_per_run": int(LOOSE["tokens_per_run"]),
            },
            {"scope": "program", "match": {"tenant": "tokens"}, "tokens_per_run": int(CAPS["tokens"][1])},
            {"scope": "program", "match": {"tenant": "calls"}, "calls_per_run": int(CAPS["calls"][1])},
        ],
        "admission": {"replicas": 2, "store_failure": "fail_closed"},
        # a turn of 20 calls from each of dozens of runs is more than the engines start at once: the rest
        # waits its turn rather than being shed (a shed call would be a refusal the caps did not make)
        "flow_control": {"bands": {"normal": {"max_queue_ms": 600_000, "on_timeout": 503}}},
    }


@dataclass(frozen=True, slots=True)
class RunPlan:
    """One agent run of a round: a session replayed `width` calls a turn, from `start_s`."""

    name: str
    tenant: str
    session: Session
    start_s: float
    first_gateway: int  # the replica its first call goes to; the counters are read from the other


@dataclass(slots=True)
class RunResult:
    name: str
    tenant: str
    session: str
    dimension: str
    cap: float
    sent: int = 0
    served: int = 0
    refused: int = 0  # 429s
    errors: int = 0  # anything else
    refused_turns: int = 0  # turns with at least one refused call
    first_refused_turn: int = -1
    served_after_refusal: int = 0  # 200s in a later turn than the first refusal (a smaller call that fit)
    refusal_codes: dict[str, int] = field(default_factory=dict)
    client_usd: float = 0.0  # sum of the 200s' x-tokenway-cost-usd
    client_tokens: int = 0  # sum of the 200s' usage.total_tokens
    counter: dict[str, float] = field(default_factory=dict)  # dimension -> used, as the tight cap's counter
    loose: dict[str, float] = field(default_factory=dict)  # dimension -> used, as the loose rule's counter
    ledger: dict[str, float] = field(default_factory=dict)  # usd, tokens, calls, records


def plan_round(sessions: Sequence[Session], *, seed: int, programs: int, turns: int, stagger_s: float) -> list[RunPlan]:
    """`programs` runs, a third per tenant, each a session drawn by `seed`, starting within `stagger_s`."""
    rng = random.Random(seed)
    tenants = list(CAPS)
    out: list[RunPlan] = []
    for i in range(programs):
        tenant = tenants[i % len(tenants)]
        session = rng.choice(list(sessions))
        out.append(
            RunPlan(
                f"r{seed}-{tenant}-{i:03d}",
                tenant,
                Session(session.name, session.turns[:turns]),
                round(rng.uniform(0.0, stagger_s), 3),
                rng.randrange(2),
            )
        )
    return out


def turn_body(plan: RunPlan, builder: PromptBuilder, turn: int, ident: int) -> bytes:
    """One body per turn (its `width` calls send the same prompt: a cap counts what is sent, not
    what differs); its blocks are the run's own, so no two runs share a prompt."""
    step = plan.session.turns[turn]
    count = -(-step.prompt_tokens // 512)
    ids = tuple(ident * 1_000 + i for i in range(count))
    prompt = builder.prompt(TraceRequest(0, 0.0, step.prompt_tokens, step.output_tokens, ids))
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": step.output_tokens,
            "ignore_eos": True,
        }
    )


@dataclass(slots=True)
class Answer:
    status: int = 0
    code: str = ""
    cost_usd: float = 0.0
    tokens: int = 0


async def post(session: aiohttp.ClientSession, url: str, body: bytes, plan: RunPlan, timeout_s: float) -> Answer:
    headers = {
        "Authorization": f"Bearer {key_of(plan.tenant)}",
        "Content-Type": "application/json",
        "x-tokenway-program": plan.name,
    }
    out = Answer()
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp,
        ):
            out.status = resp.status
            raw = await resp.read()
            answer = orjson.loads(raw) if raw else {}
            if resp.status == 200:
                out.cost_usd = float(resp.headers.get("x-tokenway-cost-usd", "0") or 0)
                out.tokens = int((answer.get("usage") or {}).get("total_tokens") or 0)
            else:
                error = answer.get("error") or {}
                message = str(error.get("message") or "")
                # a run's cap says it "does not reset" (policies/limits/admission.py); anything else is not one
                out.code = f"{error.get('code') or ''}:{'run cap' if 'does not reset' in message else 'other'}"
    except TimeoutError:
        out.code = "client_timeout"
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        out.code = f"client_error:{type(exc).__name__}"
    return out


async def play(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    plan: RunPlan,
    bodies: list[bytes],
    *,
    width: int,
    began: float,
    tool_s: float,
    timeout_s: float,
) -> RunResult:
    """Every turn's `width` calls at once, alternating between the replicas; all turns are played."""
    dimension, cap = CAPS[plan.tenant]
    result = RunResult(plan.name, plan.tenant, plan.session.name, dimension, cap)
    await asyncio.sleep(max(plan.start_s - (time.perf_counter() - began), 0.0))
    for turn, body in enumerate(bodies):
        if turn:
            await asyncio.sleep(tool_s)
        answers = await asyncio.gather(
            *(
                post(session, urls[(plan.first_gateway + branch) % len(urls)], body, plan, timeout_s)
                for branch in range(width)
            )
        )
        refused_now = False
        for answer in answers:
            result.sent += 1
            if answer.status == 200:
                result.served += 1
                result.client_usd += answer.cost_usd
                result.client_tokens += answer.tokens
                if 0 <= result.first_refused_turn < turn:
                    result.served_after_refusal += 1
            elif answer.status == 429:
                result.refused += 1
                refused_now = True
                result.refusal_codes[answer.code] = result.refusal_codes.get(answer.code, 0) + 1
            else:
                result.errors += 1
                result.refusal_codes[f"{answer.status}:{answer.code}"] = (
                    result.refusal_codes.get(f"{answer.status}:{answer.code}", 0) + 1
                )
        if refused_now:
            result.refused_turns += 1
            if result.first_refused_turn < 0:
                result.first_refused_turn = turn
    return result


async def standing(session: aiohttp.ClientSession, url: str, result: RunResult) -> None:
    """The run's counters as a replica reports them (`GET /v1/key?program=`): the tight cap's row
    and the loose rule's row of each dimension."""
    headers = {"Authorization": f"Bearer {key_of(result.tenant)}"}
    async with session.get(url + "/v1/key", params={"program": result.name}, headers=headers) as resp:
        data = (await resp.json())["data"]
    for row in data.get("limits", []):
        dimension = str(row.get("dimension"))
        if dimension not in LOOSE:
            continue
        used = float(row["used"])
        if float(row["limit"]) >= LOOSE[dimension]:
            result.loose[dimension] = used
        else:
            result.counter[dimension] = used


async def run_round(
    urls: Sequence[str], plans: Sequence[RunPlan], builder: PromptBuilder, args: argparse.Namespace, ident0: int
) -> list[RunResult]:
    bodies = {
        p.name: [turn_body(p, builder, t, ident0 + i) for t in range(len(p.session.turns))] for i, p in enumerate(plans)
    }
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        began = time.perf_counter()
        results = await asyncio.gather(
            *(
                play(
                    session,
                    urls,
                    p,
                    bodies[p.name],
                    width=args.width,
                    began=began,
                    tool_s=args.tool_s,
                    timeout_s=args.timeout_s,
                )
                for p in plans
            )
        )
        for plan, result in zip(plans, results, strict=True):
            await standing(session, urls[(plan.first_gateway + 1) % len(urls)], result)
    return list(results)


def read_ledger(folder: Path, results: Sequence[RunResult]) -> None:
    """Each run's records in the ledger files of both replicas: cost, tokens and served calls."""
    by_run = {(r.tenant, r.name): r for r in results}
    for r in results:
        r.ledger = {"usd": 0.0, "tokens": 0.0, "calls": 0.0, "records": 0.0}
    for entry in iter_entries(folder):
        run = by_run.get((str(entry.get("tenant")), str(entry.get("program"))))
        if run is None or entry.get("kind") not in (None, "request"):
            continue
        run.ledger["records"] += 1
        if int(entry.get("http_status") or 0) == 200:
            run.ledger["calls"] += 1
            run.ledger["usd"] += float(entry.get("cost_usd") or 0.0)
            run.ledger["tokens"] += float((entry.get("input_tokens") or 0) + (entry.get("output_tokens") or 0))


class Redis:
    """A private redis-server: nothing of another bench or test is in it, nothing of this one stays."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is required")
        self.port = free_port()
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.proc = spawn(
            redis_argv(binary, self.port, workdir / "redis"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def wait(self) -> None:
        wait_redis(self.url)

    def stop(self) -> None:
        stop_process(self.proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3", help="one round per seed")
    parser.add_argument("--programs", type=int, default=48, help="runs per round (a third per tenant)")
    parser.add_argument("--width", type=int, default=20, help="parallel calls per turn of a run")
    parser.add_argument("--turns", type=int, default=5, help="at most this many turns of a session")
    parser.add_argument("--stagger-s", type=float, default=10.0, help="runs start within this")
    parser.add_argument("--tool-s", type=float, default=0.2, help="a tool run between two turns (wall seconds)")
    parser.add_argument("--time-scale", type=float, default=20.0, help="engine seconds per wall second")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a call gives up after this")
    parser.add_argument("--quick", action="store_true", help="one seed, 12 runs of 3 turns (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "agents-run-budgets.md")
    parser.add_argument("--raw", type=Path, default=None, help="also write every run's numbers here (JSON)")
    parser.add_argument("--report-only", type=Path, default=None, help="re-render a raw JSON file")
    args = parser.parse_args()
    # a SIGTERM (a `timeout`, a kill) unwinds like Ctrl-C, so the `finally` below stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.report_only is not None:
        budgets_report.write(json.loads(args.report_only.read_text()), args.out)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, args.programs, args.turns = seeds[:1], 12, 3
        args.seeds = str(seeds[0])
    sessions = load_sessions(require(TRACE))
    rounds = {
        seed: plan_round(sessions, seed=seed, programs=args.programs, turns=args.turns, stagger_s=args.stagger_s)
        for seed in seeds
    }
    builder = PromptBuilder(seeds[0])
    results: dict[str, list[RunResult]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenway-run-budgets-") as tmp:
        workdir = Path(tmp)
        ledger_dir = workdir / "ledger"
        redis_server = Redis(workdir)
        engines = None
        gateways: list[Gateway] = []
        try:
            redis_server.wait()
            engines = start_sim(
                workdir,
                count=ENGINES,
                preset=PRESET,
                time_scale=args.time_scale,
                served_model_name=MODEL,
                args=["--max-num-seqs", str(MAX_NUM_SEQS)],
            )
            state = {"backend": "redis", "redis_url": redis_server.url, "redis_timeout_s": 10.0}
            for i in range(2):
                gateways.append(  # noqa: PERF401 (one by one: a failed start stops the ones before it)
                    start_gateway(
                        workdir / f"gw{i}",
                        pools=[static_pool("llama", MODEL, engines.urls, max_num_seqs=MAX_NUM_SEQS)],
                        policies=policy(),
                        state=state,
                        ledger={"dir": str(ledger_dir), "file_prefix": f"gw{i}", "commit_interval_ms": 10},
                        predictor={"worker": "thread", "online_training": False},
                    )
                )
            urls = [g.url for g in gateways]
            for seed, plans in rounds.items():
                began = time.time()
                done = asyncio.run(run_round(urls, plans, builder, args, ident0=seed * 1_000))
                results[str(seed)] = done
                print(
                    f"seed {seed}: {len(done)} runs, {sum(r.sent for r in done)} calls,"
                    f" {sum(r.refused for r in done)} refused, {sum(r.errors for r in done)} errors"
                    f" in {time.time() - began:.0f} s"
                )
        finally:
            for gateway in gateways:  # stopped before the ledger is read: their last records are flushed
                gateway.stop()
            if engines is not None:
                engines.stop()
            redis_server.stop()
        for done in results.values():
            read_ledger(ledger_dir, done)
    raw = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "pool": {"engines": ENGINES, "max_num_seqs": MAX_NUM_SEQS, "preset": PRESET, "replicas": 2},
        "price": PRICE,
        "caps": {tenant: list(cap) for tenant, cap in CAPS.items()},
        "rounds": {seed: [asdict(r) for r in done] for seed, done in results.items()},
    }
    if args.raw is not None:
        args.raw.write_text(json.dumps(raw))
    budgets_report.write(raw, args.out)


if __name__ == "__main__":
    main()
