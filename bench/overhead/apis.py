"""Gateway CPU per request by API: chat completions vs Responses vs Anthropic Messages, native
pass-through (a vLLM-kind pool), in one run on one gateway process.

The instant upstream (nginx `return 200`) answers each path with a fixed body of its API; tokenway
runs with telemetry off (the first variant of `run.py`), pinned to core 0, wrk on core 1. Per API
and connection count: RPS and the gateway's CPU microseconds per request, and the ratio to chat
completions' (target: at most 1.10). The APIs alternate in rounds (every other round in reverse
order, so a drift of the host favours none); each round's ratio is taken against that round's chat
completions, and the table quotes the median over rounds with its range: one noisy round cannot
move the verdict. Results: bench/results/overhead-apis.md.

    .venv/bin/python -m bench.overhead.apis [--duration 8] [--connections 8,32] [--rounds 5]
        [--profile DIR]   # then a py-spy profile per API at the largest connection count
                          # (collapsed stacks, DIR/<api>.txt); --rounds 0 profiles only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead.run import (
    COMPLETION,
    KEY,
    LOAD_CORE,
    PROXY_CORE,
    RESULTS,
    TOKENIZE_LOCATION,
    cpu_seconds,
    ensure_tools,
    parse_wrk,
    start_nginx,
    tokenway_config,
)
from tests.support.procs import free_port, free_ports, http_get, wait_http

REPO = Path(__file__).resolve().parents[2]
RESPONSE = json.dumps(
    {
        "id": "resp_bench",
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "model": "bench-model",
        "output": [
            {
                "id": "msg_bench",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": 24,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 26,
        },
    },
    separators=(",", ":"),
)
MESSAGE = json.dumps(
    {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "bench-model",
        "content": [{"type": "text", "text": "Hello!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 24, "output_tokens": 2},
    },
    separators=(",", ":"),
)
SYSTEM, USER = "You are a helpful assistant.", "Say hello in one word."
REQUESTS = {
    "chat completions": (
        "/v1/chat/completions",
        {
            "model": "bench-model",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            "max_tokens": 8,
        },
    ),
    "responses": (
        "/v1/responses",
        {"model": "bench-model", "instructions": SYSTEM, "input": USER, "max_output_tokens": 8},
    ),
    "responses (store: false)": (
        "/v1/responses",
        {"model": "bench-model", "instructions": SYSTEM, "input": USER, "max_output_tokens": 8, "store": False},
    ),
    "messages": (
        "/v1/messages",
        {"model": "bench-model", "system": SYSTEM, "messages": [{"role": "user", "content": USER}], "max_tokens": 8},
    ),
}


def start_api_upstream(workdir: Path, cores: str) -> tuple[subprocess.Popen[bytes], int]:
    """nginx answering chat, /v1/responses and /v1/messages with the canned bodies above (and the
    tokenizer route), pinned to `cores`: the upstream both API overhead benchmarks measure against."""
    upstream_port = free_ports(1)[0]
    upstream = start_nginx(
        workdir,
        "upstream",
        f"""server {{ listen 127.0.0.1:{upstream_port};
            location = /health {{ return 200 ''; }} {TOKENIZE_LOCATION}
            location = /v1/responses {{ default_type application/json; return 200 '{RESPONSE}'; }}
            location = /v1/messages {{ default_type application/json; return 200 '{MESSAGE}'; }}
            location / {{ default_type application/json; return 200 '{COMPLETION}'; }} }}""",
        cores,
    )
    wait_http(f"http://127.0.0.1:{upstream_port}/health")
    return upstream, upstream_port


def wrk(url: str, body: dict[str, object], connections: int, duration_s: float) -> tuple[float, float, int]:
    argv = ["taskset", "-c", LOAD_CORE, "wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency"]
    argv += ["-s", str(Path(__file__).with_name("post_body.lua")), url]
    env = {**os.environ, "TW_BENCH_KEY": KEY, "TW_BENCH_BODY": json.dumps(body)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    rps, pct, errors = parse_wrk(out.stdout)
    return rps, pct["50"], errors


def profile(pid: int, out: Path, url: str, body: dict[str, object], connections: int, duration_s: float) -> None:
    """py-spy samples the gateway while wrk loads it (the profiler runs on the load core)."""
    spy = Path(sys.executable).with_name("py-spy")
    argv = ["taskset", "-c", LOAD_CORE, str(spy), "record", "--pid", str(pid), "--rate", "400", "--format", "raw",
            "--output", str(out), "--duration", f"{int(duration_s) + 1}", "--nonblocking"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(url, body, connections, duration_s)
    proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", default="8,32")
    parser.add_argument("--rounds", type=int, default=5, help="APIs alternate this many times (the median is quoted)")
    parser.add_argument("--out", default=str(RESULTS / "overhead-apis.md"))
    parser.add_argument("--profile", default="", help="a folder: py-spy profile of each API after the rounds")
    args = parser.parse_args()
    connections = [int(c) for c in args.connections.split(",")]
    args.load_before = os.getloadavg()
    ensure_tools()
    workdir = Path(tempfile.mkdtemp(prefix="tw-overhead-apis-"))
    upstream, upstream_port = start_api_upstream(workdir, LOAD_CORE)
    port = free_port()
    off = {"telemetry": {"metrics": {"enabled": False}}, "ledger": {"enabled": False}, "predictor": {"enabled": False}}
    config = tokenway_config(workdir / "gw", [upstream_port], port, off)
    argv = ["taskset", "-c", PROXY_CORE, sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING"]
    gateway = subprocess.Popen(
        [*argv, "serve", "--config", str(config)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    url = f"http://127.0.0.1:{port}"
    results: dict[tuple[str, int], list[tuple[float, float, float, int]]] = {}
    try:
        deadline = time.monotonic() + 60
        while http_get(url + "/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        for round_ in range(args.rounds):
            for c in connections:
                names = list(REQUESTS) if round_ % 2 == 0 else list(REQUESTS)[::-1]
                for name in names:
                    path, body = REQUESTS[name]
                    wrk(url + path, body, c, args.warmup)
                    before = cpu_seconds(gateway.pid)
                    rps, p50, errors = wrk(url + path, body, c, args.duration)
                    cpu_us = (cpu_seconds(gateway.pid) - before) / max(rps * args.duration, 1) * 1e6
                    results.setdefault((name, c), []).append((rps, p50, cpu_us, errors))
                    print(f"{name} c={c}: {rps:,.0f} rps, {cpu_us:.0f} us CPU/request, errors={errors}", flush=True)
        if args.profile:
            folder = Path(args.profile)
            folder.mkdir(parents=True, exist_ok=True)
            for name, (path, body) in REQUESTS.items():
                out = folder / (name.replace(" ", "-").replace("(", "").replace(")", "").replace(":", "") + ".txt")
                profile(gateway.pid, out, url + path, body, max(connections), args.duration)
                print(f"profile of {name}: {out}", flush=True)
    finally:
        gateway.terminate()
        gateway.wait(10)
        upstream.terminate()
        upstream.wait(10)
    args.load_after = os.getloadavg()
    if results:
        write(results, connections, Path(args.out), args)
    return 0


def write(
    results: dict[tuple[str, int], list[tuple[float, float, float, int]]],
    connections: list[int],
    out: Path,
    args: argparse.Namespace,
) -> None:
    def median(values: list[float]) -> float:
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    lines = [
        "# Gateway overhead by API",
        "",
        f"Generated by `python -m bench.overhead.apis` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: one "
        f"tokenway process (auth, telemetry off) pinned to core {PROXY_CORE}, wrk and the instant upstream (nginx, "
        f"a fixed answer per API) on core {LOAD_CORE}; {args.duration:g} s per point, the APIs alternating "
        f"{args.rounds} times (every other round in reverse order). Native pass-through (a vLLM-kind pool). "
        "CPU = the gateway's user + system time per request; RPS, p50 and CPU are medians over the rounds; "
        "*CPU vs chat* is the median over rounds of the API's CPU / that round's chat completions CPU, "
        "with the lowest and highest round in brackets. Host load average (1/5/15 min) before: "
        + " / ".join(f"{x:.2f}" for x in args.load_before)
        + ", after: "
        + " / ".join(f"{x:.2f}" for x in args.load_after)
        + ".",
        "",
        "| API | connections | RPS | p50 ms | gateway CPU µs / request | CPU vs chat (range) | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for c in connections:
        chat = results[("chat completions", c)]
        for name in REQUESTS:
            rows = results[(name, c)]
            ratios = [r[2] / base[2] for r, base in zip(rows, chat, strict=True)]
            ratio = median(ratios)
            if name != "chat completions":
                verdicts.append((name, c, ratio))
            lines.append(
                f"| {name} | {c} | {median([r[0] for r in rows]):,.0f} | {median([r[1] for r in rows]):.2f} | "
                f"{median([r[2] for r in rows]):.0f} | {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{sum(r[3] for r in rows)} |"
            )
    lines += ["", "Target: at most 1.10x chat completions' CPU per request."]
    for name, c, ratio in verdicts:
        lines.append(f"- {name}, {c} connections: {ratio:.2f}x ({'met' if ratio <= 1.10 else 'missed'})")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
