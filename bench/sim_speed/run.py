"""Sim-speed benchmark: host CPU per generated token and real-time lag of a simulated fleet.

A fleet of simulated engines runs in one process (`worker.py`, like `tokenway sim --instances N`),
pinned to CPU 0; this process, pinned to CPU 1, is the load generator: streaming chat completions
with Azure-conversation-like lengths (prompts log-normal around `--prompt-mean` tokens, outputs
log-normal around `--output-mean`, ignore_eos), in one of two shapes:

- ``--mode open`` (default): Poisson arrivals at `--rate` requests per wall second for `--duration`
  seconds, round-robin over the instances; the same seed gives the same arrivals and lengths;
- ``--mode closed``: `--concurrency` streams per instance, each issuing its next request as soon as
  the last one ends, for `--duration` seconds.

Reported, over the window from the first arrival to the last response:

- engine CPU seconds (user + system of the fleet process) per 1,000 generated tokens, per request
  and per engine step;
- real-time lag: how far each engine's simulated clock ran behind wall-clock x time scale (in real
  milliseconds per wall second; the clock forgives lag instead of catching up, so this is host time
  that simulated latencies leave out);
- client-side excess latency: TTFT and end-to-end latency seen by the client minus the engine's own
  simulated TTFT and e2e divided by the time scale (what a benchmark through a gateway would see on
  top of the simulated latencies);
- how busy each core was, and how much of that was neither the fleet nor the client ("other CPU
  use": on a shared machine, a run with much of it is noisy; CPU per token is the robust figure).

    .venv/bin/python -m bench.sim_speed.run [--mode open --rate 100 --duration 15] [--json out.json]
    .venv/bin/python -m bench.sim_speed.run --baseline /tmp/old-tree --repeat 3   # old vs this, alternately
    .venv/bin/python -m bench.sim_speed.run --src /tmp/old-tree --json before.json  # one tree only
    .venv/bin/python -m bench.sim_speed.run --compare before.json after.json
    .venv/bin/python -m bench.sim_speed.run --profile prof.txt [--native]  # py-spy profile of the fleet
    .venv/bin/python -m bench.sim_speed.pyspy_top prof.txt

An old tree is a directory holding a `backends` package, e.g.
``mkdir /tmp/old && git archive <commit> backends | tar -x -C /tmp/old``. Results of this work:
`bench/results/sim-speed/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
VENV_BIN = Path(sys.executable).parent

# Common English words, each one cl100k token with its leading space: ~1 prompt token per word.
_WORDS = (
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
)


@dataclass(slots=True)
class Spec:
    index: int
    arrival_s: float  # wall seconds after the start (open loop)
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Result:
    instance: int
    ok: bool
    wall_ttft_s: float
    wall_e2e_s: float
    sim_ttft_s: float
    sim_e2e_s: float
    sim_tpot_s: float
    completion_tokens: int


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def make_specs(count: int, rate: float, prompt_mean: float, output_mean: float, seed: int) -> list[Spec]:
    """Deterministic workload: Poisson arrivals, log-normal prompt and output lengths (sigma 0.8)."""
    rng = random.Random(seed)
    specs: list[Spec] = []
    arrival = 0.0
    for index in range(count):
        arrival += rng.expovariate(rate) if rate > 0 else 0.0
        prompt_len = max(16, min(8000, round(_lognormal(rng, prompt_mean))))
        output_len = max(1, min(2048, round(_lognormal(rng, output_mean))))
        words = " ".join(rng.choice(_WORDS) for _ in range(prompt_len))
        specs.append(Spec(index, arrival, f"request {index} {seed}:{words}", output_len))
    return specs


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(session: aiohttp.ClientSession, url: str, instance: int, spec: Spec) -> Result:
    body = {
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first = 0.0
    events = 0
    tail = b""
    try:
        async with session.post(
            url + "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return Result(instance, False, 0, 0, 0, 0, 0, 0)
            async for data in resp.content.iter_any():
                if not first:
                    events += data.count(b"data: ")
                    if events >= 2:  # the role chunk, then the first token
                        first = time.monotonic()
                tail = (tail + data)[-8192:]
    except aiohttp.ClientError:
        return Result(instance, False, 0, 0, 0, 0, 0, 0)
    end = time.monotonic()
    usage: dict[str, Any] = {}
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {"):
            usage = orjson.loads(event[6:])
            break
    metrics = usage.get("metrics") or {}
    tokens = int((usage.get("usage") or {}).get("completion_tokens", 0))
    return Result(
        instance,
        tokens > 0,
        (first or end) - start,
        end - start,
        float(metrics.get("ttft_s", 0.0)),
        float(metrics.get("e2e_s", 0.0)),
        float(metrics.get("tpot_s", 0.0)),
        tokens,
    )


async def open_loop(urls: list[str], specs: list[Spec]) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks: list[asyncio.Task[Result]] = []
        t0 = time.monotonic()
        for spec in specs:
            delay = t0 + spec.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            instance = spec.index % len(urls)
            tasks.append(asyncio.create_task(one_request(session, urls[instance], instance, spec)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(urls: list[str], specs: list[Spec], concurrency: int, duration_s: float) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    results: list[Result] = []
    queue = iter(specs)
    deadline = time.monotonic() + duration_s

    async def stream(slot: int, session: aiohttp.ClientSession) -> None:
        instance = slot % len(urls)
        while time.monotonic() < deadline:
            spec = next(queue, None)
            if spec is None:
                return
            results.append(await one_request(session, urls[instance], instance, spec))

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(slot, session) for slot in range(concurrency * len(urls))))
    return results


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _core_busy_s() -> list[float]:
    """Busy seconds of each CPU (everything but idle and iowait), from /proc/stat: unlike the process's
    own CPU time, this includes the softirq work that loopback TCP does on the sender's core."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return []
    tick = os.sysconf("SC_CLK_TCK")
    busy: list[float] = []
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]
            busy.append((sum(values) - values[3] - values[4]) / tick)
    return busy


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        command = [
            sys.executable,
            str(WORKER),
            "--instances",
            str(args.instances),
            "--time-scale",
            str(args.time_scale),
            "--preset",
            args.preset,
            "--src",
            args.src or str(REPO),
        ]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: _pin(0)) if args.pin else None,
        )
        ready = self._read()
        self.urls: list[str] = ready["ready"]
        self.sim_path: str = ready.get("sim", "?")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fleet process exited")
        data: dict[str, Any] = json.loads(line)
        return data

    def mark(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("mark\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def summarize(
    args: argparse.Namespace, before: dict[str, Any], after: dict[str, Any], results: list[Result], client_cpu_s: float
) -> dict[str, Any]:
    wall = after["wall_s"] - before["wall_s"]
    cpu = after["cpu_s"] - before["cpu_s"]
    scale = args.time_scale
    tokens = sum(
        b["generation_tokens"] - a["generation_tokens"]
        for a, b in zip(before["engines"], after["engines"], strict=True)
    )
    steps = sum(b["steps"] - a["steps"] for a, b in zip(before["engines"], after["engines"], strict=True))
    lags = [
        ((wall * scale) - (b["sim_now_s"] - a["sim_now_s"])) / scale
        for a, b in zip(before["engines"], after["engines"], strict=True)
    ]
    ok = [r for r in results if r.ok]
    cores = [round((b - a) / wall, 3) for a, b in zip(before["cores_busy_s"], after["cores_busy_s"], strict=True)]
    excess_ttft = [(r.wall_ttft_s - r.sim_ttft_s / scale) * 1e3 for r in ok]
    excess_e2e = [(r.wall_e2e_s - r.sim_e2e_s / scale) * 1e3 for r in ok]
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "compare", "profile")},
        "sim": args.sim_path,
        "wall_s": round(wall, 3),
        "requests": len(results),
        "failed": len(results) - len(ok),
        "generated_tokens": int(tokens),
        "client_tokens": sum(r.completion_tokens for r in ok),
        "steps": int(steps),
        "engine_cpu_s": round(cpu, 3),
        "engine_cpu_util": round(cpu / wall, 3) if wall else 0.0,
        "client_cpu_s": round(client_cpu_s, 3),
        "cores_busy": cores,
        # CPU that neither the fleet nor this client used (other processes, kernel): a noisy-run flag
        "foreign_cores": round(sum(cores) - cpu / wall - client_cpu_s / wall, 3) if cores and wall else 0.0,
        "tokens_per_wall_s": round(tokens / wall, 1) if wall else 0.0,
        "cpu_ms_per_1k_tokens": round(cpu * 1e3 / tokens * 1e3, 2) if tokens else float("nan"),
        "cpu_ms_per_request": round(cpu * 1e3 / len(ok), 3) if ok else float("nan"),
        "cpu_us_per_step": round(cpu * 1e6 / steps, 1) if steps else float("nan"),
        "gc_collections_per_s": round((after.get("gc_collections", 0) - before.get("gc_collections", 0)) / wall, 1)
        if wall
        else 0.0,
        "lag_ms_per_wall_s_mean": round(statistics.fmean(lags) / wall * 1e3, 1) if wall else 0.0,
        "lag_ms_per_wall_s_max": round(max(lags) / wall * 1e3, 1) if wall else 0.0,
        "excess_ttft_ms": {f"p{q}": round(_percentile(excess_ttft, q / 100), 2) for q in (50, 90, 99)},
        "excess_e2e_ms": {f"p{q}": round(_percentile(excess_e2e, q / 100), 2) for q in (50, 90, 99)},
        "sim_ttft_ms_p50": round(_percentile([r.sim_ttft_s * 1e3 for r in ok], 0.5), 2),
        "sim_tpot_ms_p50": round(_percentile([r.sim_tpot_s * 1e3 for r in ok], 0.5), 3),
        "max_concurrency_est": round(sum(r.wall_e2e_s for r in ok) / wall, 1) if wall else 0.0,
    }


ROWS = (
    ("requests", "requests"),
    ("generated_tokens", "generated tokens"),
    ("wall_s", "window (wall s)"),
    ("tokens_per_wall_s", "tokens / wall s"),
    ("max_concurrency_est", "mean concurrent streams"),
    ("engine_cpu_util", "fleet CPU (cores)"),
    ("cpu_ms_per_1k_tokens", "CPU ms / 1k tokens"),
    ("cpu_ms_per_request", "CPU ms / request"),
    ("cpu_us_per_step", "CPU us / engine step"),
    ("gc_collections_per_s", "GC collections / s"),
    ("lag_ms_per_wall_s_mean", "clock lag ms / wall s (mean)"),
    ("lag_ms_per_wall_s_max", "clock lag ms / wall s (max)"),
    ("excess_ttft_ms.p50", "client excess TTFT p50 ms"),
    ("excess_ttft_ms.p99", "client excess TTFT p99 ms"),
    ("excess_e2e_ms.p50", "client excess e2e p50 ms"),
    ("excess_e2e_ms.p99", "client excess e2e p99 ms"),
    ("sim_ttft_ms_p50", "simulated TTFT p50 ms"),
    ("sim_tpot_ms_p50", "simulated TPOT p50 ms"),
    ("client_cpu_s", "client CPU s"),
    ("cores_busy", "busy fraction of each core (fleet on 0)"),
    ("foreign_cores", "other CPU use (cores; should be ~0)"),
)


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if part not in data:
            return "-"
        data = data[part]
    return data


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| metric | " + " | ".join(name for name, _ in runs) + " |", "| --- |" + " ---: |" * len(runs)]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(str(_get(data, key)) for _, data in runs) + " |")
    if len(runs) == 2:
        a, b = runs[0][1]["cpu_ms_per_1k_tokens"], runs[1][1]["cpu_ms_per_1k_tokens"]
        lines.append(f"\nCPU per generated token: {a / b:.2f}x less in `{runs[1][0]}` than in `{runs[0][0]}`")
    return "\n".join(lines)


async def _warm_up(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        specs = make_specs(len(urls), 0.0, 64, 4, seed=99)
        await asyncio.gather(
            *(one_request(session, url, i, spec) for i, (url, spec) in enumerate(zip(urls, specs, strict=True)))
        )


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop when installed (a slow client would inflate the excess latencies)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.mode == "open":
        count = max(1, round(args.rate * args.duration))
        specs = make_specs(count, args.rate, args.prompt_mean, args.output_mean, args.seed)
    else:
        specs = make_specs(100_000, 0.0, args.prompt_mean, args.output_mean, args.seed)
    fleet = Fleet(args)
    args.sim_path = fleet.sim_path
    profiler: subprocess.Popen[bytes] | None = None
    try:
        if args.pin:
            _pin(1)
        _run_loop(_warm_up(fleet.urls))
        if args.profile:
            profiler = subprocess.Popen(
                [
                    str(VENV_BIN / "py-spy"),
                    "record",
                    "-p",
                    str(fleet.proc.pid),
                    "-f",
                    "raw",
                    *(["--native"] if args.native else []),
                    "-r",
                    "200",
                    "-o",
                    args.profile,
                    *([] if args.native else ["--nonblocking"]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        before = fleet.mark()
        before["cores_busy_s"] = _core_busy_s()
        client_before = _cpu_s()
        if args.mode == "open":
            results = _run_loop(open_loop(fleet.urls, specs))
        else:
            results = _run_loop(closed_loop(fleet.urls, specs, args.concurrency, args.duration))
        client_cpu = _cpu_s() - client_before
        after = fleet.mark()
        after["cores_busy_s"] = _core_busy_s()
    finally:
        if profiler is not None:
            profiler.send_signal(2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                profiler.wait(timeout=30)
        fleet.close()
    return summarize(args, before, after, results, client_cpu)


def _median(values: list[Any]) -> Any:
    """Element-wise median of summaries (numbers, lists of numbers and dicts of those)."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _median([v[key] for v in values]) for key in first}
    if isinstance(first, bool) or not isinstance(first, int | float | list):
        return first
    if isinstance(first, list):
        return [_median([v[i] for v in values]) for i in range(len(first))] if first else []
    return round(statistics.median(values), 3)


def run_ab(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The baseline tree and this one, alternately, `--repeat` times each (a shared, noisy machine
    drifts; alternating spreads the drift over both)."""
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for index in range(args.repeat):
        for label, src in (("before", args.baseline), ("after", args.src)):
            one = argparse.Namespace(**vars(args))
            one.src = src
            summary = run(one)
            runs[label].append(summary)
            print(
                f"[{index + 1}/{args.repeat}] {label}: {summary['cpu_ms_per_1k_tokens']} CPU ms / 1k tokens, "
                f"lag {summary['lag_ms_per_wall_s_mean']} ms/s, other load {summary['foreign_cores']} cores",
                flush=True,
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("open", "closed"), default="open")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: requests per wall second (fleet)")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: streams per instance")
    parser.add_argument("--duration", type=float, default=15.0, help="wall seconds of arrivals")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--preset", default="llama-3.1-8b@h100")
    parser.add_argument("--prompt-mean", type=float, default=1000.0)
    parser.add_argument("--output-mean", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--src", default=None, help="directory with the `backends` package to benchmark")
    parser.add_argument(
        "--baseline", default=None, help="directory with an older `backends`: run it and this tree alternately"
    )
    parser.add_argument("--repeat", type=int, default=3, help="with --baseline: runs of each")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin fleet/client to CPUs 0/1")
    parser.add_argument("--profile", default=None, help="py-spy raw (collapsed) profile of the fleet to this file")
    parser.add_argument("--native", action="store_true", help="profile native (C) frames too")
    parser.add_argument("--json", default=None, help="write the summary (or, with --baseline, every run) here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print two summaries side by side")
    args = parser.parse_args()
    if args.compare:
        runs = [(Path(p).stem, json.loads(Path(p).read_text())) for p in args.compare]
        print(table(runs))
        return
    if args.baseline:
        ab = run_ab(args)
        print(f"\nmedians of {args.repeat} runs each\n")
        print(table([("before", _median(ab["before"])), ("after", _median(ab["after"]))]))
        if args.json:
            Path(args.json).write_text(json.dumps(ab, indent=2) + "\n")
        return
    summary = run(args)
    print(table([("run", summary)]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
