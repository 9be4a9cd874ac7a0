"""Agent programs on a saturated pool: request-level fairness and program-fair queueing side by side.

    .venv/bin/python -m bench.agents [--seeds 1,2,3] [--time-scale 1] [--quick]
    .venv/bin/python -m bench.agents --modes program-reserve-2 --solo-from RAW  # rerun some modes

1. Two simulated Llama-3.1-8B@H100 engines (`--max-num-seqs 8`: 16 batch slots), flow control
   holding what they cannot start now (`max_engine_waiting: 0`), one tenant.
2. Per seed, programs of three widths replay τ²-bench retail sessions (workload.py): one 40-way
   program (it alone keeps 40 calls in flight against 16 slots: the pool is saturated from its first
   turn), two 4-way and three 1-way ones, starting at random times while the 40-way one runs.
3. Solo: every program of every seed alone on the pool (fresh engines and gateway), one after the
   other: its completion time with nobody else there.
4. Then the same programs of each seed together, once per mode (fresh engines and gateway each):
   `request` (flow control, the tenant's requests in arrival order: request-level fairness),
   `program` (the tenant's `program_fairness: {half_life_s: 60}`: least attained service first) and
   `program-2` (the same on two gateways sharing the attained service through Redis, each turn's
   calls alternating between them; needs Redis on 127.0.0.1:6379), and `program-reserve` /
   `program-reserve-2` (the same with the program slot reserve, `program_reserve_slots`: a program
   over its share of the tenant's calls in flight leaves that many of an engine's slots free while a
   smaller program is active).
5. Per program: completion time (first call sent to last answer) over its solo time; per width,
   p50 and p99 over the programs of every seed. Written to bench/results/agents.md and agents.png
   (report.py). Target: the 1-way programs' p99 at most 1.5x their solo time.

Calls are non-streamed chat completions (`ignore_eos`, `max_tokens` the trace's completion length),
each naming its program in `x-tokenway-program`; every call's status, wait in the gateway,
end-to-end time, cached prompt tokens and the engine's own time (the simulator's `metrics`) is kept
in the raw JSON (`--raw`), so a program's slowdown splits into waiting and a slower engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.agents import report
from bench.agents.workload import Program, Session, load_sessions, programs
from bench.replay.workload import PromptBuilder
from bench.traces import TRACES, require
from policies.policy import hash_key
from tests.support.procs import Gateway, SimEngines, start_gateway, start_sim, static_pool

MODEL = "llama-3.1-8b"
PRESET = "llama-3.1-8b@h100"
MAX_NUM_SEQS = 8
ENGINES = 2
KEY = "sk-bench-agents-0001"
TENANT = "agents"
HALF_LIFE_S = 60.0
PROGRAM_RESERVE_SLOTS = 3  # of MAX_NUM_SEQS per engine
RESULTS = Path(__file__).resolve().parents[1] / "results"
TRACE = TRACES / "exgentic_tau2_retail_10"
WIDTHS: tuple[tuple[int, int], ...] = ((40, 1), (4, 2), (1, 3))  # (calls per turn, programs of it)
REDIS_URL = "redis://127.0.0.1:6379/0"
FAIR: dict[str, Any] = {"program_fairness": {"half_life_s": HALF_LIFE_S}}
MODES: dict[str, dict[str, Any]] = {
    "request": {"tenant": {}, "replicas": 1},  # the tenant's waiting requests in arrival order
    "program": {"tenant": FAIR, "replicas": 1},
    # two gateways sharing the attained service through Redis, each program's calls spread over both
    "program-2": {"tenant": FAIR, "replicas": 2},
    # program-fair, and the program slot reserve: a program over its share of the tenant's calls in
    # flight keeps `--program-reserve-slots` of each engine's slots free while a smaller one is active
    "program-reserve": {"tenant": FAIR, "replicas": 1, "program_reserve": True},
    "program-reserve-2": {"tenant": FAIR, "replicas": 2, "program_reserve": True},
}


@dataclass(slots=True)
class Call:
    turn: int
    branch: int
    sent_s: float  # since the program started
    e2e_s: float = 0.0
    status: int = 0
    code: str = ""
    queued_ms: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    engine_s: float = 0.0  # the engine's own end-to-end time (the simulator's `metrics.e2e_s`, engine seconds)


@dataclass(slots=True)
class ProgramRun:
    name: str
    width: int
    session: str
    start_s: float  # since the run began
    completion_s: float = 0.0
    calls: list[Call] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status == 200 for c in self.calls)

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["calls"] = [
            [c.turn, c.branch, round(c.sent_s, 4), round(c.e2e_s, 4), c.status, c.code, c.queued_ms,
             c.completion_tokens, c.cached_tokens, round(c.engine_s, 4)]
            for c in self.calls
        ]  # fmt: skip
        return out


def bodies(program: Program, builder: PromptBuilder) -> list[list[bytes]]:
    """Every call's body, turn by turn and branch by branch, built before the clock starts."""
    out: list[list[bytes]] = []
    for turn, step in enumerate(program.session.turns):
        out.append(
            [
                orjson.dumps(
                    {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": program.prompt(builder, branch, turn)}],
                        "max_tokens": step.output_tokens,
                        "ignore_eos": True,
                    }
                )
                for branch in range(program.width)
            ]
        )
    return out


async def call(
    session: aiohttp.ClientSession, url: str, data: bytes, program: str, out: Call, timeout_s: float
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "x-tokenway-program": program}
    start = time.perf_counter()
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(url + "/v1/chat/completions", data=data, headers=headers) as resp,
        ):
            out.status = resp.status
            answer = orjson.loads(await resp.read())
            out.queued_ms = float(resp.headers.get("x-tokenway-queued-ms", 0) or 0)
            if resp.status == 200:
                usage = answer.get("usage") or {}
                out.completion_tokens = int(usage.get("completion_tokens") or 0)
                out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                out.engine_s = float((answer.get("metrics") or {}).get("e2e_s") or 0.0)
            else:
                out.code = str((answer.get("error") or {}).get("code") or "")
    except TimeoutError:
        out.code = "client_timeout"
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        out.code = f"client_error:{type(exc).__name__}"
    finally:
        out.e2e_s = time.perf_counter() - start


async def run_program(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    program: Program,
    data: list[list[bytes]],
    *,
    began: float,
    solo: bool,
    tool_s: float,
    timeout_s: float,
) -> ProgramRun:
    """The program's turns, each `width` calls at once, a tool run between turns; with several
    gateways, a turn's calls alternate between them (the next turn starts one further on)."""
    if not solo:
        await asyncio.sleep(max(program.start_s - (time.perf_counter() - began), 0.0))
    result = ProgramRun(program.name, program.width, program.session.name, time.perf_counter() - began)
    start = time.perf_counter()
    for turn, turn_bodies in enumerate(data):
        if turn:
            await asyncio.sleep(tool_s)
        calls = [Call(turn, branch, time.perf_counter() - start) for branch in range(program.width)]
        result.calls += calls
        await asyncio.gather(
            *(
                call(session, urls[(turn + branch) % len(urls)], body, program.name, out, timeout_s)
                for branch, (body, out) in enumerate(zip(turn_bodies, calls, strict=True))
            )
        )
    result.completion_s = time.perf_counter() - start
    return result


async def replay(
    urls: Sequence[str],
    batch: Sequence[Program],
    builder: PromptBuilder,
    *,
    solo: bool,
    tool_s: float,
    timeout_s: float,
) -> list[ProgramRun]:
    """The programs together (each from its start time), or with `solo` one after the other."""
    data = {p.name: bodies(p, builder) for p in batch}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for url in urls:  # one-off costs
            await call(session, url, data[batch[0].name][0][0], "warm", Call(0, 0, 0.0), timeout_s)
        began = time.perf_counter()

        def one(p: Program) -> Coroutine[Any, Any, ProgramRun]:
            return run_program(
                session, urls, p, data[p.name], began=began, solo=solo, tool_s=tool_s, timeout_s=timeout_s
            )

        if solo:
            return [await one(p) for p in batch]
        return list(await asyncio.gather(*(one(p) for p in batch)))


def policy(mode: str) -> dict[str, Any]:
    return {
        "tenants": {TENANT: dict(MODES[mode]["tenant"])},
        "keys": [{"id": "agents", "tenant": TENANT, "sha256": hash_key(KEY)}],
        "models": {MODEL: {"context_length": 32768}},
        "flow_control": {"bands": {"normal": {"max_queue_ms": 600_000, "on_timeout": 503}}},
    }


def start(workdir: Path, mode: str, args: argparse.Namespace) -> tuple[SimEngines, list[Gateway]]:
    workdir.mkdir(parents=True, exist_ok=True)
    engines = start_sim(
        workdir,
        count=ENGINES,
        preset=PRESET,
        time_scale=args.time_scale,
        served_model_name=MODEL,
        args=["--max-num-seqs", str(MAX_NUM_SEQS)],
    )
    saturation: dict[str, Any] = {"max_engine_waiting": 0}
    if MODES[mode].get("program_reserve"):
        saturation["program_reserve_slots"] = args.program_reserve_slots
    sections: dict[str, Any] = {
        "flow_control": {"enabled": True, "saturation": saturation},
        "predictor": {"worker": "thread", "online_training": False, "prior": {"time_scale": args.time_scale}},
        "backends": {"scrape_interval_s": 0.05},
        "ledger": {"enabled": False},
    }
    replicas = int(MODES[mode]["replicas"])
    if replicas > 1:
        prefix = f"tokenway-bench-agents:{uuid.uuid4().hex[:8]}"
        sections["state"] = {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix}
    gateways: list[Gateway] = []
    try:
        for i in range(replicas):  # kept one by one: a failed start stops the ones before it
            gateways.append(  # noqa: PERF401
                start_gateway(
                    workdir / f"gw{i}",
                    pools=[static_pool("llama", MODEL, engines.urls, max_num_seqs=MAX_NUM_SEQS)],
                    policies=policy(mode),
                    **sections,
                )
            )
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        engines.stop()
        raise
    return engines, gateways


def run_mode(
    name: str, workdir: Path, runs: dict[int, list[Program]], builder: PromptBuilder, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Every seed's programs through one fresh pool: together, or with `name` "solo" one by one."""
    engines, gateways = start(workdir / name, "request" if name == "solo" else name, args)
    urls = [g.url for g in gateways]
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for seed, batch in runs.items():
            began = time.time()
            done = asyncio.run(
                replay(urls, batch, builder, solo=name == "solo", tool_s=args.tool_s, timeout_s=args.timeout_s)
            )
            out[str(seed)] = [r.row() for r in done]
            failed = sum(1 for r in done for c in r.calls if c.status != 200)
            print(f"{name} seed {seed}: {len(done)} programs in {time.time() - began:.0f} s, {failed} calls failed")
    finally:
        for gateway in gateways:
            gateway.stop()
        engines.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--time-scale", type=float, default=1.0, help="engine seconds per wall second")
    parser.add_argument("--tool-s", type=float, default=0.2, help="a tool run between two turns (wall seconds)")
    parser.add_argument("--stagger-s", type=float, default=8.0, help="the smaller programs start within this")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="a call gives up after this")
    parser.add_argument("--modes", default="request,program,program-2,program-reserve,program-reserve-2")
    parser.add_argument(
        "--program-reserve-slots",
        type=int,
        default=PROGRAM_RESERVE_SLOTS,
        help="the program-reserve modes' `program_reserve_slots` (free slots kept per engine)",
    )
    parser.add_argument("--quick", action="store_true", help="one seed, fewer turns (smoke run; numbers are noisy)")
    parser.add_argument("--out", type=Path, default=RESULTS / "agents.md")
    parser.add_argument("--raw", type=Path, default=None, help="also write every program and call here (JSON)")
    parser.add_argument(
        "--solo-from",
        type=Path,
        default=None,
        help="take the solo runs from this raw JSON (same seeds and options) instead of running them again:"
        " a rerun of some modes is then read against the same solo times as the run it completes",
    )
    parser.add_argument("--report-only", type=Path, default=None, help="re-render a raw JSON file")
    args = parser.parse_args()
    if args.report_only is not None:
        report.write(json.loads(args.report_only.read_text()), args.out)
        return
    sessions: list[Session] = load_sessions(require(TRACE))
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds = seeds[:1]
        sessions = [Session(s.name, s.turns[:4]) for s in sessions]
    runs = {seed: programs(sessions, WIDTHS, seed=seed, stagger_s=args.stagger_s) for seed in seeds}
    builder = PromptBuilder(seeds[0])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tokenway-agents-") as tmp:
        if args.solo_from is not None:
            earlier = json.loads(args.solo_from.read_text())
            if {int(seed) for seed in earlier["runs"]["solo"]} != set(seeds):
                raise SystemExit(f"{args.solo_from}: its solo runs are of other seeds")
            results["solo"] = earlier["runs"]["solo"]
        else:
            results["solo"] = run_mode("solo", Path(tmp), runs, builder, args)
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, Path(tmp), runs, builder, args)
    raw = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "pool": {"engines": ENGINES, "max_num_seqs": MAX_NUM_SEQS, "preset": PRESET},
        "widths": [list(w) for w in WIDTHS],
        "half_life_s": HALF_LIFE_S,
        "program_reserve_slots": args.program_reserve_slots,
        "sessions": {s.name: [[t.prompt_tokens, t.output_tokens] for t in s.turns] for s in sessions},
        "runs": results,
    }
    if args.raw is not None:
        args.raw.write_text(json.dumps(raw))
    report.write(raw, args.out)
