"""The engine loop alone: CPU per step and per decoded token of N engines in one event loop, no HTTP.

Each engine gets `batch` requests with long outputs, so every step is a decode step of that batch;
the CPU time of the process over a few seconds of wall time, divided by the steps and tokens.

    .venv/bin/python -m bench.sim_speed.engine_loop [--engines 8] [--batch 1 4 16 64] [--src OLD_TREE]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def measure(engines: int, batch: int, seconds: float, time_scale: float) -> str:
    from sim.config import build_engine_config
    from sim.engine import SimEngine

    config = build_engine_config("llama-3.1-8b@h100", time_scale=time_scale)
    fleet = []
    for e in range(engines):
        engine = SimEngine(config)
        await engine.start()
        fleet.append(engine)
        for i in range(batch):
            prompt = [e * 10**6 + i * 1000 + j for j in range(1000)]
            engine.submit(engine.create_request(prompt, max_tokens=4000, ignore_eos=True))
    await asyncio.sleep(0.3)  # past the prefills
    steps0, cpu0, wall0 = sum(e.steps for e in fleet), time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    steps1, cpu1, wall1 = sum(e.steps for e in fleet), time.process_time(), time.monotonic()
    for engine in fleet:
        await engine.stop()
    steps, cpu = steps1 - steps0, cpu1 - cpu0
    return (
        f"{engines} engines x batch {batch:4d}: {steps / (wall1 - wall0):6.0f} steps/s, "
        f"{cpu / steps * 1e6:6.1f} us CPU/step, {cpu / (steps * batch) * 1e6:6.2f} us CPU/token, "
        f"{cpu / (wall1 - wall0):.2f} cores"
    )


async def main(args: argparse.Namespace) -> None:
    for batch in args.batch:
        print(await measure(args.engines, batch, args.seconds, args.time_scale), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--src", default=str(REPO), help="directory holding the `backends` package to run")
    arguments = parser.parse_args()
    sys.path.insert(0, arguments.src)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(main(arguments))
    else:
        uvloop.run(main(arguments))
