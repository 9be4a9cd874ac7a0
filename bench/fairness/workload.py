"""What the fairness benchmark sends: three tenants' open-loop arrivals, in phases.

Rates are shares of the fleet's measured capacity in tokens per second (uncached prompt + output),
so the same file saturates a fast or a slow machine alike. Each request is a streamed chat
completion with a unique prompt of exact length (cl100k words of one token each, the replay
benchmark's `PromptBuilder`), `max_tokens` 1024 (what clients typically send) and the engine extra
`min_tokens` set to the request's drawn length: with the simulator's natural length near 1 token,
the engine generates exactly that many, while the gateway, which only sees `max_tokens`, must
predict it (the output-length estimates and their drift correction are measured on this).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.replay.workload import PromptBuilder, TraceRequest

MAX_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Phase:
    """From `start_s` to `end_s`: offered tokens/s as a share of capacity, mean output tokens."""

    start_s: float
    end_s: float
    capacity_share: float
    mean_output_tokens: float


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    key: str
    priority: str
    weight: float
    prompt_tokens: int
    phases: tuple[Phase, ...]


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    tenant: str
    at_s: float
    prompt_tokens: int
    output_tokens: int
    prompt: str

    @property
    def cost_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def _length(rng: random.Random, mean: float) -> int:
    sigma = 0.5
    mu = math.log(mean) - sigma * sigma / 2
    return int(min(max(round(rng.lognormvariate(mu, sigma)), 8), MAX_TOKENS))


def schedule(
    tenants: list[TenantSpec], capacity_tokens_per_s: float, *, seed: int, prompts: PromptBuilder, salt: str
) -> list[Request]:
    """Poisson arrivals of every tenant, in time order."""
    out: list[tuple[float, str, int, int]] = []
    for spec in tenants:
        rng = random.Random(f"{seed}:{spec.name}")
        for phase in spec.phases:
            rate = phase.capacity_share * capacity_tokens_per_s / (spec.prompt_tokens + phase.mean_output_tokens)
            t = phase.start_s
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= phase.end_s:
                    break
                out.append((t, spec.name, spec.prompt_tokens, _length(rng, phase.mean_output_tokens)))
    out.sort()
    return [
        Request(i, tenant, at, prompt, output, prompts.prompt(TraceRequest(i, at, prompt, output), salt))
        for i, (at, tenant, prompt, output) in enumerate(out)
    ]
