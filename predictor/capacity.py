"""Token velocity: how many prompt and output tokens per second one replica sustains within its SLO.

The autoscaler sizes pools in tokens (TokenScale, arXiv 2512.03416: prefill, network and decode
token rates per stage), so it needs each replica's velocity at the objective, not its peak
throughput. It comes from the capacity model the latency prior runs on (the pool's roofline,
`predictor/prior.py`), for the pool's current request mix (mean uncached prompt P, mean output O),
as the largest request rate r (engine time) a replica keeps within every limit:

    decode batch   D = r·O·s, the fixed point of s = steady_step(D, context D·(P + O/2), prompts at r·P)
    TPOT           s ≤ tpot_slo                          (role both, decode)
    batch slots    D ≤ max_num_seqs, KV  D·(P + O/2) ≤ kv_tokens
    TTFT           n·p·(1 + u / (2(1 - u))) + s/2 ≤ ttft_slo  (role both, prefill)
                   n = ceil(P / chunk) prefill steps of duration p, u = r·n·p the engine's busy share
                   in prefill (an M/D/1 wait for the steps ahead)

so velocity = (r·P prefill tokens/s, r·O decode tokens/s) and which limit bound it. A prefill-role
replica has no decodes and only the TTFT limit; a decode-role replica has no prefill and no TTFT
limit. Velocities are wall-clock (x the simulated engine's time scale) and multiplied by a
measured calibration factor: the median ratio of the roofline's step to the TPOT the gateway
measured on each replica's streams (`Calibration`), so an engine slower than its preset plans for
its real speed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from predictor.prior import LatencyPrior

_SEARCH_STEPS = 40
_FIXED_POINT_STEPS = 16
_MIN_CHUNK = 64


@dataclass(frozen=True, slots=True)
class Mix:
    """A pool's recent requests on average: uncached prompt tokens and output tokens."""

    prompt_tokens: float = 1000.0
    output_tokens: float = 200.0


@dataclass(frozen=True, slots=True)
class Velocity:
    """One replica's sustainable token rates at the SLO (wall-clock tokens/s) and what bounds them."""

    prefill_tps: float
    decode_tps: float
    requests_per_s: float
    batch: float  # decode batch at that rate
    limit: str  # tpot | ttft | seqs | kv | none


def replica_velocity(
    prior: LatencyPrior,
    mix: Mix,
    *,
    ttft_slo_ms: float,
    tpot_slo_ms: float,
    role: str = "both",
    kv_tokens: float | None = None,
    factor: float = 1.0,
) -> Velocity:
    """The velocity of one replica of `prior`'s pool serving `mix` (module docstring)."""
    scale = prior.time_scale
    ttft_s = ttft_slo_ms / 1e3 * scale  # engine seconds
    tpot_s = tpot_slo_ms / 1e3 * scale
    prompt = max(mix.prompt_tokens, 1.0)
    output = max(mix.output_tokens, 1.0) if role != "prefill" else 1.0

    def check(rate: float) -> str | None:
        return _violation(prior, rate, prompt, output, ttft_s, tpot_s, role, kv_tokens)

    low, high = 0.0, 1.0
    while check(high) is None and high < 1e7:
        low, high = high, high * 2
    for _ in range(_SEARCH_STEPS):
        mid = (low + high) / 2
        if check(mid) is None:
            low = mid
        else:
            high = mid
    limit = check(high) or "none"
    batch = _decode_batch(prior, low, prompt, output, role)[0] if role != "prefill" else 0.0
    rate = low * scale * factor  # wall-clock requests/s
    return Velocity(rate * prompt if role != "decode" else 0.0, rate * output, rate, batch, limit)


def _decode_batch(prior: LatencyPrior, rate: float, prompt: float, output: float, role: str) -> tuple[float, float]:
    """(D, s): the decode batch and mean step at `rate` requests per engine second (fixed point)."""
    prefill_rate = rate * prompt if role == "both" else 0.0
    batch, step = 1.0, 0.0
    for _ in range(_FIXED_POINT_STEPS):
        context = batch * (prompt + output / 2)
        step = prior.steady_step_s(batch, context, prefill_rate, prompt)
        batch = max(rate * output * step, 1.0)
    return batch, step


def _violation(
    prior: LatencyPrior,
    rate: float,
    prompt: float,
    output: float,
    ttft_s: float,
    tpot_s: float,
    role: str,
    kv_tokens: float | None,
) -> str | None:
    """The first limit `rate` breaks, or None when a replica keeps every one."""
    batch, step = (0.0, 0.0) if role == "prefill" else _decode_batch(prior, rate, prompt, output, role)
    if role != "prefill":
        if step > tpot_s:
            return "tpot"
        if batch > prior.max_num_seqs:
            return "seqs"
        if kv_tokens is not None and batch * (prompt + output / 2) > kv_tokens:
            return "kv"
    if role == "decode":
        return None
    decodes = batch
    chunk = max(prior.max_num_batched_tokens - decodes, _MIN_CHUNK)
    steps = math.ceil(prompt / chunk)
    per_step = prompt / steps
    context = batch * (prompt + output / 2)
    prefill_step = prior.roofline.step_s(
        per_step + decodes, decodes + 1, per_step * (per_step + 1) / 2 + context + decodes, context, True
    )
    busy = rate * steps * prefill_step
    if busy >= 1.0:
        return "ttft"
    ttft = steps * prefill_step * (1 + busy / (2 * (1 - busy))) + step / 2
    return "ttft" if ttft > ttft_s else None


class Calibration:
    """How fast a pool's engines really decode against the roofline: the median of
    roofline step / measured TPOT over the last `window` streams (1.0 until `min_samples`)."""

    def __init__(self, window: int = 200, min_samples: int = 20, bounds: tuple[float, float] = (0.25, 2.0)) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.bounds = bounds

    def observe(self, prior: LatencyPrior, tpot_ms: float, batch: float, context_tokens: float) -> None:
        """One finished stream: its measured TPOT (wall ms) beside the batch it decoded in."""
        if tpot_ms <= 0 or batch < 1:
            return
        modelled_ms = prior.steady_step_s(batch, context_tokens, 0.0, 0.0) * 1e3 / prior.time_scale
        self._ratios.append(modelled_ms / tpot_ms)

    @property
    def factor(self) -> float:
        if len(self._ratios) < self.min_samples:
            return 1.0
        low, high = self.bounds
        return min(max(statistics.median(self._ratios), low), high)

    @property
    def samples(self) -> int:
        return len(self._ratios)
