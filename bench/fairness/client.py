"""The benchmark's client: open-loop streamed chat completions, one record per request.

TTFT is the wall time from sending to the first content chunk; usage comes from the stream's final
usage chunk (`include_usage`), and the simulated engine's own TTFT from the `metrics` beside it. A
request the gateway turns away records its status and error code; one that does not finish within
`timeout_s` is cancelled (the client gives up, as users do) and counts as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

from bench.fairness.workload import MAX_TOKENS, Request
from bench.loadgen import chat_completion


@dataclass(slots=True)
class Outcome:
    index: int
    tenant: str
    gateway: int
    sent_s: float  # since the schedule's start
    offered_tokens: float = 0.0  # what it asked for: prompt + the output it will generate
    late_s: float = 0.0
    status: int = 0
    code: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queued_ms: float = 0.0
    flow: str = ""  # x-tokenway-flow (debug): the gateway's cost and output predictions
    # the simulated engine's own TTFT (engine seconds, from the stream's `metrics`): from the engine
    # receiving the request to its first token, with no host lag in it (the wall clock has it)
    engine_ttft_s: float | None = None
    endpoint: str = ""  # x-tokenway-endpoint: the engine that served it (where its prefill ran)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft_s is not None and self.completion_tokens > 0

    def row(self) -> dict[str, Any]:
        return asdict(self)


def body(request: Request, model: str) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": request.prompt}],
            "max_tokens": MAX_TOKENS,
            "min_tokens": request.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send(session: aiohttp.ClientSession, url: str, key: str, data: bytes, out: Outcome, timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "x-tokenway-debug": "1"}
    call = await chat_completion(session, url, data, headers, timeout_s)
    out.status, out.code, out.e2e_s = call.status, call.code, call.e2e_s
    out.queued_ms = float(call.headers.get("x-tokenway-queued-ms", 0) or 0)
    out.flow = call.headers.get("x-tokenway-flow", "")
    out.endpoint = call.headers.get("x-tokenway-endpoint", "")
    usage = call.stream.usage
    out.ttft_s = call.stream.ttft_s
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.completion_tokens = int(usage.get("completion_tokens") or 0)
    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if "ttft_s" in call.stream.metrics:
        out.engine_ttft_s = float(call.stream.metrics["ttft_s"])


async def replay(
    gateways: Sequence[str], model: str, keys: dict[str, str], requests: Sequence[Request], timeout_s: float
) -> list[Outcome]:
    """Send every request at its time (alternating gateways), whatever the answers; every outcome."""
    connector = aiohttp.TCPConnector(limit=0)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        for request in requests:
            delay = request.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            gateway = request.index % len(gateways)
            out = Outcome(request.index, request.tenant, gateway, request.at_s, request.cost_tokens, max(-delay, 0.0))
            outcomes.append(out)
            call = send(session, gateways[gateway], keys[request.tenant], body(request, model), out, timeout_s)
            tasks.append(asyncio.create_task(call))
        await asyncio.gather(*tasks)
    return outcomes


async def warm(gateways: Sequence[str], model: str, keys: dict[str, str]) -> None:
    """One small request per tenant through each gateway, one at a time: first requests pay one-off
    costs (tokenizer, connections) that are no part of what is measured."""
    async with aiohttp.ClientSession() as session:
        for url in gateways:
            for tenant, key in keys.items():
                request = Request(-1, tenant, 0.0, 8, 4, "Say hi.")
                await send(session, url, key, body(request, model), Outcome(-1, tenant, 0, 0.0), timeout_s=60.0)


async def closed_loop(
    gateway: str, model: str, key: str, requests: Sequence[Request], concurrency: int, duration_s: float
) -> tuple[float, list[Outcome]]:
    """`concurrency` clients back to back for `duration_s`: (measured seconds, outcomes)."""
    outcomes: list[Outcome] = []
    pending = iter(requests)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() - start < duration_s:
                request = next(pending, None)
                if request is None:
                    return
                out = Outcome(request.index, request.tenant, 0, time.perf_counter() - start)
                await send(session, gateway, key, body(request, model), out, timeout_s=duration_s * 2)
                outcomes.append(out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, outcomes
