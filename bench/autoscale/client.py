"""The benchmark's client: open-loop streamed chat completions, one record per request, and a sampler
of the gateway's replicas over time.

TTFT is the wall time from sending to the first content chunk (a cold start's hold included); TPOT
the mean time per output token after it. The simulated engine's own TTFT and TPOT (simulated
seconds, from the stream's usage chunk) are kept beside them, with the gateway's own waits
(`x-tokenway-cold-start-ms`, `x-tokenway-queued-ms`): on a shared, overloaded host the wall clock
adds the host's lag, the engine clock and the gateway's waits do not. The client's connection pool
is unbounded, so no request waits in the client for a connection. A request the gateway turns away
records its status and error code; a stream that ends with the error event, without a finish reason, or with `abort` is
recorded as cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.autoscale.workload import Arrival
from bench.loadgen import chat_completion
from bench.replay.workload import PromptBuilder, TraceRequest


@dataclass(slots=True)
class Outcome:
    index: int
    model: str
    sent_s: float
    prompt_tokens: int
    output_tokens: int
    status: int = 0
    code: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    finish: str = ""
    cold_start_ms: float | None = None
    queued_ms: float | None = None  # waited in the gateway's flow/SLO queue before dispatch
    endpoint: str = ""
    pd: str = ""  # the PD decision (x-tokenway-route, when the run asks for it)
    engine_ttft_s: float | None = None  # the simulated engine's own timings (simulated seconds)
    engine_tpot_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def served(self) -> bool:
        return self.status == 200 and self.finish in ("length", "stop") and self.code == ""

    @property
    def cut(self) -> bool:
        """Admitted and streaming, then ended without its answer (an abort, a broken stream)."""
        return self.status == 200 and not self.served

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def bodies(arrivals: Sequence[Arrival], salt: str) -> list[bytes]:
    """The request bodies, built before the clock starts (prompt text of exactly the trace's length)."""
    builder = PromptBuilder(seed=11)
    out = []
    for a in arrivals:
        prompt = builder.prompt(TraceRequest(a.index, a.at_s, a.prompt_tokens, a.output_tokens), salt)
        out.append(
            orjson.dumps(
                {
                    "model": a.model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": a.output_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
        )
    return out


async def send(
    session: aiohttp.ClientSession, url: str, key: str, data: bytes, out: Outcome, timeout_s: float, debug: bool
) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if debug:
        headers["x-tokenway-debug"] = "1"
    call = await chat_completion(session, url, data, headers, timeout_s)
    out.status, out.code, out.e2e_s = call.status, call.code, call.e2e_s
    held = call.headers.get("x-tokenway-cold-start-ms")
    out.cold_start_ms = float(held) if held else None
    queued = call.headers.get("x-tokenway-queued-ms")
    out.queued_ms = float(queued) if queued else None
    out.endpoint = call.headers.get("x-tokenway-endpoint", "")
    for part in call.headers.get("x-tokenway-route", "").split("; "):
        if part.startswith("pd="):
            out.pd = part[3:]
    seen = call.stream
    out.ttft_s, out.finish = seen.ttft_s, seen.finish
    out.completion_tokens = int(seen.usage.get("completion_tokens") or 0)
    if "ttft_s" in seen.metrics:
        out.engine_ttft_s = float(seen.metrics["ttft_s"])
        out.engine_tpot_s = float(seen.metrics.get("tpot_s") or 0.0)


async def replay(
    url: str, key: str, arrivals: Sequence[Arrival], payloads: Sequence[bytes], timeout_s: float, debug: bool = False
) -> list[Outcome]:
    """Send every request at its time, whatever the answers; every outcome."""
    connector = aiohttp.TCPConnector(limit=0)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        for arrival, payload in zip(arrivals, payloads, strict=True):
            delay = arrival.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            out = Outcome(arrival.index, arrival.model, arrival.at_s, arrival.prompt_tokens, arrival.output_tokens)
            outcomes.append(out)
            tasks.append(asyncio.create_task(send(session, url, key, payload, out, timeout_s, debug)))
        await asyncio.gather(*tasks)
    return outcomes


_AWAKE = ("starting", "ready", "draining", "unhealthy")


@dataclass(slots=True)
class Sample:
    at_s: float
    awake: dict[str, int]  # pool -> devices held by awake replicas (starting, ready, draining)
    ready: dict[str, int]
    desired: dict[str, int] = field(default_factory=dict)
    asleep: dict[str, int] = field(default_factory=dict)  # pool -> devices of its sleeping replicas
    held: int = -1  # distinct devices that some awake or sleeping replica is on (-1: not sampled)
    reasons: dict[str, str] = field(default_factory=dict)  # pool -> the planner's reason at this sample


async def sample_replicas(url: str, started: float, stop: asyncio.Event, every_s: float = 1.0) -> list[Sample]:
    """The gateway's replicas every `every_s` until `stop` (from /admin/backends and /admin/pools)."""
    samples: list[Sample] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(url + "/admin/backends") as resp:
                    backends = await resp.json()
                async with session.get(url + "/admin/pools") as resp:
                    pools = await resp.json()
            except (aiohttp.ClientError, TimeoutError):
                backends, pools = {"pools": []}, {"pools": []}
            awake: dict[str, int] = {}
            asleep: dict[str, int] = {}
            ready: dict[str, int] = {}
            devices: set[tuple[str, int]] = set()
            for pool in backends.get("pools", []):
                name = pool["name"]
                awake[name] = asleep[name] = 0
                for e in pool["endpoints"]:
                    state = e["state"]
                    if state not in _AWAKE and state != "sleeping":
                        continue
                    mine = e.get("devices") or []
                    if state == "sleeping":
                        asleep[name] += len(mine) or 1
                    else:
                        awake[name] += len(mine) or 1
                    # a replica without devices (unmanaged) counts as one of its own
                    if mine:
                        devices.update(("", d) for d in mine)
                    else:
                        devices.add((e["id"], 0))
                ready[name] = sum(1 for e in pool["endpoints"] if e["state"] == "ready")
            desired = {
                p["name"]: sum(r.get("desired") or 0 for r in p["roles"].values()) for p in pools.get("pools", [])
            }
            reasons = {p["name"]: p.get("reason", "") for p in pools.get("pools", [])}
            at = time.perf_counter() - started
            samples.append(Sample(at, awake, ready, desired, asleep, len(devices), reasons))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=every_s)
    return samples
