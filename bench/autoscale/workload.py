"""A bursty day, compressed: per model, arrivals from a rate curve and lengths from an Azure trace.

rate(t) = base_rps x envelope(t / day) x shape(t / day) x burst(t): the envelope is a synthetic
diurnal curve (a chat model busy all day with a quiet night; a code model used in working hours
only, idle at night), the shape the trace's own minute-by-minute arrival counts over its hour
(normalised to mean 1, stretched over the day: Azure's conversation trace rises 1.8x within its
hour, its code trace swings from 0 to 600 requests a minute), and the burst a 5x step for the chat
model late in the day. Arrivals are a non-homogeneous Poisson process drawn by thinning (seeded);
each request takes the lengths of a random row of its trace (prompt and output capped).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.replay.workload import TraceRequest, load_azure
from bench.traces import traces_dir

TRACES = traces_dir() / "azure_llm_2023"


@dataclass(frozen=True, slots=True)
class Burst:
    start: float  # fraction of the day
    end: float
    factor: float
    ramp: float = 0.01  # fraction of the day to reach the factor


@dataclass(frozen=True, slots=True)
class ModelLoad:
    model: str
    trace: str  # conv | code
    base_rps: float  # requests/s at envelope 1 and shape 1
    envelope: Callable[[float], float]
    burst: Burst | None = None
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 128


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at_s: float
    model: str
    prompt_tokens: int
    output_tokens: int


def diurnal(fraction: float) -> float:
    """Busy by day, a fifth of it at night."""
    return 0.2 + 0.8 * math.sin(math.pi * fraction) ** 2


def working_hours(fraction: float, start: float = 0.2, end: float = 0.8) -> float:
    """Nothing before `start` or after `end` of the day, a smooth hump between."""
    if fraction <= start or fraction >= end:
        return 0.0
    return math.sin(math.pi * (fraction - start) / (end - start)) ** 2


def trace_rows(trace: str, limit: int = 20_000) -> list[TraceRequest]:
    name = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}[trace]
    return load_azure(TRACES / name, limit, 0, max_total_tokens=1 << 30)


def shape(rows: Sequence[TraceRequest], buckets: int = 59) -> list[float]:
    """Requests per equal slice of the trace's span, normalised to mean 1."""
    span = max(r.arrival_s for r in rows) or 1.0
    counts = [0] * buckets
    for r in rows:
        counts[min(int(r.arrival_s / span * buckets), buckets - 1)] += 1
    mean = sum(counts) / buckets
    return [c / mean for c in counts]


def burst_factor(burst: Burst | None, fraction: float) -> float:
    if burst is None or fraction < burst.start or fraction > burst.end:
        return 1.0
    rise = min((fraction - burst.start) / burst.ramp, (burst.end - fraction) / burst.ramp, 1.0)
    return 1.0 + (burst.factor - 1.0) * rise


def rate(load: ModelLoad, curve: Sequence[float], fraction: float) -> float:
    bucket = curve[min(int(fraction * len(curve)), len(curve) - 1)]
    return load.base_rps * load.envelope(fraction) * bucket * burst_factor(load.burst, fraction)


def schedule(loads: Sequence[ModelLoad], day_s: float, seed: int = 7) -> list[Arrival]:
    """Every model's arrivals over `day_s` seconds, merged in time order."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str, int, int]] = []
    for load in loads:
        rows = trace_rows(load.trace)
        curve = shape(rows)
        peak = max(rate(load, curve, i / 2000) for i in range(2001)) * 1.05
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= day_s:
                break
            if rng.random() * peak <= rate(load, curve, t / day_s):
                row = rows[rng.randrange(len(rows))]
                prompt = min(max(row.input_tokens, 16), load.max_prompt_tokens)
                output = min(max(row.output_tokens, 1), load.max_output_tokens)
                arrivals.append((t, load.model, prompt, output))
    arrivals.sort()
    return [Arrival(i, t, model, p, o) for i, (t, model, p, o) in enumerate(arrivals)]


def offered(loads: Sequence[ModelLoad], day_s: float, step_s: float) -> dict[str, list[tuple[float, float]]]:
    """The rate curve of each model (time, requests/s) for the plot."""
    out: dict[str, list[tuple[float, float]]] = {}
    for load in loads:
        curve = shape(trace_rows(load.trace))
        points = int(day_s / step_s) + 1
        out[load.model] = [(i * step_s, rate(load, curve, i * step_s / day_s)) for i in range(points)]
    return out
