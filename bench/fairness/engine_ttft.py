"""What the simulated engine alone gives a light tenant's TTFT beside a batch full of someone else's decodes.

    .venv/bin/python -m bench.fairness.engine_ttft [--time-scale 0.25] [--probe-s 20]

The fairness benchmark's target (B's p99 TTFT <= 1.2x its solo baseline while A floods) has a part
no gateway can remove: once a request reaches the engine, its first token waits for the step running
then and comes out of a step that also carries every running sequence's decode. This measures that
part directly against one simulated engine (same preset, `--max-num-seqs 8`, time scale as the
benchmark), no gateway in between: B-like probes (the benchmark's B prompt, a few output tokens)
at Poisson arrivals, while `k` A-like requests (A's prompt and phase-2 outputs) run back to back
(a closed loop: each one that ends is replaced at once, so A's prefills keep landing in the batch,
as under the flood). Printed as markdown: TTFT p50/p99 per `k`, and the ratio to `k = 0`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.fairness.client import Outcome, send
from bench.fairness.client import body as request_body
from bench.fairness.workload import Request
from bench.replay.workload import PromptBuilder, TraceRequest
from tests.support.procs import start_sim

MODEL = "llama-3.1-8b"
PRESET = "llama-3.1-8b@h100"
MAX_NUM_SEQS = 8
PROBE_PROMPT, PROBE_OUTPUT = 300, 4  # B's prompt; a few tokens: only the first one is measured
LOAD_PROMPT, LOAD_OUTPUT = 300, 240  # A's prompt and its phase-2 output length


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def measure(
    url: str, background: int, probe_s: float, rate: float, prompts: PromptBuilder, seed: int
) -> list[float]:
    """Probe TTFTs (seconds) with `background` A-like requests running back to back."""
    rng = random.Random(seed)
    stop = asyncio.Event()
    serial = iter(range(10**9))

    def request(prompt: int, output: int) -> Request:
        index = next(serial)
        text = prompts.prompt(TraceRequest(index, 0.0, prompt, output), f"ttft-{seed}-{background}-{index}")
        return Request(index, "X", 0.0, prompt, output, text)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def load() -> None:
            while not stop.is_set():
                out = Outcome(-1, "A", 0, 0.0)
                await send(session, url, "none", request_body(request(LOAD_PROMPT, LOAD_OUTPUT), MODEL), out, 120.0)

        async def probe(out: Outcome) -> None:
            await send(session, url, "none", request_body(request(PROBE_PROMPT, PROBE_OUTPUT), MODEL), out, 60.0)

        await probe(Outcome(-1, "B", 0, 0.0))  # untimed: a first request pays one-off costs (connections)
        loaders = [asyncio.create_task(load()) for _ in range(background)]
        await asyncio.sleep(3.0 if background else 0.0)  # the batch fills, A's lengths spread
        probes: list[Outcome] = []
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        while time.perf_counter() - start < probe_s:
            await asyncio.sleep(rng.expovariate(rate))
            out = Outcome(len(probes), "B", 0, time.perf_counter() - start)
            probes.append(out)
            tasks.append(asyncio.create_task(probe(out)))
        await asyncio.gather(*tasks)
        stop.set()
        for task in loaders:
            task.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)
    return [o.ttft_s for o in probes if o.ttft_s is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--probe-s", type=float, default=20.0, help="probing time per batch occupancy")
    parser.add_argument("--rate", type=float, default=3.0, help="probes per second (Poisson)")
    parser.add_argument(
        "--background", default="0,3,6", help="A-like requests kept running (< 8: a probe needs a slot)"
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    prompts = PromptBuilder(args.seed)
    rows: list[tuple[int, int, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="tokenway-engine-ttft-") as tmp:
        extra = ["--max-num-seqs", str(MAX_NUM_SEQS), "--output-len-mean", "1"]
        engines = start_sim(
            Path(tmp), count=1, preset=PRESET, time_scale=args.time_scale, served_model_name=MODEL, args=extra
        )
        try:
            (url,) = engines.urls
            for k in (int(v) for v in args.background.split(",")):
                ttfts = asyncio.run(measure(url, k, args.probe_s, args.rate, prompts, args.seed))
                rows.append((k, len(ttfts), pct(ttfts, 50), pct(ttfts, 99)))
        finally:
            engines.stop()
    base = rows[0][3] if rows and rows[0][0] == 0 else None
    print(f"| A-like requests running (of {MAX_NUM_SEQS}) | probes | TTFT p50 | TTFT p99 | p99 vs none |")
    print("| --- | --- | --- | --- | --- |")
    for k, n, p50, p99 in rows:
        ratio = f"{p99 / base:.2f}x" if base else "-"
        print(f"| {k} | {n} | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms | {ratio} |")


if __name__ == "__main__":
    main()
