"""The engine side of the sim-speed benchmark: a simulated fleet in one process, as `tokenway sim
--instances N` runs it (uvloop, one event loop), reporting its own CPU time and simulated clocks.

Protocol on stdin/stdout, one JSON object a line: prints ``{"ready": [urls...]}`` once listening;
each ``mark`` line read gets a snapshot back; end of input stops the fleet. `--src DIR` imports
`backends` from DIR first (to measure an older copy of the simulator against the same load).

    python bench/sim_speed/worker.py --instances 8 --time-scale 10 [--src /tmp/old-tree]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _snapshot(instances: list[Any], started: float) -> dict[str, Any]:
    engines = []
    for instance in instances:
        engine = instance.engine
        labels = {"model_name": engine.config.served_model_name, "engine": "0"}
        registry = engine.metrics.registry
        engines.append(
            {
                "sim_now_s": engine.clock.now(),
                "steps": engine.steps,
                "generation_tokens": registry.get_sample_value("vllm:generation_tokens_total", labels) or 0.0,
                "prompt_tokens": registry.get_sample_value("vllm:prompt_tokens_total", labels) or 0.0,
            }
        )
    collections = sum(generation["collections"] for generation in gc.get_stats())
    return {"wall_s": time.monotonic() - started, "cpu_s": _cpu_s(), "gc_collections": collections, "engines": engines}


async def _main(args: argparse.Namespace) -> None:
    from sim.config import build_engine_config
    from sim.server import start_instances, stop_instance

    config = build_engine_config(args.preset, time_scale=args.time_scale, seed=args.seed)
    started = time.monotonic()  # the engines' clocks start within milliseconds of this
    instances = await start_instances(config, args.instances, "127.0.0.1", 0)
    import sim

    print(json.dumps({"ready": [i.url for i in instances], "sim": str(Path(sim.__file__).parent)}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            if line.strip() == b"mark":
                print(json.dumps(_snapshot(instances, started)), flush=True)
    finally:
        for instance in instances:
            await stop_instance(instance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b@h100")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--src", default=str(REPO), help="directory holding the `backends` package to run")
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    with contextlib.suppress(ImportError):  # pragma: no cover
        import uvloop

        uvloop.install()
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
