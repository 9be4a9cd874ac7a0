"""Open-loop load generator (its own process): replays a plan against one base URL, streaming.

    python -m bench.replay.loadgen PLAN.json RESULTS.json

The plan names the URL, the model, the prompt seed and the requests (real-time arrival offsets,
trace lengths, Mooncake block ids). Prompts are built before the clock starts. Every request is a
streamed `/v1/completions` call with `ignore_eos` and `max_tokens` = the trace's output length, so
output lengths are fixed. Per request it records what the client saw (real seconds: TTFT = first
token chunk, TPOT over the rest) and what the engine reported (the `metrics` object of the final
chunk, in simulated seconds, and `usage.prompt_tokens_details.cached_tokens`). A progress line goes
to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.replay.workload import PromptBuilder, TraceRequest


@dataclass(slots=True)
class Outcome:
    index: int
    ok: bool = False
    error: str = ""
    status: int = 0
    scheduled_s: float = 0.0  # planned arrival (real seconds after start)
    late_s: float = 0.0  # how late the request was actually sent (client CPU lag)
    client_ttft_s: float = 0.0  # real seconds
    client_e2e_s: float = 0.0
    client_tpot_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""  # x-tokenway-endpoint, when the router says
    engine: dict[str, float] = field(default_factory=dict)  # the engine's `metrics` (simulated seconds)


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.sent = self.done = self.errors = 0
        self.t0 = time.monotonic()
        self._last = 0.0

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 2.0:
            return
        self._last = now
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(
            f"\r  {self.label:<28} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"in flight {self.sent - self.done:<4} errors {self.errors:<3} {now - self.t0:5.0f}s"
        )
        sys.stderr.flush()


async def one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], outcome: Outcome, headers: dict[str, str]
) -> None:
    start = time.monotonic()
    first = last = 0.0
    tail = b""
    buffer = b""
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            outcome.status = resp.status
            outcome.endpoint = resp.headers.get("x-tokenway-endpoint", "")
            if resp.status != 200:
                outcome.error = (await resp.text())[:300]
                return
            async for data in resp.content.iter_any():
                now = time.monotonic()
                if not first:
                    buffer += data
                    if b'"text":"' in buffer and _first_text(buffer):
                        first = now
                        buffer = b""
                last = now
                tail = (tail + data)[-16384:]
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    end = time.monotonic()
    final: dict[str, Any] = {}
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {"):
            final = orjson.loads(event[6:])
            if final.get("usage"):
                break
    usage = final.get("usage") or {}
    outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
    outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    outcome.engine = {k: float(v) for k, v in (final.get("metrics") or {}).items() if isinstance(v, int | float)}
    outcome.ok = outcome.completion_tokens > 0 and first > 0
    outcome.client_ttft_s = (first or end) - start
    outcome.client_e2e_s = end - start
    if outcome.completion_tokens > 1 and first:
        outcome.client_tpot_s = (last - first) / (outcome.completion_tokens - 1)
    if not outcome.ok and not outcome.error:
        outcome.error = "no tokens"


def _first_text(buffer: bytes) -> bool:
    """True once a data event carries a non-empty completion text."""
    for event in buffer.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data: {") and b'"text":"' in event:
            try:
                chunk = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                continue  # an event cut in two by the transport: the next read completes it
            if any(c.get("text") for c in chunk.get("choices") or ()):
                return True
    return False


async def replay(plan: dict[str, Any]) -> list[Outcome]:
    builder = PromptBuilder(int(plan["seed"]))
    requests = [TraceRequest(r["index"], r["arrival_s"], r["input_tokens"], r["output_tokens"], tuple(r["hash_ids"]))
                for r in plan["requests"]]  # fmt: skip
    bodies = [
        {
            "model": plan["model"],
            "prompt": builder.prompt(r),
            "max_tokens": r.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        for r in requests
    ]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {plan.get('api_key', 'none')}"}
    url = plan["url"].rstrip("/") + "/v1/completions"
    outcomes = [Outcome(r.index, scheduled_s=r.arrival_s) for r in requests]
    progress = Progress(len(requests), plan.get("label", "replay"))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=float(plan.get("timeout_s", 1800)))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def run(body: dict[str, Any], outcome: Outcome) -> None:
            progress.sent += 1
            await one(session, url, body, outcome, headers)
            progress.done += 1
            progress.errors += 0 if outcome.ok else 1
            progress.show()

        tasks: list[asyncio.Task[None]] = []
        t0 = time.monotonic()
        for r, body, outcome in zip(requests, bodies, outcomes, strict=True):
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome.late_s = max(0.0, time.monotonic() - t0 - r.arrival_s)
            tasks.append(asyncio.create_task(run(body, outcome)))
            progress.show()
        await asyncio.gather(*tasks)
    progress.show(force=True)
    sys.stderr.write("\n")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    plan = orjson.loads(Path(args[0]).read_bytes())
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    outcomes = asyncio.run(replay(plan))
    Path(args[1]).write_bytes(orjson.dumps([asdict(o) for o in outcomes]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
