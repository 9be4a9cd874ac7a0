"""A short forecast of a token rate: exponential smoothing with a trend (Holt's linear method).

The planner must start replicas a start-up time before the load needs them, so it looks ahead by
that time on the rate's level and trend instead of reacting to the last window alone:

    level_t = a·rate_t + (1 - a)·(level + trend·dt)
    trend_t = b·(level_t - level) / dt + (1 - b)·trend
    forecast(h) = max(0, level_t + trend_t·h)

A smoothed level trails a step: after a 5x burst begins it reads about 3x, and the planner asks
for its replicas a pass later than a planner that counts the engines' busy slots. So a window whose
arrivals are improbably many for the forecast (`stepped_up`: more than `z` Poisson deviations above
the expected count) is a step, not noise: the level takes that window's rate at once (`update(...,
step=True)`) and the trend folds in the rise as usual. A window that holds the step's start reads
under the new rate (part of it came before): the caller passes the rate of the window's second half
(gateway/autoscale/loop.py), which takes a step only when the replicas running cannot absorb it. Falls
stay smoothed: a scale-down waits for the measured level anyway.

A pure value: `update` returns the next forecast; the caller keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Forecast:
    level: float = 0.0  # tokens/s now (smoothed)
    trend: float = 0.0  # tokens/s per second
    at_s: float = 0.0  # when it was last updated (monotonic); 0 = never

    def ahead(self, horizon_s: float) -> float:
        """The rate expected `horizon_s` from `at_s` (never negative)."""
        return max(0.0, self.level + self.trend * max(horizon_s, 0.0))

    def update(self, rate: float, now_s: float, alpha: float, beta: float, *, step: bool = False) -> Forecast:
        """Fold in the rate measured over the interval that ends at `now_s`; with `step`, a rate
        above the prediction becomes the level at once."""
        if self.at_s == 0.0:
            return Forecast(rate, 0.0, now_s)
        dt = now_s - self.at_s
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = rate if step and rate > predicted else alpha * rate + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        return Forecast(max(level, 0.0), trend, now_s)


def stepped_up(count: float, expected: float, z: float) -> bool:
    """Whether `count` arrivals in a window are a step up from `expected` (their forecast): more than
    `z` standard deviations of a Poisson count above it (z <= 0: never)."""
    return z > 0 and count > expected + z * math.sqrt(max(expected, 1.0))
