"""Open-loop replay through the gateway: every request is sent at its planned time, whatever the
answers, as a streamed `/v1/completions` call with `ignore_eos` and `max_tokens` = the trace's output,
so lengths are the trace's. Per request it records what the client saw (wall seconds: TTFT = first
token chunk, TPOT over the rest), what the gateway predicted for it before it ran (the debug header
`x-tokenway-prediction`), where it ran, and how it ended (served, 503 shed/unattainable, fallback).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.predictor.workload import PromptBuilder, TraceRequest


@dataclass(slots=True)
class Outcome:
    index: int
    sheddable: bool
    input_tokens: int
    output_tokens: int
    scheduled_s: float = 0.0
    late_s: float = 0.0  # how late it was sent (client CPU lag)
    status: int = 0
    code: str = ""  # error code of a non-200 (slo_unattainable, ...)
    message: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""
    queued_ms: float = 0.0
    prediction: dict[str, float] = field(default_factory=dict)  # ttft, ttft_p90, tpot, tpot_p90 (ms)
    prediction_source: str = ""
    engine: dict[str, float] = field(default_factory=dict)  # the engine's own timings (engine seconds), if sent

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft_s is not None


_ENGINE_TIMINGS = ("arrival_s", "queue_s", "ttft_s", "tpot_s", "preemptions")


def _prediction(header: str | None) -> tuple[dict[str, float], str]:
    if not header:
        return {}, ""
    values: dict[str, float] = {}
    source = ""
    for part in header.split(";"):
        name, _, value = part.partition("=")
        if name == "source":
            source = value
        elif name in ("ttft", "ttft_p90", "tpot", "tpot_p90"):
            values[name] = float(value)
    return values, source


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], out: Outcome) -> None:
    start = time.perf_counter()
    first = last = 0.0
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            out.status = resp.status
            out.endpoint = resp.headers.get("x-tokenway-endpoint", "")
            out.prediction, out.prediction_source = _prediction(resp.headers.get("x-tokenway-prediction"))
            out.queued_ms = float(resp.headers.get("x-tokenway-slo-queued-ms", 0) or 0)
            if resp.status != 200:
                try:
                    error = orjson.loads(await resp.read()).get("error") or {}
                except orjson.JSONDecodeError:
                    error = {}
                out.code, out.message = str(error.get("code") or resp.status), str(error.get("message", ""))[:200]
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    out.code = "stream_error"
                    break
                choices = chunk.get("choices") or ()
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    if not first:
                        first = last
                usage = chunk.get("usage")
                if usage:
                    out.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
                    metrics = chunk.get("metrics")  # the simulated engine's per-request timings
                    if isinstance(metrics, dict):
                        out.engine = {k: float(metrics[k]) for k in _ENGINE_TIMINGS if k in metrics}
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.code = type(exc).__name__
    end = time.perf_counter()
    out.e2e_s = end - start
    if first:
        out.ttft_s = first - start
        if out.completion_tokens > 1 and last > first:
            out.tpot_s = (last - first) / (out.completion_tokens - 1)


async def replay(
    base_url: str,
    model: str,
    requests: Sequence[TraceRequest],
    arrivals_s: Sequence[float],
    keys: dict[bool, str],
    prompts: PromptBuilder,
    salt: str,
    label: str,
) -> list[Outcome]:
    """Send every request at `arrivals_s[i]` after the start; `keys[sheddable]` authenticates it."""
    bodies = [
        orjson.dumps(
            {
                "model": model,
                "prompt": prompts.prompt(r, salt),
                "max_tokens": r.output_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "temperature": 0,
            }
        )
        for r in requests
    ]
    outcomes = [Outcome(r.index, r.sheddable, r.input_tokens, r.output_tokens) for r in requests]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = base_url + "/v1/completions"
        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        last_report = t0
        for r, at, body, out in zip(requests, arrivals_s, bodies, outcomes, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            out.scheduled_s = at
            out.late_s = max(0.0, time.perf_counter() - t0 - at)
            headers = {
                "Authorization": f"Bearer {keys[r.sheddable]}",
                "Content-Type": "application/json",
                "x-tokenway-debug": "1",
            }
            tasks.append(asyncio.create_task(_one(session, url, body, headers, out)))
            now = time.perf_counter()
            if now - last_report > 5:
                last_report = now
                done = sum(t.done() for t in tasks)
                sys.stderr.write(f"\r  {label:<24} sent {len(tasks)}/{len(requests)} done {done} {now - t0:5.0f}s")
                sys.stderr.flush()
        await asyncio.gather(*tasks)
        sys.stderr.write(f"\r  {label:<24} done {len(tasks)} in {time.perf_counter() - t0:5.1f}s{' ' * 20}\n")
    return outcomes


def outcome_rows(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [
        {
            "index": o.index,
            "sheddable": o.sheddable,
            "input_tokens": o.input_tokens,
            "output_tokens": o.output_tokens,
            "scheduled_s": o.scheduled_s,
            "late_s": o.late_s,
            "status": o.status,
            "code": o.code,
            "message": o.message,
            "ttft_s": o.ttft_s,
            "tpot_s": o.tpot_s,
            "e2e_s": o.e2e_s,
            "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens,
            "endpoint": o.endpoint,
            "queued_ms": o.queued_ms,
            "prediction": o.prediction,
            "prediction_source": o.prediction_source,
            "engine": o.engine,
        }
        for o in outcomes
    ]


async def closed_loop(
    base_url: str,
    model: str,
    requests: Sequence[TraceRequest],
    concurrency: int,
    key: str,
    prompts: PromptBuilder,
    salt: str,
) -> list[Outcome]:
    """`concurrency` requests outstanding at all times until every one was sent (capacity probe)."""
    outcomes = [Outcome(r.index, r.sheddable, r.input_tokens, r.output_tokens) for r in requests]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    queue = list(zip(requests, outcomes, strict=True))
    queue.reverse()
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=900)
    ) as session:

        async def worker() -> None:
            while queue:
                r, out = queue.pop()
                out.scheduled_s = time.perf_counter() - t0
                body = orjson.dumps(
                    {
                        "model": model,
                        "prompt": prompts.prompt(r, salt),
                        "max_tokens": r.output_tokens,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "ignore_eos": True,
                    }
                )
                await _one(session, base_url + "/v1/completions", body, headers, out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes
