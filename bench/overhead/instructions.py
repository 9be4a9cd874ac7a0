"""Gateway instructions per request by API, counted by Valgrind's callgrind: what `bench.overhead.apis`
measures in CPU time, without the host's noise.

CPU time per request on a shared 2-core host moves by ±10-40 % from one 2 s point to the next (other
processes' cache and scheduler traffic), which is more than the 10 % the per-API target allows. The
number of instructions the gateway executes per request does not depend on who else runs: the same
gateway and instant upstream as `bench.overhead.apis`, the gateway under callgrind (instrumentation
switched on once it is ready), and per API `--requests` requests at `--connections` in flight after
a warm-up, the counters zeroed before and dumped after. Instructions are not time (a cache miss
costs more than an add), but the APIs share the walk and differ only in their own code, so the ratio
is the share of extra work the target is about. Results: bench/results/overhead-apis-instructions.md.

    .venv/bin/python -m bench.overhead.instructions [--requests 600] [--connections 8,32] [--rounds 2]
        [--policy full]   # metrics, ledger and predictor on (bench.overhead's full policy), not telemetry off
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.overhead.apis import REQUESTS, start_api_upstream
from bench.overhead.run import KEY, RESULTS, ensure_tools, tokenway_config
from tests.support.procs import free_port, http_get

REPO = Path(__file__).resolve().parents[2]


async def load(url: str, body: dict[str, object], requests: int, connections: int) -> int:
    """`requests` POSTs with `connections` in flight; the number answered 200."""
    data = orjson.dumps(body)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    ok = 0
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok, left
        while left > 0:
            left -= 1
            async with session.post(url, data=data, headers=headers) as response:
                await response.read()
                ok += response.status == 200

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    return ok


def control(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True)


def dumped_instructions(folder: Path, before: set[Path]) -> int:
    """Ir of the dump callgrind just wrote (its `summary:` / `totals:` line)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = sorted(set(folder.glob("callgrind.out.*")) - before)
        for path in new:
            text = path.read_text(errors="replace")
            found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if found:
                return int(found.group(1))
        time.sleep(0.5)
    raise RuntimeError("callgrind wrote no dump")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--connections", default="8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policy", choices=("off", "full"), default="off", help="telemetry off, or metrics+ledger")
    parser.add_argument("--out", default=str(RESULTS / "overhead-apis-instructions.md"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    ensure_tools()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (callgrind) is needed: apt-get install valgrind")
    workdir = Path(tempfile.mkdtemp(prefix="tw-instructions-"))
    upstream, upstream_port = start_api_upstream(workdir, "0-1")
    port = free_port()
    off = {"telemetry": {"metrics": {"enabled": False}}, "ledger": {"enabled": False}, "predictor": {"enabled": False}}
    full = {"telemetry": {"metrics": {"enabled": True}}}  # the ledger and the predictor on by default
    config = tokenway_config(workdir / "gw", [upstream_port], port, full if args.policy == "full" else off)
    dumps = workdir / "callgrind"
    dumps.mkdir()
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dumps}/callgrind.out.%p"]
    argv += [sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve", "--config", str(config)]
    gateway = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    counts: dict[tuple[str, int], list[float]] = {}
    connections = [int(c) for c in args.connections.split(",")]
    try:
        deadline = time.monotonic() + 900
        while http_get(url + "/readyz")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway under callgrind never got ready")
            time.sleep(1)
        control(gateway.pid, "-i", "on")
        for round_ in range(args.rounds):
            names = list(REQUESTS) if round_ % 2 == 0 else list(REQUESTS)[::-1]
            for c in connections:
                for name in names:
                    path, body = REQUESTS[name]
                    asyncio.run(load(url + path, body, args.warmup, c))
                    control(gateway.pid, "-z")
                    ok = asyncio.run(load(url + path, body, args.requests, c))
                    before = set(dumps.glob("callgrind.out.*"))
                    control(gateway.pid, "-d")
                    per_request = dumped_instructions(dumps, before) / max(ok, 1)
                    counts.setdefault((name, c), []).append(per_request)
                    print(f"{name} c={c}: {per_request:,.0f} instructions / request ({ok} ok)", flush=True)
    finally:
        gateway.terminate()
        gateway.wait(60)
        upstream.terminate()
        upstream.wait(10)
    write(counts, Path(args.out), args, load_before, os.getloadavg())
    return 0


def write(
    counts: dict[tuple[str, int], list[float]],
    out: Path,
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    lines = [
        "# Gateway instructions per request by API (callgrind)",
        "",
        f"Generated by `python -m bench.overhead.instructions --policy {args.policy}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: the gateway and instant upstream of "
        "`bench.overhead.apis` ("
        + ("auth, telemetry off" if args.policy == "off" else "auth, metrics, ledger, predictor")
        + ", native pass-through), "
        f"the gateway under Valgrind's callgrind; per API {args.requests} requests at {args.connections} in "
        f"flight (each count in turn) after {args.warmup} of warm-up, the APIs alternating {args.rounds} times "
        "(every other round in "
        "reverse order). Instructions the gateway executed per request, counters zeroed before and dumped after "
        "each point (they do not depend on the host's load, which was "
        + " / ".join(f"{x:.2f}" for x in load_before)
        + " before and "
        + " / ".join(f"{x:.2f}" for x in load_after)
        + " after).",
        "",
        "| API | connections | instructions / request (per round) | vs chat (per round) |",
        "| --- | ---: | --- | --- |",
    ]
    verdicts = []
    for (name, c), values in counts.items():
        chat = counts[("chat completions", c)]
        ratios = [v / base for v, base in zip(values, chat, strict=True)]
        if name != "chat completions":
            verdicts.append(
                f"- {name}, {c} connections: {max(ratios):.3f}x ({'met' if max(ratios) <= 1.10 else 'missed'})"
            )
        lines.append(
            f"| {name} | {c} | {' / '.join(f'{v:,.0f}' for v in values)} | {' / '.join(f'{r:.3f}x' for r in ratios)} |"
        )
    lines += ["", "Target: at most 1.10x chat completions' work per request (the highest round):", *verdicts]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
