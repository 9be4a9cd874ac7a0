"""The sim-speed benchmark's load: a deterministic workload (Poisson arrivals, log-normal prompt and
output lengths) and the streaming chat-completion client that sends it, open or closed loop, and
keeps what each request saw on the wall clock beside the engine's own simulated timings.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

# Common English words, each one cl100k token with its leading space: ~1 prompt token per word.
_WORDS = (
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
)


@dataclass(slots=True)
class Spec:
    index: int
    arrival_s: float  # wall seconds after the start (open loop)
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Result:
    instance: int
    ok: bool
    wall_ttft_s: float
    wall_e2e_s: float
    sim_ttft_s: float
    sim_e2e_s: float
    sim_tpot_s: float
    completion_tokens: int


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def make_specs(count: int, rate: float, prompt_mean: float, output_mean: float, seed: int) -> list[Spec]:
    """Deterministic workload: Poisson arrivals, log-normal prompt and output lengths (sigma 0.8)."""
    rng = random.Random(seed)
    specs: list[Spec] = []
    arrival = 0.0
    for index in range(count):
        arrival += rng.expovariate(rate) if rate > 0 else 0.0
        prompt_len = max(16, min(8000, round(_lognormal(rng, prompt_mean))))
        output_len = max(1, min(2048, round(_lognormal(rng, output_mean))))
        words = " ".join(rng.choice(_WORDS) for _ in range(prompt_len))
        specs.append(Spec(index, arrival, f"request {index} {seed}:{words}", output_len))
    return specs


async def one_request(session: aiohttp.ClientSession, url: str, instance: int, spec: Spec) -> Result:
    body = {
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first = 0.0
    events = 0
    tail = b""
    try:
        async with session.post(
            url + "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return Result(instance, False, 0, 0, 0, 0, 0, 0)
            async for data in resp.content.iter_any():
                if not first:
                    events += data.count(b"data: ")
                    if events >= 2:  # the role chunk, then the first token
                        first = time.monotonic()
                tail = (tail + data)[-8192:]
    except aiohttp.ClientError:
        return Result(instance, False, 0, 0, 0, 0, 0, 0)
    end = time.monotonic()
    usage: dict[str, Any] = {}
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {"):
            usage = orjson.loads(event[6:])
            break
    metrics = usage.get("metrics") or {}
    tokens = int((usage.get("usage") or {}).get("completion_tokens", 0))
    return Result(
        instance,
        tokens > 0,
        (first or end) - start,
        end - start,
        float(metrics.get("ttft_s", 0.0)),
        float(metrics.get("e2e_s", 0.0)),
        float(metrics.get("tpot_s", 0.0)),
        tokens,
    )


async def open_loop(urls: list[str], specs: list[Spec]) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks: list[asyncio.Task[Result]] = []
        t0 = time.monotonic()
        for spec in specs:
            delay = t0 + spec.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            instance = spec.index % len(urls)
            tasks.append(asyncio.create_task(one_request(session, urls[instance], instance, spec)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(urls: list[str], specs: list[Spec], concurrency: int, duration_s: float) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    results: list[Result] = []
    queue = iter(specs)
    deadline = time.monotonic() + duration_s

    async def stream(slot: int, session: aiohttp.ClientSession) -> None:
        instance = slot % len(urls)
        while time.monotonic() < deadline:
            spec = next(queue, None)
            if spec is None:
                return
            results.append(await one_request(session, urls[instance], instance, spec))

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(slot, session) for slot in range(concurrency * len(urls))))
    return results


async def warm_up(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        specs = make_specs(len(urls), 0.0, 64, 4, seed=99)
        await asyncio.gather(
            *(one_request(session, url, i, spec) for i, (url, spec) in enumerate(zip(urls, specs, strict=True)))
        )
