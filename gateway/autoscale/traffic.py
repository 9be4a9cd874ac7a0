"""What the gateway sees of each autoscaled pool's traffic: token rates, the request mix, speed.

Every request is counted when it arrives for a pool (held or not), so a pool at zero replicas still
shows its demand: its uncached prompt tokens (the prompt less the pool's recent cache-hit share)
and its expected output tokens (the pool's recent mean output). At the end of each request the mix
(mean uncached prompt, mean output) and the cache-hit share learn from what really happened, and a
finished stream's measured TPOT beside the batch it decoded in calibrates the capacity model.
Until the first request of a pool finishes, the mix follows the arrivals instead (their prompts,
their `max_tokens` as the output bound): a cold pool's first plan would otherwise size replicas for a
default mix (a code pool's long prompts and short outputs read as five times the prefill work per
replica it really is), and the first scale-up is the one that decides a cold start.
The arrival times since the last sample are kept too (bounded): when a window reads as a step up, the
planning loop measures the new rate over the window's second half, as a burst that began mid-window
is diluted by the half before it.
Bounded: one small record per configured pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from predictor.capacity import Calibration, Mix

_MIX_WEIGHT = 0.05  # EWMA weight of one request in the mix
_TIMES_KEPT = 4096  # arrival times of one window (more arrivals: the newest are kept)
_DEFAULT_MIX = Mix()


@dataclass(slots=True)
class PoolTraffic:
    prefill_tokens: float = 0.0  # since the last sample
    decode_tokens: float = 0.0
    requests: int = 0
    total_requests: int = 0
    last_request_s: float = float("-inf")
    prompt_tokens: float = _DEFAULT_MIX.prompt_tokens  # EWMA of uncached prompt tokens
    output_tokens: float = _DEFAULT_MIX.output_tokens  # EWMA of output tokens
    cached_share: float = 0.0
    seen: int = 0  # finished requests folded into the mix
    guessed: int = 0  # arrivals folded into the mix while none has finished
    calibration: Calibration = field(default_factory=Calibration)
    times: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMES_KEPT))  # since the last take

    def arrived(self, prompt_tokens: int, max_output: int | None, now_s: float) -> None:
        uncached = prompt_tokens * (1.0 - self.cached_share)
        if self.seen == 0:  # nothing finished yet: what the requests say about themselves
            weight = 1.0 if self.guessed == 0 else _MIX_WEIGHT
            self.guessed += 1
            self.prompt_tokens += weight * (uncached - self.prompt_tokens)
            if max_output is not None:
                bound = min(float(max(max_output, 1)), _DEFAULT_MIX.output_tokens)
                self.output_tokens += weight * (bound - self.output_tokens)
        expected = self.output_tokens if max_output is None else min(self.output_tokens, max_output)
        self.prefill_tokens += uncached
        self.decode_tokens += expected
        self.requests += 1
        self.total_requests += 1
        self.last_request_s = now_s
        self.times.append(now_s)

    def finished(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        if prompt_tokens <= 0:
            return
        weight = 1.0 if self.seen == 0 else _MIX_WEIGHT
        self.seen += 1
        uncached = max(prompt_tokens - cached_tokens, 0)
        self.prompt_tokens += weight * (uncached - self.prompt_tokens)
        self.output_tokens += weight * (max(output_tokens, 1) - self.output_tokens)
        self.cached_share += weight * (min(cached_tokens / prompt_tokens, 1.0) - self.cached_share)

    def take(self) -> tuple[float, float, int]:
        """(prefill tokens, decode tokens, requests) since the last call."""
        taken = (self.prefill_tokens, self.decode_tokens, self.requests)
        self.prefill_tokens = self.decode_tokens = 0.0
        self.requests = 0
        self.times.clear()
        return taken

    def arrived_since(self, since_s: float) -> int:
        """Arrivals of the current window at or after `since_s`."""
        count = 0
        for at_s in reversed(self.times):
            if at_s < since_s:
                break
            count += 1
        return count

    @property
    def mix(self) -> Mix:
        return Mix(max(self.prompt_tokens, 1.0), max(self.output_tokens, 1.0))
