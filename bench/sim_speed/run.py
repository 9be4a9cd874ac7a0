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
`bench/results/sim-speed/RESULTS.md`. The workload and its client are in `client.py`, the summary and
tables in `report.py`, the fleet's process in `worker.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from bench.sim_speed.client import closed_loop, make_specs, open_loop, warm_up
from bench.sim_speed.report import median, summarize, table

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
VENV_BIN = Path(sys.executable).parent


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
        _run_loop(warm_up(fleet.urls))
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
        print(table([("before", median(ab["before"])), ("after", median(ab["after"]))]))
        if args.json:
            Path(args.json).write_text(json.dumps(ab, indent=2) + "\n")
        return
    summary = run(args)
    print(table([("run", summary)]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
