"""Instructions per request at short and ~90k-token prompts: tokenway against the bare pass-through.

Issue 46 asks that a long prompt cost the gateway about what a short one does beyond moving its bytes:
a prompt is scanned or copied once, tokenized only where a decision needs it, and a growing
conversation's known prefix is not paid again turn after turn. Wall-clock RPS on this shared host
moves by tens of percent; instruction counts under Valgrind's callgrind do not (the method of
`bench.overhead.instructions`). Both processes run under callgrind, one at a time, against one
instant upstream (nginx; its `/tokenize` answers a canned count, so the engine tokenizer costs the
gateway one round trip and no engine time).

Workloads (chat completions, `max_tokens` 8):
- `short`: the ~30-token request of `bench.overhead`;
- `long, same prompt`: one ~90k-token prompt sent again and again (what a wrk run measures);
- `long, growing conversation`: a conversation that starts at ~90k tokens and gains a ~300-token turn
  per request, so no two prompts are equal and every one shares its predecessor's prefix (an agent).

The words are drawn from a fixed vocabulary with a fixed seed (nothing downloaded); "tokens" are the
gateway's own estimate, about a word each. Results: bench/results/overhead-long-prompt.md.

    .venv/bin/python -m bench.overhead.long_prompt [--requests 60] [--rounds 2] [--prompt-words 90000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import orjson

from bench.overhead.apis import start_api_upstream
from bench.overhead.instructions import control, dumped_instructions
from bench.overhead.run import KEY, RESULTS, ensure_tools, tokenway_config
from tests.support.procs import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]
_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which have not but "
    "all were when there can been has more one would their if will its so about into than them some "
    "model token cache replica prefix budget request answer engine prompt stream tool result agent call"
)
_VOCABULARY = _WORDS.split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(n))


def short_bodies() -> Iterator[dict[str, object]]:
    body = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one word."},
        ],
        "max_tokens": 8,
    }
    while True:
        yield body


def same_long_bodies(prompt_words: int) -> Iterator[dict[str, object]]:
    rng = random.Random(46)
    body = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": words(rng, prompt_words)},
        ],
        "max_tokens": 8,
    }
    while True:
        yield body


def growing_bodies(prompt_words: int, seed: int, turn_words: int = 300) -> Iterator[dict[str, object]]:
    """A conversation: each request is the previous one plus an assistant turn and a user turn (a new
    conversation per round: a round must not find the last one's prompts counted already)."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": words(rng, prompt_words)},
    ]
    while True:
        yield {"model": "bench-model", "messages": list(messages), "max_tokens": 8}
        messages.append({"role": "assistant", "content": words(rng, turn_words // 3)})
        messages.append({"role": "user", "content": words(rng, turn_words - turn_words // 3)})


async def load(url: str, bodies: Iterator[dict[str, object]], requests: int, connections: int, auth: bool) -> int:
    """`requests` POSTs of successive bodies with `connections` in flight; the number answered 200."""
    datas = [orjson.dumps(next(bodies)) for _ in range(requests)]
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {KEY}"
    ok = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok
        while datas:
            data = datas.pop(0)
            async with session.post(url, data=data, headers=headers) as response:
                await response.read()
                ok += response.status == 200

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    return ok


def under_callgrind(dumps: Path, argv: list[str], tree: Path = REPO) -> subprocess.Popen[bytes]:
    prefix = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dumps}/callgrind.out.%p"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(prefix + argv, cwd=tree, env=env, stderr=subprocess.DEVNULL)


WORKLOADS = ("short", "long, same prompt", "long, growing conversation")


def bodies_for(workload: str, prompt_words: int, round_: int) -> Iterator[dict[str, object]]:
    if workload == "short":
        return short_bodies()
    if workload == "long, same prompt":
        return same_long_bodies(prompt_words)
    return growing_bodies(prompt_words, seed=4646 + round_)


def measure(
    name: str, proc: subprocess.Popen[bytes], url: str, dumps: Path, args: argparse.Namespace, auth: bool
) -> dict[str, list[float]]:
    counts: dict[str, list[float]] = {}
    control(proc.pid, "-i", "on")
    for round_ in range(args.rounds):
        order = WORKLOADS if round_ % 2 == 0 else WORKLOADS[::-1]
        for workload in order:
            bodies = bodies_for(workload, args.prompt_words, round_)
            asyncio.run(load(url, bodies, args.warmup, args.connections, auth))
            control(proc.pid, "-z")
            ok = asyncio.run(load(url, bodies, args.requests, args.connections, auth))
            before = set(dumps.glob("callgrind.out.*"))
            control(proc.pid, "-d")
            per_request = dumped_instructions(dumps, before) / max(ok, 1)
            counts.setdefault(workload, []).append(per_request)
            print(f"{name} / {workload}: {per_request:,.0f} instructions / request ({ok} ok)", flush=True)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=90_000)
    parser.add_argument("--out", default=str(RESULTS / "overhead-long-prompt.md"))
    parser.add_argument(
        "--baseline-tree",
        help="another checkout (e.g. `git worktree add /tmp/before HEAD~1`) whose gateway is measured too, as before",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    ensure_tools()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (callgrind) is needed: apt-get install valgrind")
    workdir = Path(tempfile.mkdtemp(prefix="tw-long-prompt-"))
    upstream, upstream_port = start_api_upstream(workdir, "0-1")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        dumps = workdir / "bare"
        dumps.mkdir()
        port = free_port()
        argv = [sys.executable, "-m", "bench.overhead.passthrough", str(port), f"http://127.0.0.1:{upstream_port}"]
        bare = under_callgrind(dumps, argv)
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", 900, bare, status=405)  # POST only
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            results["bare aiohttp pass-through"] = measure("bare", bare, url, dumps, args, auth=False)
        finally:
            bare.terminate()
            bare.wait(60)
        trees = [("tokenway (full policy)", REPO)]
        if args.baseline_tree:
            trees.insert(0, ("tokenway before (full policy)", Path(args.baseline_tree).resolve()))
        for label, tree in trees:
            dumps = workdir / f"tokenway-{len(results)}"
            dumps.mkdir()
            port = free_port()
            full = {"telemetry": {"metrics": {"enabled": True}}}  # the ledger and the predictor on by default
            config = tokenway_config(workdir / f"gw-{len(results)}", [upstream_port], port, full)
            argv = [sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve", "--config", str(config)]
            gateway = under_callgrind(dumps, argv, tree)
            try:
                wait_http(f"http://127.0.0.1:{port}/readyz", 900, gateway)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                results[label] = measure(label, gateway, url, dumps, args, auth=True)
            finally:
                gateway.terminate()
                gateway.wait(60)
    finally:
        upstream.terminate()
        upstream.wait(10)
    write(results, Path(args.out), args, load_before, os.getloadavg())
    return 0


def write(
    results: dict[str, dict[str, list[float]]],
    out: Path,
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    def fmt(values: list[float]) -> str:
        return " / ".join(f"{v:,.0f}" for v in values)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    bare = results["bare aiohttp pass-through"]
    gateway = results["tokenway (full policy)"]
    before = results.get("tokenway before (full policy)")
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Long prompts: instructions per request, tokenway against the bare pass-through",
        "",
        f"Generated by `python -m bench.overhead.long_prompt` on {now}: {args.requests} requests per point after "
        f"{args.warmup} of warm-up, {args.connections} in flight, {args.rounds} rounds (every other in reverse "
        f"order), prompts of {args.prompt_words:,} words (about as many tokens). Each process under Valgrind's "
        "callgrind in turn, against one instant nginx upstream (chat completion and `/tokenize` canned); "
        "tokenway with `bench.overhead`'s full policy (API-key auth, metrics, ledger, predictor). "
        f"Host load {load_before[0]:.2f} before, {load_after[0]:.2f} after (the counts do not depend on it).",
        "",
        "| workload | bare pass-through (per round) | tokenway (per round) | tokenway / bare | "
        "tokenway minus bare, per request |"
        + (" tokenway before (per round) | before / bare | after / before |" if before else ""),
        "| --- | --- | --- | ---: | ---: |" + (" --- | ---: | ---: |" if before else ""),
    ]
    for workload in WORKLOADS:
        b, t = bare[workload], gateway[workload]
        row = f"| {workload} | {fmt(b)} | {fmt(t)} | {mean(t) / mean(b):.2f}x | {mean(t) - mean(b):,.0f} |"
        if before:
            w = before[workload]
            row += f" {fmt(w)} | {mean(w) / mean(b):.2f}x | {mean(t) / mean(w):.2f}x |"
        lines.append(row)
    extra_short = mean(gateway["short"]) - mean(bare["short"])
    extra_long = mean(gateway["long, same prompt"]) - mean(bare["long, same prompt"])
    extra_growing = mean(gateway["long, growing conversation"]) - mean(bare["long, growing conversation"])
    lines += [
        "",
        f"What the gateway adds to a ~{args.prompt_words // 1000}k-token prompt beyond the pass-through: "
        f"{extra_long / max(extra_short, 1):.1f}x what it adds to a short one for the same prompt again, "
        f"{extra_growing / max(extra_short, 1):.1f}x for a growing conversation.",
        "",
    ]
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
